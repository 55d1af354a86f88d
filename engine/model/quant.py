"""Weight-only quantized forms of a decode product's weight, for torch's CPU int4 and int8 kernels.

Two candidates of the decode autotuner (engine.model.kernels) multiply a row by a quantized weight instead of the
float one; the tuner measures them beside the float candidates and uses one only where it is faster.

- int4: torch._weight_int4pack_mm_for_cpu(x, packed, 32, scale_zero) computes x·Wᵀ with
  W[n, k] = (q[n, k] − 8) · scale[k // 32, n] + zero[k // 32, n], q ∈ 0…15 (checked against the kernel itself in
  tests/engine/test_quant_path.py), packed by torch._convert_weight_to_int4pack_for_cpu from q as int32 (out, in).
  Built only from a GGUF file's own Q4_0 or Q4_1 blocks, where that formula holds exactly: a 32-value block
  stores d (float16), for Q4_1 also m (float16), and 32 four-bit q, and gguf's dequantization is w = d·(q − 8)
  (Q4_0) or w = d·q + m (Q4_1), so scale = d and zero = 0 (Q4_0) or m + 8·d (Q4_1).
- int8: torch._weight_int8pack_mm(x, q, scale) computes x·(q · scale[:, None])ᵀ with one scale per output row;
  built by requantizing the float weight (symmetric, scale = max|w_row| / 127), so each weight moves by at most
  half a step, 0.5 · scale (INT8_STEP_ERROR), on top of the file's own quantization.

Both kernels are fast only with bfloat16 activations (float32 ones took 4–19 × longer on an AVX2 CPU), and need the
scales in the activations' dtype: the forms keep bfloat16 scales and the candidates run x in bfloat16, so a float32
model's product is rounded once more (x and the scales to bfloat16's 8 bits). The logits through these candidates
stay within QUANT_LOGIT_TOLERANCE of the float path (tests/engine/test_quant_path.py).

Memory, per weight value: int4 0.5 byte (two q per byte) + 4 bytes of bfloat16 scale and zero per 32 values
= 0.625 byte, as the file's Q4_1 blocks; int8 1 byte + 2 bytes per row. Beside a float32 weight (4 bytes) both
forms cost 41 % more memory for those weights; engine.model.transformer.Transformer.tune_kernels drops a form the
tuner did not choose. A decode step through them reads those bytes instead of the float weight's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32  # values per Q4_0/Q4_1 block, and the int4 kernel's group size
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20}  # d (2 bytes) [m (2 bytes)] and 16 bytes of nibbles
KINDS = tuple(BLOCK_BYTES)
INT8_STEP_ERROR = 0.5  # |w − q·scale| ≤ this × the row's scale (round to nearest; scale rounded up to bf16)
ACT_DTYPE = torch.bfloat16  # the activations and scales both kernels run with
INT4_INNER_K_TILES = 2  # torch's packing argument (the CPU layout does not depend on it; CUDA's does)
INT4_ROWS = 16  # torch's CPU int4 packing needs the output rows in multiples of this


@dataclass
class QuantForms:
    """A weight's quantized forms; each None where not built (or dropped after tuning)."""

    int4: tuple[torch.Tensor, torch.Tensor] | None = None  # packed (out, in/2) uint8, scale_zero (in/32, out, 2)
    int8: tuple[torch.Tensor, torch.Tensor] | None = None  # q (out, in) int8, scale (out,)
    dropped: bool = False  # a form was freed after tuning: measuring again now would miss it (not to be cached)

    def nbytes(self) -> int:
        """The bytes these forms hold (and a decode product through one of them reads)."""
        return sum(t.numel() * t.element_size() for f in (self.int4, self.int8) if f for t in f)


def split_q4_blocks(blocks: torch.Tensor | np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0/Q4_1 tensor's raw blocks (out, in/32, bytes) -> q (out, in) int32 in 0…15, d and m (out, in/32) float32.

    Block layout (ggml): d float16, [m float16,] then 16 bytes whose low nibbles are values 0…15 and high nibbles
    values 16…31. For Q4_0, m is −8·d (w = d·(q − 8) = d·q − 8·d).
    """
    b = torch.as_tensor(np.ascontiguousarray(blocks)) if isinstance(blocks, np.ndarray) else blocks.contiguous()
    out_f, n_blocks, size = b.shape
    if size != BLOCK_BYTES[kind]:
        raise ValueError(f"{kind} blocks take {BLOCK_BYTES[kind]} bytes, these {size}")
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()  # (out, nb)
    if kind == "q4_1":
        m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        nib = b[..., 4:]
    else:
        m = -8.0 * d
        nib = b[..., 2:]
    q = torch.cat([nib & 0x0F, nib >> 4], dim=-1)  # (out, nb, 32): values 0…15, then 16…31
    return q.reshape(out_f, n_blocks * GROUP).to(torch.int32), d, m


def int4_scale_zero(d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's int4 (scale, zero) (out, in/32) float32 for w = d·q + m: (q − 8)·d + (m + 8·d)."""
    return d, m + 8.0 * d


def int4_from_blocks(blocks: torch.Tensor | np.ndarray, kind: str, dtype: torch.dtype = ACT_DTYPE,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU int4 form (packed, scale_zero in `dtype`) of a Q4_0/Q4_1 tensor's blocks (out, in/32, bytes)."""
    q, d, m = split_q4_blocks(blocks, kind)
    scale, zero = int4_scale_zero(d, m)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, INT4_INNER_K_TILES)  # (out, in/2) uint8
    scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()  # (in/32, out, 2)
    return packed, scale_zero


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """W (out, in) float32 from q (out, in) and the per-group scale and zero (out, in/32): the int4 kernel's formula."""
    return (q.float() - 8.0) * scale.repeat_interleave(GROUP, 1) + zero.repeat_interleave(GROUP, 1)


def int8_from_float(weight: torch.Tensor, dtype: torch.dtype = ACT_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (out, in) int8, scale (out,) in `dtype`) with weight ≈ q · scale[:, None], symmetric per output row.

    The scale is rounded up to `dtype` before q is computed, so max|w_row| / scale ≤ 127 and q never clips; each
    value then moves by at most INT8_STEP_ERROR · scale.
    """
    w = weight.float()
    amax = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)  # (out,)
    scale = (amax / 127).to(dtype)
    low = scale.float() * 127 < amax  # rounded down: take the next representable value up
    scale = torch.where(low, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def q4_forms(blocks: torch.Tensor, kind: str, weight: torch.Tensor) -> QuantForms:
    """The forms of a weight the file stores as Q4_0/Q4_1 blocks (out, in/32, bytes); `weight` is its float form.
    int4 only where the rows are a multiple of INT4_ROWS."""
    int4 = int4_from_blocks(blocks, kind) if weight.shape[0] % INT4_ROWS == 0 else None
    return QuantForms(int4=int4, int8=int8_from_float(weight))


# ---- the blocks' way from the loader to the model ------------------------------------------------------------------
# engine.loaders.gguf.read_weights puts a Q4 tensor's raw blocks (out, in/32, bytes) uint8 beside its float weight
# as "<weight name>.<kind>" (e.g. "layers.0.attn.wq.weight.q4_1"); they travel through the loader's weight cache
# unchanged, and take_blocks hands them to the model's projections, fused as the model fuses its weights.
FUSED = {  # the model's fused projection -> its parts, in the order engine.model.transformer.fuse_state_dict joins
    "attn.wqkv.weight": ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight"),
    "mlp.w_gate_up.weight": ("mlp.w_gate.weight", "mlp.w_up.weight"),
}


def block_name(weight_name: str, kind: str) -> str:
    """The state-dict name of a weight's raw Q4 blocks."""
    return f"{weight_name}.{kind}"


def take_blocks(sd: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, str]]:
    """Remove every Q4 block entry from `sd`; return weight name -> (blocks, kind) under the model's fused names.

    A fused projection gets blocks only where all its parts are Q4 blocks of one kind (llama.cpp's mixed files
    store some parts at other types); otherwise it runs on its float weight alone.
    """
    found: dict[str, tuple[torch.Tensor, str]] = {}
    for name in [n for n in sd if n.endswith(tuple(f".{k}" for k in KINDS))]:
        weight, kind = name.rsplit(".", 1)
        found[weight] = (sd.pop(name), kind)
    out: dict[str, tuple[torch.Tensor, str]] = {}
    for weight, (blocks, kind) in found.items():
        fused = next(((f, parts) for f, parts in FUSED.items() for p in parts if weight.endswith("." + p)), None)
        if fused is None:
            out[weight] = (blocks, kind)
            continue
        prefix = weight[: -len(next(p for p in fused[1] if weight.endswith("." + p)))]
        name = prefix + fused[0]
        parts = [found.get(prefix + p) for p in fused[1]]
        if name not in out and all(p is not None and p[1] == kind for p in parts):
            out[name] = (torch.cat([p[0] for p in parts], dim=0), kind)  # (Σ out, in/32, bytes): rows as fused
    return out

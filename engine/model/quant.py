"""Weight-only quantized forms of a decode product's weight, for torch's CPU int4 and int8 kernels.

Two candidates of the decode autotuner (engine.model.kernels) multiply a row by a quantized weight instead of the
float one; the tuner measures them beside the float candidates and uses one only where it is faster. Both change
the computation (below), so a model has them only in a kernel mode the user picks (q4_forms):
- EXACT (the default): no forms; every product multiplies the file's weights, dequantized exactly, in the run's dtype.
- FILE: the int4 form of the file's own Q4_0/Q4_1/Q4_K blocks, as llama.cpp multiplies them (bf16 activations).
- FAST: also the int8 form, a requantization on top of the file's own quantization.

- int4: torch._weight_int4pack_mm_for_cpu(x, packed, 32, scale_zero) computes x·Wᵀ with
  W[n, k] = (q[n, k] − 8) · scale[k // 32, n] + zero[k // 32, n], q ∈ 0…15 (checked against the kernel itself in
  tests/engine/test_quant_path.py), packed by torch._convert_weight_to_int4pack_for_cpu from q as int32 (out, in).
  Built only from a GGUF file's own Q4_0, Q4_1 or Q4_K blocks, where that formula holds exactly, each being
  w = d·q + m per group of 32 in gguf's dequantization, so scale = d and zero = m + 8·d:
  Q4_0: a 32-value block stores d (float16) and 32 four-bit q; w = d·(q − 8), so m = −8·d and zero = 0.
  Q4_1: d and m (float16) and 32 q; w = d·q + m.
  Q4_K: a 256-value super-block stores d and dmin (float16), eight 6-bit scales sc and mins mn (one per 32 values)
  and 256 q; w = (d·sc)·q − dmin·mn, so per group d ← d·sc and m ← −dmin·mn (both exact in float32: an 11-bit
  float16 significand times a 6-bit integer). Held to gguf.quants.dequantize bit for bit in float32
  (tests/engine/test_quant_k.py) wherever zero = 8·d·sc − dmin·mn is itself exact in float32 (all of Gemma 3
  270M's Q4_K blocks); the kernel then rounds scale and zero to bfloat16 (below), which moves a weight by at most
  2⁻⁹ · (|q − 8|·|scale| + |zero|) + the output's own bf16 rounding (measured on Gemma 3 270M: BENCHMARKS.md
  "K-quants: Gemma 3's Q4_K_M"; the tests allow 2⁻⁷ of each tensor's largest |w|).
- int8: torch._weight_int8pack_mm(x, q, scale) computes x·(q · scale[:, None])ᵀ with one scale per output row;
  built by requantizing the float weight (symmetric, scale = max|w_row| / 127), so each weight moves by at most
  half a step, 0.5 · scale (INT8_STEP_ERROR), on top of the file's own quantization. Every projection the file
  stores in a quantized type gets it: the int4 kinds above, and the others (Q5_0, Q8_0, Q6_K, …: no exact int4
  form, their steps are per 32 or 16 values and finer than 4 bits) from their dequantized float weight.
  A tied LM head is the token table: it gets the forms of the table's type as any projection does (Gemma 3 270M's
  Q8_0 table an int8 form, SmolLM2's too), and the embedding lookup keeps the float table. A shape gets one set of
  forms (take_blocks says which).

Both kernels run with bfloat16 activations (with float32 ones they were slower than the float products), and need
the scales in the activations' dtype: the forms keep bfloat16 scales and the candidates run x in bfloat16, so a float32
model's product is rounded once more (x and the scales to bfloat16's 8 bits). The logits through these candidates
stay within LOGIT_TOLERANCE of the float path (tests/engine/test_quant_path.py, test_quant_k.py; Gemma 3's
figures: BENCHMARKS.md "K-quants: Gemma 3's Q4_K_M"); greedy tokens differ only at near-ties.

Memory, per weight value: int4 0.5 byte (two q per byte) + 4 bytes of bfloat16 scale and zero per 32 values
= 0.625 byte, as the file's Q4_1 blocks (Q4_0 and Q4_K store 0.5625); int8 1 byte + 2 bytes per row. Beside a
float32 weight (4 bytes) both forms cost 41 % more memory for those weights, the int8 form alone (a REQUANT
projection) 25 %, until Transformer.tune_kernels drops a form the tuner did not choose. A decode step through them
reads those bytes instead of the float weight's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.model.kernel_cache import KERNEL_MODES

GROUP = 32  # values per Q4_0/Q4_1 block and per Q4_K scale, and the int4 kernel's group size
SUPER = 256  # values per K-quant super-block
REQUANT = "requant"  # the marker kind of a projection the file stores in another quantized type: int8 form only
# Bytes per GROUP values of each kind the loader keeps: Q4_0/Q4_1 d (2 bytes) [m (2 bytes)] and 16 bytes of nibbles;
# a Q4_K super-block (144 bytes for 256 values) as 8 slices of 18, so every kind's blocks are (out, in/32, bytes);
# the marker holds no bytes (its int8 form is made from the float weight).
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q4_k": 18, REQUANT: 0}
Q4_K_BYTES = 144  # d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
INT4_KINDS = ("q4_0", "q4_1", "q4_k")  # kinds whose blocks are exactly the int4 kernel's form
KINDS = tuple(BLOCK_BYTES)
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")  # ggml types a weight is not quantized in (no forms)
INT8_STEP_ERROR = 0.5  # |w − q·scale| ≤ this × the row's scale (round to nearest; scale rounded up to bf16)
ACT_DTYPE = torch.bfloat16  # the activations and scales both kernels run with
INT4_INNER_K_TILES = 2  # torch's packing argument (the CPU layout does not depend on it; CUDA's does)
INT4_ROWS = 16  # torch's CPU int4 packing needs the output rows in multiples of this


# The kernel modes a model is built in (KERNEL_MODES says what each means to a user)
EXACT, FILE, FAST = "exact", "file", "fast"
MODES = tuple(KERNEL_MODES)
assert MODES == (EXACT, FILE, FAST)


@dataclass
class QuantForms:
    """A weight's quantized forms; each None where not built (or dropped after tuning)."""

    int4: tuple[torch.Tensor, torch.Tensor] | None = None  # packed (out, in/2) uint8, scale_zero (in/32, out, 2)
    int8: tuple[torch.Tensor, torch.Tensor] | None = None  # q (out, in) int8, scale (out,)
    dropped: bool = False  # a form was freed after tuning: measuring again now would miss it (not to be cached)
    mode: str = FAST  # the kernel mode they were built for (FILE: the file's own int4 blocks only; FAST: int8 too)

    def nbytes(self) -> int:
        """The bytes these forms hold (and a decode product through one of them reads)."""
        return sum(t.numel() * t.element_size() for f in (self.int4, self.int8) if f for t in f)


def split_q4_blocks(blocks: torch.Tensor | np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0/Q4_1/Q4_K tensor's raw blocks (out, in/32, bytes) -> q (out, in) int32 in 0…15, d and m (out, in/32)
    float32 with w = d·q + m in each group of 32.

    Block layout (ggml): d float16, [m float16,] then 16 bytes whose low nibbles are values 0…15 and high nibbles
    values 16…31. For Q4_0, m is −8·d (w = d·(q − 8) = d·q − 8·d). Q4_K: see split_q4_k.
    """
    b = torch.as_tensor(np.ascontiguousarray(blocks)) if isinstance(blocks, np.ndarray) else blocks.contiguous()
    out_f, n_blocks, size = b.shape
    if kind not in INT4_KINDS or size != BLOCK_BYTES[kind]:
        raise ValueError(f"{kind} blocks take {BLOCK_BYTES.get(kind)} bytes per {GROUP} values, these {size}")
    if kind == "q4_k":
        return split_q4_k(b)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()  # (out, nb)
    if kind == "q4_1":
        m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        nib = b[..., 4:]
    else:
        m = -8.0 * d
        nib = b[..., 2:]
    q = torch.cat([nib & 0x0F, nib >> 4], dim=-1)  # (out, nb, 32): values 0…15, then 16…31
    return q.reshape(out_f, n_blocks * GROUP).to(torch.int32), d, m


def split_q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K blocks (out, in/32, 18): q (out, in) int32, d·sc and −dmin·mn (out, in/32) float32 (split_q4_blocks).

    Super-block layout (ggml block_q4_K, 144 bytes for 256 values): d, dmin float16; 12 bytes holding eight 6-bit
    scales sc and mins mn: bytes 0–3 carry sc 0–3 in their low 6 bits and the top 2 bits of sc 4–7, bytes 4–7 mn
    0–3 and the top bits of mn 4–7, bytes 8–11 the low 4 bits of sc 4–7 (low nibble) and mn 4–7 (high nibble);
    then 4 runs of 32 bytes, run j's low nibbles values 64j…64j+31 (group 2j), its high nibbles the next 32.
    """
    out_f, n_groups, _ = blocks.shape
    if n_groups % (SUPER // GROUP):
        raise ValueError(f"Q4_K blocks cover {n_groups * GROUP} values per row, not whole {SUPER}-value super-blocks")
    sb = blocks.reshape(out_f, n_groups * GROUP // SUPER, Q4_K_BYTES)  # (out, nsb, 144)
    d = sb[..., 0:2].contiguous().view(torch.float16).float()  # (out, nsb, 1)
    dmin = sb[..., 2:4].contiguous().view(torch.float16).float()
    lo, hi, mix = sb[..., 4:8].int(), sb[..., 8:12].int(), sb[..., 12:16].int()  # (out, nsb, 4) each
    sc = torch.cat([lo & 63, (mix & 15) | ((lo >> 6) << 4)], dim=-1)  # (out, nsb, 8)
    mn = torch.cat([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], dim=-1)
    runs = sb[..., 16:].reshape(*sb.shape[:2], 4, 1, 32)  # (out, nsb, run, 1, 32)
    q = torch.cat([runs & 0x0F, runs >> 4], dim=3)  # (out, nsb, run, low/high, 32): values in order
    return (q.reshape(out_f, n_groups * GROUP).to(torch.int32), (d * sc.float()).reshape(out_f, n_groups),
            -(dmin * mn.float()).reshape(out_f, n_groups))


def int4_scale_zero(d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's int4 (scale, zero) (out, in/32) float32 for w = d·q + m: (q − 8)·d + (m + 8·d)."""
    return d, m + 8.0 * d


def int4_from_blocks(blocks: torch.Tensor | np.ndarray, kind: str, dtype: torch.dtype = ACT_DTYPE,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU int4 form (packed, scale_zero in `dtype`) of a Q4_0/Q4_1/Q4_K tensor's blocks (out, in/32, bytes)."""
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


def q4_forms(blocks: torch.Tensor, kind: str, weight: torch.Tensor, mode: str) -> QuantForms | None:
    """The forms of a weight the file stores as `kind` blocks (out, in/32, bytes) in kernel mode `mode`; `weight`
    is its float form. int4 only for the int4 kinds and where the rows are a multiple of INT4_ROWS; int8 (a
    requantization: REQUANT gets only it) in FAST mode only. None where the mode gives this weight no form (EXACT:
    never any)."""
    if mode not in MODES:
        raise ValueError(f"unknown kernel mode {mode!r} (choose {', '.join(MODES)})")
    exact = kind in INT4_KINDS and weight.shape[0] % INT4_ROWS == 0
    int4 = int4_from_blocks(blocks, kind) if exact and mode != EXACT else None
    int8 = int8_from_float(weight) if mode == FAST else None
    return None if int4 is None and int8 is None else QuantForms(int4=int4, int8=int8, mode=mode)


# ---- the blocks' way from the loader to the model ------------------------------------------------------------------
# engine.loaders.gguf.read_weights puts a Q4 tensor's raw blocks (out, in/32, bytes) uint8 beside its float weight
# as "<weight name>.<kind>" (e.g. "layers.0.attn.wq.weight.q4_1"), and an empty (out, in/32, 0) REQUANT marker
# beside a weight of any other quantized type; they travel through the loader's weight cache unchanged, and
# take_blocks hands them to the model's projections, fused as the model fuses its weights.
FUSED = {  # the model's fused projection -> its parts, in the order engine.model.transformer.fuse_state_dict joins
    "attn.wqkv.weight": ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight"),
    "mlp.w_gate_up.weight": ("mlp.w_gate.weight", "mlp.w_up.weight"),
}


def block_name(weight_name: str, kind: str) -> str:
    """The state-dict name of a weight's raw Q4 blocks (or its REQUANT marker)."""
    return f"{weight_name}.{kind}"


def requant_marker(out_f: int, in_f: int) -> torch.Tensor:
    """What the loader keeps beside a weight of a quantized type without an int4 form: no bytes, its shape only."""
    return torch.empty(out_f, in_f // GROUP, 0, dtype=torch.uint8)


def _exact_int4(blocks: torch.Tensor, kind: str) -> bool:
    return kind in INT4_KINDS and blocks.shape[0] % INT4_ROWS == 0


def take_blocks(sd: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, str]]:
    """Remove every block entry (and REQUANT marker) from `sd`; return weight name -> (blocks, kind) under the
    model's fused names.

    A fused projection keeps its parts' blocks where all of them are blocks of one kind; parts of different
    quantized types (llama.cpp's mixed files) make a REQUANT marker (the int8 form only); a part the file stores
    in a float type leaves the fused projection without forms. Where one weight shape has both int4 forms and
    REQUANT markers, the markers go: the tuner measures a shape's weights as one group, by the forms of the first
    (engine.model.kernels.tune), so every weight with forms in a shape must have the same ones; the int4 kind,
    exact to the file, is the one kept, and the others run float.
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
        if name in out or any(p is None for p in parts):
            continue
        if all(p[1] == kind for p in parts):
            out[name] = (torch.cat([p[0] for p in parts], dim=0), kind)  # (Σ out, in/32, bytes): rows as fused
        else:
            out[name] = (requant_marker(sum(p[0].shape[0] for p in parts), blocks.shape[1] * GROUP), REQUANT)
    int4_shapes = {b.shape[:2] for b, kind in out.values() if _exact_int4(b, kind)}
    return {n: (b, kind) for n, (b, kind) in out.items() if _exact_int4(b, kind) or b.shape[:2] not in int4_shapes}

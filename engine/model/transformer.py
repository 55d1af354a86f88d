"""The transformer, defined from its parts up: RMSNorm, MLP, Attention, Block, then Transformer, which runs them.

One decoder for the Llama family (Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2/3, Phi-3) and Gemma 3: pre-norm blocks,
grouped-query attention with RoPE (adjacent-pair convention, see engine.model.rope), gated MLP, RMSNorm, optional tied
LM head. The families differ only where engine.model.config's fields say so, each a small branch here:
embedding × embedding_scale, q/k RMSNorm per head (qk_norm), norms on the attention and MLP outputs (post_norms),
GELU-tanh instead of SiLU (mlp_activation), the softmax scale (attn_scale), and sliding-window local layers with
their own RoPE base (layer_types, sliding_window, rope_base_local).

Two fusions make each decode step fewer, larger matrix-vector products: q, k and v are one projection (`wqkv`),
gate and up are one projection (`w_gate_up`). Loaders produce unfused tensors and `fuse_state_dict` joins them.

Shapes: B batch, T new tokens in this step, S positions in the cache after this step (start + T),
H query heads, KV key/value heads, G = H // KV query heads per KV head, hd head_dim, d d_model, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import attention_choice, kernel_cache, kernels, quant
from engine.model.config import ModelConfig
from engine.model.kv_cache import KVCache
from engine.model.rope import apply_rope, rope_table
from engine.model.seam import Reads
from engine.model.threads import decode_thread_counts

ROPE_ROWS = 4096  # positions of the RoPE table built at load; it doubles as a generation needs more
HEAD_RESCORE = 64  # candidates whose logits a bf16/fp16 head recomputes in float32 (see Transformer.head)
HEAD_RESCORE_MAX_ROWS = 64  # positions it does that for (decode and last-position prefill; not long all-logits)
# A bf16 decode query's `blocked` way (engine.model.attention_choice) runs its two products in bf16 over the keys up
# to a multiple of KEY_BLOCK and in float32 over the rest: oneDNN builds (JIT-compiles) a kernel for every new product
# shape and never gives its memory back, so a key count that grows by one each step cost a compile and ~1 MB per
# product per step (an engine that grew by 3 GB over an 8,000-token run: BENCHMARKS.md, "Intel Xeon with AVX-512 and
# AMX"); in blocks, a new shape comes once every KEY_BLOCK steps.
KEY_BLOCK = 256
SPLIT_MAX_ROWS = 4  # up to this many rows a product is a decode product: the kernel measured for it runs


def _bf16_packing() -> bool:
    """Can oneDNN multiply by a bfloat16 weight kept in its own blocked layout (CPUs with native bf16 dot products)?"""
    try:
        return (kernels.ONEDNN_LINEAR is not None and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    except (AttributeError, RuntimeError):
        return False


def pack_for_decode(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a CPU bfloat16 weight (out, in) for one-row products, or None where it cannot help.

    oneDNN's bf16 kernel wants the weight in its own layout (pairs of input rows interleaved for the bf16 dot
    product); given a plain tensor it reorders the whole weight on every call, so a one-row product moved several
    times the weight's bytes (bf16 decode was no faster than float32). Reordered once at load, the one-row product
    reads the bf16 weight once (BENCHMARKS.md, "bfloat16 against float32, and where a decode step's time goes").
    """
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not _bf16_packing():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: torch.Tensor | None = None,
    q: quant.QuantForms | None = None,
) -> torch.Tensor:
    """y = x·Wᵀ + b. On the CPU, a decode product (up to SPLIT_MAX_ROWS rows) runs the kernel measured fastest for
    this shape, dtype and thread count on this machine (engine.model.kernels; `packed` is pack_for_decode(W) and `q`
    W's quantized forms, each used by some candidates); more rows (prefill) are compute-bound: oneDNN's fp32 kernel
    in float32, F.linear otherwise, always on the float weight.
    """
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if x.numel() // weight.shape[1] <= SPLIT_MAX_ROWS:
        return kernels.decode_product(x, weight, bias, packed, q)
    if weight.dtype == torch.float32 and kernels.ONEDNN_LINEAR is not None:
        return kernels.onednn(x, weight, bias, None)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose forward takes the decode fast path of `linear`. Weights always come from a checkpoint."""

    packed: torch.Tensor | None = None  # pack_for_decode(weight), set by Transformer.pack_for_decode()
    quant: quant.QuantForms | None = None  # int4/int8 forms of a GGUF's Q4 weight, set by Transformer.attach_quant()

    def reset_parameters(self) -> None:  # random init is wasted work (and slow on the meta device)
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed, self.quant)


class Embedding(nn.Embedding):
    """A plain row lookup table (vocab, d); its weights always come from a checkpoint."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # x / rms(x) · w


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate_up = Linear(cfg.d_model, 2 * cfg.ffn_dim, bias=False)
        self.w_down = Linear(cfg.ffn_dim, cfg.d_model, bias=False)
        self.gelu = cfg.mlp_activation == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # (B, T, ffn) each
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)  # GeGLU (Gemma) or SwiGLU
        return self.w_down(act * up)  # (B, T, d)


def attention_mask(
    start: int | torch.Tensor, n_queries: int, key_start: int, n_keys: int, window: int, device: torch.device
) -> torch.Tensor | None:
    """(T, S) bool, True where query i (absolute position start + i) may read key j (position key_start + j).

    Causal: key ≤ query. With a sliding window W (local layers) also query - key < W, so a query reads at most W
    keys, itself included (Hugging Face's and llama.cpp's convention). None when every query reads every key.
    A tensor `start` (B,) gives every row its own positions (a ragged batch): the mask is then (B, 1, T, S), and a
    row's keys past its own last query (another row's longer history, unwritten slots) are masked out.
    """
    if isinstance(start, torch.Tensor):
        q_pos = (start[:, None] + torch.arange(n_queries, device=device))[:, None, :, None]  # (B, 1, T, 1)
    elif start >= key_start + n_keys - 1 and (not window or start + n_queries - 1 - key_start < window):
        return None  # decided from the numbers alone: a decode step builds no tensors here (2 per layer before)
    else:
        q_pos = torch.arange(start, start + n_queries, device=device)[:, None]  # (T, 1)
    k_pos = torch.arange(key_start, key_start + n_keys, device=device)  # (S,)
    mask = k_pos <= q_pos
    if window:
        mask &= q_pos - k_pos < window
    return mask


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_size: int, scale: float,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q·kᵀ·scale + mask)·v with GQA, returning the output and the weights.

    q (B, H, T, hd); k, v (B, KV, S, hd); mask (T, S) or (B, 1, T, S) bool, or None. Query head h reads KV head
    h // G, so the G heads of one group are stacked as rows of one matrix product instead of repeating k and v.
    """
    B, H, T, hd = q.shape
    KV, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, KV, group_size * T, hd)  # (B, KV, G·T, hd): rows g·T + t
    scores = (qg @ k.transpose(-1, -2)) * scale  # (B, KV, G·T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask.repeat(*(1,) * (mask.dim() - 2), group_size, 1), float("-inf"))  # (…, G·T, S)
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # (B, KV, G·T, S)
    out = weights @ v  # (B, KV, G·T, hd)
    return out.reshape(B, H, T, hd), weights.reshape(B, H, T, S)


def head_products(a: torch.Tensor, b: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """a @ b (a @ bᵀ with transpose) for a (B, KV, R, x) and b (B, KV, S, y), as one 2-D product per batch row and
    KV head. The KV cache hands out views of its first S rows: each head's (S, hd) is contiguous, the heads are not
    (a buffer holds `capacity` rows), and bmm in a low-precision dtype copies such an operand whole before each
    product, which took most of a long run's decode step (BENCHMARKS.md, "Attention over the cache's views")."""
    B, KV, R = a.shape[:3]
    out = a.new_empty(B, KV, R, b.shape[2] if transpose else b.shape[3])
    for i in range(B):
        for h in range(KV):
            torch.mm(a[i, h], b[i, h].T if transpose else b[i, h], out=out[i, h])
    return out


def key_blocked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_size: int, scale: float,
    mask: torch.Tensor | None, block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """explicit_attention for a low-precision q, k, v whose key count S changes every step: the products over the
    first S // block · block keys run in the inputs' dtype (one product shape per block of steps), the rest in
    float32 on upcast copies, and the softmax over all of them in float32. Same arguments and results."""
    B, H, T, hd = q.shape
    KV, S = k.shape[1], k.shape[2]
    block = block or KEY_BLOCK
    m = S // block * block
    qg = q.reshape(B, KV, group_size * T, hd)  # (B, KV, G·T, hd)
    scores = torch.cat([head_products(qg, k[:, :, :m], transpose=True).float(),
                        qg.float() @ k[:, :, m:].float().transpose(-1, -2)], dim=-1) * scale  # (B, KV, G·T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask.repeat(*(1,) * (mask.dim() - 2), group_size, 1), float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # float32
    out = head_products(weights[..., :m].to(q.dtype), v[:, :, :m]).float() + weights[..., m:] @ v[:, :, m:].float()
    return out.to(q.dtype).reshape(B, H, T, hd), weights.to(q.dtype).reshape(B, H, T, S)


def leave_out_cudnn_attention() -> None:
    """On a GPU, take cuDNN's fused attention out of scaled_dot_product_attention's choices (flash, memory-efficient
    and the math kernel remain). cuDNN builds an execution graph for each new shape and caches it; a decode step
    attends over one more key than the step before, so every step of a first generation paid a graph build and the
    labs' paged steps paid one each (BENCHMARKS.md, "The CUDA path"). Process-wide: torch's per-call switch is a
    context manager, which every layer of every step would enter."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
    plain_causal: bool = False,
) -> torch.Tensor:
    """The same result as explicit_attention through torch's fused kernel (weights are never materialised).

    plain_causal: the mask is exactly the lower triangle of a square, which the kernel builds itself.
    """
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    if plain_causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _upcast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_size: int, scale: float,
            mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    y, weights = explicit_attention(q.float(), k.float(), v.float(), group_size, scale, mask)
    return y.to(q.dtype), weights


def decode_ways(dtype: torch.dtype) -> dict[str, attention_choice.Way]:
    """The ways a CPU decode query's attention can run in this dtype (engine.model.attention_choice), each
    (q, k, v, group_size, scale, mask) -> (output, weights or None). Looked up when called, so a benchmark that wraps
    this module's functions times them."""
    ways: dict[str, attention_choice.Way] = {
        "sdpa": lambda q, k, v, g, scale, mask: (sdpa_attention(q, k, v, scale, mask), None)}
    if attention_choice.full_precision(dtype):
        ways["explicit"] = lambda *a: explicit_attention(*a)
    else:
        ways["upcast"] = _upcast
        ways["blocked"] = lambda *a: key_blocked_attention(*a)
    return ways


_DECODE_WAYS: dict[torch.dtype, dict[str, attention_choice.Way]] = {}  # decode_ways, built once per dtype (forward)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.cfg = layer, cfg
        self.wqkv = Linear(cfg.d_model, cfg.q_dim + 2 * cfg.kv_dim, bias=cfg.qkv_bias)
        self.wo = Linear(cfg.q_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None  # Gemma 3, Qwen3
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.window = cfg.sliding_window if cfg.is_local(layer) else 0

    def forward(
        self, x: torch.Tensor, start: int | torch.Tensor, rope: torch.Tensor, cache: KVCache, reads: Reads | None
    ) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).split([cfg.q_dim, cfg.kv_dim, cfg.kv_dim], dim=-1)
        q = q.view(B, T, cfg.n_heads, cfg.head_dim)  # (B, T, H, hd)
        k = k.view(B, T, cfg.n_kv_heads, cfg.head_dim)  # (B, T, KV, hd)
        if self.q_norm is not None:  # RMSNorm over each head's vector, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), rope)  # (B, H, T, hd)
        k = apply_rope(k.transpose(1, 2), rope)  # (B, KV, T, hd)
        v = v.view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        k_all, v_all = cache.update(self.layer, start, k, v)  # (B, KV, S, hd)
        key_start, S = cache.first_position(self.layer), k_all.shape[2]
        mask = attention_mask(start, T, key_start, S, self.window, x.device)  # (T, S) or None
        capture = reads is not None and self.layer in reads.patterns
        n = reads.attention_rows(cfg.n_heads, T, S) if capture else 0
        plain = (not isinstance(start, torch.Tensor) and start == key_start and T == S
                 and (not self.window or T <= self.window))  # a square causal mask
        if T == 1 and x.device.type == "cpu":  # one query row: the way measured fastest here for this many keys
            way = attention_choice.choice(q.dtype, (cfg.n_kv_heads, cfg.group_size, cfg.head_dim), S, capture)
            ways = _DECODE_WAYS.get(q.dtype) or _DECODE_WAYS.setdefault(q.dtype, decode_ways(q.dtype))
            y, weights = ways[way](q, k_all, v_all, cfg.group_size, cfg.softmax_scale, mask)
            if capture:
                reads.record_pattern(self.layer, weights)  # (B, H, 1, S)
        elif capture and n == T:  # the weights, when a panel wants them, come for free
            y, weights = explicit_attention(q, k_all, v_all, cfg.group_size, cfg.softmax_scale, mask)
            reads.record_pattern(self.layer, weights)  # (B, H, T, S)
        elif capture:  # a long prefill: every row through the fused kernel, the weights of the last n rows only
            y = sdpa_attention(q, k_all, v_all, cfg.softmax_scale, mask, plain)
            rows = None if mask is None else mask[T - n:]
            weights = explicit_attention(q[:, :, T - n:], k_all, v_all, cfg.group_size, cfg.softmax_scale, rows)[1]
            reads.record_pattern(self.layer, weights)  # (B, H, n, S)
        else:
            y = sdpa_attention(q, k_all, v_all, cfg.softmax_scale, mask, plain)
        return self.wo(y.transpose(1, 2).reshape(B, T, cfg.q_dim))  # (B, T, d)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)
        # Gemma 3 also normalises what attention and the MLP add to the residual stream (four norms per block).
        self.post_attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.post_norms else None
        self.post_mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.post_norms else None
        self.local = cfg.is_local(layer)

    def forward(
        self, x: torch.Tensor, start: int | torch.Tensor, ropes: tuple[torch.Tensor, torch.Tensor], cache: KVCache,
        reads: Reads | None,
    ) -> torch.Tensor:
        a = self.attn(self.attn_norm(x), start, ropes[self.local], cache, reads)
        h = x + (a if self.post_attn_norm is None else self.post_attn_norm(a))
        m = self.mlp(self.mlp_norm(h))
        return h + (m if self.post_mlp_norm is None else self.post_mlp_norm(m))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = None if cfg.tied_embeddings else Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.rope: torch.Tensor | None = None  # built by init_rope() once the weights are on their device
        self.rope_local: torch.Tensor | None = None  # local layers' table (their own base, no scaling)
        self.head_packed: torch.Tensor | None = None  # pack_for_decode(lm_head)
        self.tied_head_quant: quant.QuantForms | None = None  # a tied head's forms (an untied one's: output.quant)
        # how its decode products compute (kernel_cache.KERNEL_MODES): exact unless attach_quant built a form
        self.kernel_mode = quant.EXACT

    def init_rope(self, rows: int = ROPE_ROWS) -> None:
        """Build the RoPE tables for the first `rows` positions; forward grows them when a step needs more.

        Built for the whole context at once, a 1M-token model's table would take gigabytes at load, used or not.
        """
        cfg, device = self.cfg, self.tok_embeddings.weight.device
        rows = min(rows, cfg.context_length)
        self.rope = rope_table(cfg.head_dim, rows, cfg.rope_base, device, cfg.rope_freq_factors)
        self.rope_local = self.rope
        if cfg.n_local_layers and (cfg.rope_base_local != cfg.rope_base or cfg.rope_freq_factors):
            self.rope_local = rope_table(cfg.head_dim, rows, cfg.rope_base_local, device)

    def pack_for_decode(self) -> bool:
        """Keep a oneDNN-layout copy of every bfloat16 projection for decode (see pack_for_decode); True if done.

        The plain weights stay: prefill, captures and batching read them. Costs the weights' bytes once more.
        """
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for m in linears:
            m.packed = pack_for_decode(m.weight)
        self.head_packed = pack_for_decode(self.lm_head)
        return self.head_packed is not None

    def attach_quant(self, blocks: dict[str, tuple[torch.Tensor, str]], mode: str) -> int:
        """Give each projection a GGUF stored quantized the forms kernel mode `mode` allows (quant.q4_forms); blocks:
        weight name -> (blocks (out, in/32, bytes), kind), from quant.take_blocks. A tied model's token table is its LM
        head: its forms serve the head (head_quant), while the embedding lookup keeps gathering rows of the float
        weight. Returns the forms' bytes (quant's module docstring: their memory, until tune_kernels drops a form the
        tuner did not choose). The model's kernel_mode becomes `mode` where at least one form was built (else its
        products stay exact, and it says so)."""
        total, built = 0, False
        for name, (b, kind) in blocks.items():
            tied = name == "tok_embeddings.weight" and self.output is None
            m = self.tok_embeddings if tied else self.get_submodule(name.removesuffix(".weight"))
            out_f, in_f = m.weight.shape
            if (not (tied or isinstance(m, Linear))
                    or tuple(b.shape) != (out_f, in_f // quant.GROUP, quant.BLOCK_BYTES[kind])):
                raise ValueError(f"the {kind} blocks of {name!r} have shape {tuple(b.shape)}, "
                                 f"its weight {(out_f, in_f)}")
            forms = quant.q4_forms(b, kind, m.weight, mode)
            if tied:
                self.tied_head_quant = forms
            else:
                m.quant = forms
            total += forms.nbytes() if forms is not None else 0
            built |= forms is not None
        self.kernel_mode = mode if built else quant.EXACT
        return total

    @property
    def head_quant(self) -> quant.QuantForms | None:
        """The LM head's quantized forms: the untied output projection's, or the tied token table's."""
        return self.tied_head_quant if self.output is None else self.output.quant

    def decode_products(self) -> dict[tuple[int, int, str], list[kernels.Product]]:
        """Every (weight, bias, packed, quantized forms) a decode step multiplies a row by, grouped by weight shape
        and the kind of weight (float, or with which mode's quantized forms): (out, in, kernel_cache.WEIGHTS)."""
        groups: dict[tuple[int, int, str], list[kernels.Product]] = {}
        for m in self.modules():
            if isinstance(m, Linear) and m is not self.output:
                groups.setdefault((*m.weight.shape, kernels.weights_of(m.quant)), []).append(
                    (m.weight, m.bias, m.packed, m.quant))
        head_q = self.head_quant
        groups.setdefault((*self.lm_head.shape, kernels.weights_of(head_q)), []).append(
            (self.lm_head, None, self.head_packed, head_q))
        return groups

    def decode_weight_bytes_read(self, threads: int | None = None) -> int:
        """Bytes of weights one decode step reads with the kernels in use at `threads` (default: now): a quantized
        form's bytes (engine.model.quant: int4 0.625, int8 1 byte per value + 2 per row) where its candidate runs,
        the float weight's otherwise (bias and norms not counted)."""
        n = threads or torch.get_num_threads()
        total = 0
        for (out_f, in_f, weights), products in self.decode_products().items():
            for w, _, _, forms in products:
                name = kernels.chosen((out_f, in_f), w.dtype, n, weights) or "linear"
                form = getattr(forms, name) if forms is not None and name in kernels.QUANTIZED else None
                total += sum(t.numel() * t.element_size() for t in form) if form else w.numel() * w.element_size()
        return total

    def decode_bytes_saved(self, threads: int | None = None) -> int:
        """Bytes of weights a decode step does not stream because a quantized form runs in place of the float weight
        (0 where none does): the float products' bytes minus decode_weight_bytes_read. engine.costs prices a step
        with every weight in the model's dtype; this is what to take off that figure."""
        float_bytes = sum(w.numel() * w.element_size() for ps in self.decode_products().values() for w, *_ in ps)
        return float_bytes - self.decode_weight_bytes_read(threads)

    def tune_kernels(self, remeasure: bool = False, drop_unused: bool = True) -> list:
        """Choose each decode product's kernel by measuring this machine (engine.model.kernels), or by reading what
        was measured before; the entries, one per shape and thread count ([] off the CPU).

        drop_unused: free each quantized form no thread count chose (nor --kernel / $INFERENCE_LAB_KERNEL forces),
        unless kernels.keeping_forms() is in effect (`python -m engine kernels`, which may measure them again).
        """
        if self.lm_head.device.type != "cpu":
            return []
        groups = self.decode_products()
        entries = kernels.tune(groups, remeasure=remeasure)
        self.tune_attention(remeasure)
        if drop_unused and not kernels.KEEP_FORMS:
            used = {(e.shape, e.choice) for e in entries if e.weights != kernel_cache.FLOAT}
            for w, _, _, forms in (p for ps in groups.values() for p in ps):
                for name in kernels.QUANTIZED if forms is not None else ():
                    if kernels.forced_name() != name and (tuple(w.shape), name) not in used:
                        forms.dropped |= getattr(forms, name) is not None
                        setattr(forms, name, None)
        return entries

    def tune_attention(self, remeasure: bool = False) -> list:
        """Choose how a decode query's attention runs at each context length by measuring this machine
        (engine.model.attention_choice), or by reading what was measured before; the entries ([] off the CPU)."""
        cfg, w = self.cfg, self.lm_head
        if w.device.type != "cpu":
            return []
        return attention_choice.tune(decode_ways(w.dtype), (cfg.n_kv_heads, cfg.group_size, cfg.head_dim), w.dtype,
                                     cfg.context_length, cfg.n_layers, decode_thread_counts(), remeasure=remeasure)

    @property
    def lm_head(self) -> torch.Tensor:
        """(V, d): the output projection, which is the embedding matrix itself when tied."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(
        self, tokens: torch.Tensor, cache: KVCache, reads: Reads | None = None, all_logits: bool = False,
        layers: int | None = None, head: bool = True,
    ) -> torch.Tensor | None:
        """Run T new tokens (B, T) at the cache's next positions through the first `layers` layers (every one when
        None), append their K/V to the cache, and copy out what `reads` names (engine.model.seam.Reads); without
        `head`, stop there (a capture of early layers needs nothing after them) and return None.

        The cache is the one count of positions: its `start` is where the tokens go, an int, or a tensor (B,) on the
        model's device for the rows of a continuous batch, each at its own length (engine.labs.scheduler.PagedKVCache,
        which writes and returns each row's own keys; no reads are taken then).
        Returns float32 logits of the last position (B, V), or of every position (B, T, V) if all_logits.
        """
        B, T = tokens.shape
        start = cache.start
        ragged = isinstance(start, torch.Tensor)
        end = (int(start.max()) if ragged else start) + T
        if end > self.cfg.context_length:
            raise ValueError(f"position {end - 1} is beyond the context length {self.cfg.context_length}")
        if ragged and reads is not None:
            raise ValueError("captures need one position for the whole batch, not a start per row")
        if self.rope is None or self.rope.shape[0] < end:  # grow geometrically: amortised O(1) per token
            self.init_rope(max(end, 2 * (0 if self.rope is None else self.rope.shape[0]), ROPE_ROWS))
        if ragged:
            pos = start[:, None] + torch.arange(T, device=start.device)  # (B, T)
            ropes = (self.rope[pos][:, None], self.rope_local[pos][:, None])  # (B, 1, T, hd/2) global, local
        else:
            ropes = (self.rope[start : start + T], self.rope_local[start : start + T])  # (T, hd/2) global, local
        x = self.tok_embeddings(tokens)  # (B, T, d): a row lookup, no matmul
        if self.cfg.embedding_scale != 1.0:
            x = x * self.cfg.embedding_scale  # Gemma: × √d_model
        # the last position after the embedding and after each layer; a view keeps its whole tensor alive, so a
        # prefill (T rows) keeps a copy of the one row instead (a view would hold every layer's (T, d) output)
        rows = [x[:, -1] if T == 1 else x[:, -1].clone()] if reads and (reads.want_norms or reads.want_stream) else None
        for layer in self.layers[:layers]:
            x = layer(x, start, ropes, cache, reads)
            if rows is not None:
                rows.append(x[:, -1] if T == 1 else x[:, -1].clone())
        cache.advance(T)
        if rows is not None:
            reads.record_resid(rows)
        if not head:
            return None
        return self.head(x if all_logits else x[:, -1])  # (B, [T,] V)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Residual stream (…, d) → float32 logits (…, V): the final norm, then the LM head.

        In bfloat16 a logit near 25 is rounded to steps of 0.125, coarser than the gap between the two best
        candidates of many prompts, so ties and flips against float32 come from the output's rounding alone. The
        HEAD_RESCORE best candidates are therefore recomputed in float32 from the same hidden state (a small
        HEAD_RESCORE × d product beside the V × d head); so are they where the head
        ran a quantized form (engine.model.quant: bf16 activations, requantized or 4-bit weights), so that the
        argmax among them is the float weight's, whatever the head's kernel.
        """
        h = self.norm(x)
        q, rows = self.head_quant, h.numel() // h.shape[-1]
        y = linear(h, self.lm_head, packed=self.head_packed, q=q)
        quantized = h.device.type == "cpu" and rows <= SPLIT_MAX_ROWS and kernels.runs_form(self.lm_head, q)
        if (y.dtype == torch.float32 and not quantized) or rows > HEAD_RESCORE_MAX_ROWS:
            return y.float()
        top = torch.topk(y, min(HEAD_RESCORE, y.shape[-1]), dim=-1).indices  # (…, k)
        exact = torch.einsum("...d,...kd->...k", h.float(), self.lm_head[top].float())  # (…, k)
        return y.float().scatter_(-1, top, exact)  # in place: y.float() is already a new tensor


def fuse_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Join wq/wk/wv into wqkv and w_gate/w_up into w_gate_up (the model's own names); other tensors pass."""
    out = dict(sd)
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            names = [f"{p}attn.wq.{kind}", f"{p}attn.wk.{kind}", f"{p}attn.wv.{kind}"]
            if all(n in out for n in names):
                out[f"{p}attn.wqkv.{kind}"] = torch.cat([out.pop(n) for n in names], dim=0)
        gate, up = f"{p}mlp.w_gate.weight", f"{p}mlp.w_up.weight"
        if gate in out and up in out:
            out[f"{p}mlp.w_gate_up.weight"] = torch.cat([out.pop(gate), out.pop(up)], dim=0)
    return out


def build_model(
    cfg: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu", kernel_mode: str = quant.EXACT,
) -> Transformer:
    """Build on the meta device (no memory), then take the given tensors as the parameters (assign=True).

    kernel_mode: engine.model.kernel_cache.KERNEL_MODES: "exact" computes the given weights in
    `dtype`; "file" and "fast" give a GGUF's quantized weights the forms they allow (attach_quant).
    Every expected tensor must be present with the expected shape; the error names the first one that is not.
    """
    if kernel_mode not in quant.MODES:
        raise ValueError(f"unknown kernel mode {kernel_mode!r} (choose {', '.join(quant.MODES)})")
    with torch.device("meta"):
        model = Transformer(cfg)
    sd = fuse_state_dict(state_dict, cfg)
    blocks = quant.take_blocks(sd)  # a GGUF's Q4 blocks, for the quantized decode candidates
    expected = model.state_dict()
    missing = [n for n in expected if n not in sd]
    if missing:
        raise ValueError(f"the weights lack {len(missing)} tensors, first {missing[0]!r}")
    unexpected = [n for n in sd if n not in expected]
    if unexpected:
        raise ValueError(f"the weights have tensors this model does not use, first {unexpected[0]!r}")
    for name, ref in expected.items():
        if tuple(sd[name].shape) != tuple(ref.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(sd[name].shape)}, expected {tuple(ref.shape)}")
        sd[name] = sd[name].to(device=device, dtype=dtype)
    model.load_state_dict(sd, assign=True, strict=True)
    model.eval().requires_grad_(False)
    model.init_rope()
    if dtype == torch.bfloat16:
        model.pack_for_decode()
    if blocks and kernel_mode != quant.EXACT and torch.device(device).type == "cpu":
        model.attach_quant(blocks, kernel_mode)
    model.tune_kernels()
    return model

"""What quantization changed: the same tokens through two forms of one model, compared layer by layer.

The two sides are two files of one model (the default model's Q4_1 file and a Q8_0 or F16 file of it), one file on
two runtimes (this engine's torch model in float32 and llama.cpp running the file as it is), or one file under two
kernel modes (exact against fast: what the quantized kernels cost). Both are
teacher-forced on one sequence: the prompt, then `steps` tokens of side a's greedy continuation, fed to both, so
every step compares the two on the same context. A step is one forward pass (the prefill, then one decode step per
token) and is compared at its newest position:

    kl            per residual-stream point (0 = the embeddings, ℓ = after layer ℓ): KL(p_a ‖ p_b) of the logit
                  lens distributions p = softmax(head(norm(x_ℓ))), Σ p_a · (ln p_a − ln p_b), in nats, mean over
                  steps; `kl_output` is the same of the models' own output logits
    attention_js  per layer: the Jensen–Shannon distance of each attention row (a query's weights over its keys),
                  √(½ KL(p ‖ m) + ½ KL(q ‖ m)) with m = (p + q) / 2 in bits (0 = the same row, 1 = disjoint), mean over
                  heads and every captured row of every step (the prefill's rows are the prompt's)
    top1_flips    the steps whose greedy token under b differs from a's (a's is the token fed next)

Beside them each side's weight bytes a decode step reads (engine.costs: the run dtype for torch, the file's own
blocks for llama.cpp) and its measured TPOT, from an uncaptured greedy run of the same tokens.

Over a corpus (`compare_corpus`, `compare --corpus FILE`), as llama.cpp's `llama-perplexity --kl-divergence` judges
a quant: the text's tokens are cut into windows of W tokens (the first replaced by BOS where the model starts with
one), each window run from an empty cache through both sides, teacher-forced. The first ⌊W/2⌋ positions are context
only (one prefill); every later position j < W − 1 is scored by the distribution it gives for token j + 1, fed in
steps of a decode product's rows, so that a kernel mode's decode products are the ones scored. Per scored position,
in float64 from each side's float32 logits, with a = the loaded side (the base) and b = the other:

    nll           −ln p(actual next token), per side; perplexity = exp(mean nll), in tokens
    kl            KL(p_a ‖ p_b) = Σ p_a · (ln p_a − ln p_b) over the vocabulary, in nats
    Δp            p_b(actual next token) − p_a(actual next token), in probability
    same top      whether argmax of a's logits equals b's

reported as perplexities, KL's mean (with its standard error), median, percentiles and max, Δp's mean, RMS and
percentiles, and the share of positions with the same top token. Percentiles interpolate linearly between sorted
values, as llama.cpp's do. Only these per-position scalars are kept: never a window's vocabulary-wide logits beyond
one step of each side. With `lens`, each step also captures the residual stream of its newest position, and the
result carries per residual point the mean KL(a ‖ b) of the two logit-lens distributions there (the layer-by-layer
view `compare` gives one sequence, over the corpus at every step's last position).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from engine.protocol import CORPUS_MAX_TOKENS, CORPUS_WINDOW
from engine.why import Cancelled, Progress, ShouldStop, Unsupported, check_stop

SHAPE_FIELDS = ("vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim")
# Attention rows kept per layer and step on each side: a long prompt's prefill keeps its last rows that fit (every
# layer of both sides is held at once, so this is a quarter of what a generation's capture keeps).
ATTENTION_BYTES = 4 * 2**20
LENS_BYTES = 64 * 2**20  # float64 lens log-probabilities of one side held at once (several steps' worth)
LN2 = math.log(2.0)


# ---- the two divergences ----------------------------------------------------------------------------------------
def kl_nats(logp, logq):
    """KL(p ‖ q) = Σ p · (ln p − ln q) over the last axis, in nats, from log-probabilities (torch tensors)."""
    import torch

    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)


def js_distance_bits(p, q):
    """√JSD(p, q) over the last axis, base 2 (in [0, 1]), from probabilities (torch tensors); 0 · ln 0 = 0."""
    import torch

    m = (p + q) / 2

    def half(x):
        return torch.where(x > 0, x * (torch.log(x) - torch.log(m)), torch.zeros_like(x)).sum(-1)

    return ((half(p) + half(q)) / (2 * LN2)).clamp_min(0).sqrt()


# ---- one side: a session of either runtime, stepped by hand ------------------------------------------------------
class _Side:
    """One form of the model: a step runs `feed` at the next positions of the session's own runtime (the generation
    loop's step, with a Capture) and returns its logits, the residual stream of the newest position (L + 1, d) and
    every layer's attention rows {layer: (H, rows, keys)}; `head` projects the lens."""

    def __init__(self, session) -> None:
        self.s = session
        self.cfg = session.cfg
        info = session.info
        self.info = info
        dtype = "" if session.dtype_name == info.file_type else f" {session.dtype_name}"
        self.label = (f"{Path(info.path).name} ({info.file_type}) on {session.runtime_name}{dtype}, "
                      f"{info.kernels} kernels")
        self.attention = "attention" not in session.cannot
        self.rt = None

    @property
    def head(self):
        return self.rt.lens_head()

    def reset(self, n_positions: int) -> None:
        self.s.forget_cache()
        self.rt = self.s.runtime(n_positions)

    def step(self, feed: list[int], start: int):
        import torch

        from engine.protocol import Capture
        from engine.run.session import check_finite
        from engine.runtime.base import Row

        L = self.cfg.n_layers
        if start != self.rt.length(0):  # one count of positions: the runtime's
            raise ValueError(f"a step at position {start}, but the cache holds {self.rt.length(0)} positions")
        capture = Capture(attention_layers=frozenset(range(L)) if self.attention else frozenset(),
                          attention_max_bytes=ATTENTION_BYTES, lens_top=1)  # lens_top: the residual stream
        logits = self.rt.forward([Row(0, list(feed), capture=capture)])[0].float()
        check_finite(logits, start + len(feed) - 1, self.rt.kv_dtype)
        c = self.rt.captured(0)
        attn = {layer: w for layer, (w, _) in c.attention.items()}  # (H, rows, keys)
        return logits, torch.as_tensor(c.stream), attn


def _sides(a, b) -> tuple[_Side, _Side]:
    """The two sides of a comparison: two sessions (each keeps its own KV cache) of one model."""
    if a is b:
        raise ValueError("compare needs two sessions (each keeps its own KV cache), got the same one twice")
    A, B = _Side(a), _Side(b)
    check_same_model(A.cfg, B.cfg)
    return A, B


def _lens_logp(head, streams, logits):
    """(n, L + 2, V) float64 log-probabilities of n steps: the lens of every residual point (streams (n, L + 1, d)),
    then the model's own output (logits (n, V)). The steps go through the head together: llama.cpp's lens widens its
    float16 output matrix once per call, not once per step."""
    import torch

    w = next(head.parameters())
    n, points, d = streams.shape
    with torch.inference_mode():
        rows = head.head(streams.reshape(n * points, d).to(device=w.device, dtype=w.dtype)).float()
        rows = torch.cat([rows.reshape(n, points, -1), logits.reshape(n, 1, -1).to(rows)], dim=1)
        return torch.log_softmax(rows.double(), dim=-1).cpu()


def _lens_kl(A: _Side, B: _Side, pending: list) -> list[list[float]]:
    """KL(a ‖ b) per step and residual point (then the output) of the steps in `pending` [(stream_a, logits_a,
    stream_b, logits_b)]."""
    import torch

    la = _lens_logp(A.head, torch.stack([p[0] for p in pending]), torch.stack([p[1] for p in pending]))
    lb = _lens_logp(B.head, torch.stack([p[2] for p in pending]), torch.stack([p[3] for p in pending]))
    return kl_nats(la, lb).tolist()  # (n, L + 2)


def check_same_model(a, b) -> None:
    """Unsupported (one line) when the two sides are not one model: every shape that differs, named."""
    diff = [f"{f} {getattr(a, f)} vs {getattr(b, f)}" for f in SHAPE_FIELDS if getattr(a, f) != getattr(b, f)]
    if diff:
        raise Unsupported(f"these are not two forms of one model: {', '.join(diff)}")


def _tpot(session, prompt_ids: list[int], tokens: list[int]) -> float | None:
    """Mean decode step of an uncaptured run that is fed `tokens` (None when there is no decode step)."""
    from engine.events import Failed, Finished
    from engine.run.sampling import SamplingParams

    if len(tokens) < 2:
        return None
    session.forget_cache()
    forced = dict(enumerate(tokens))
    for ev in session.generate(prompt_ids, SamplingParams(temperature=0.0), len(tokens), ignore_eos=True,
                               forced=forced):
        if isinstance(ev, Failed):
            raise RuntimeError(ev.message)
        if isinstance(ev, Finished):
            return float(ev.tpot_s)
    return None


def compare(a, b, prompt: str, steps: int = 16, chat: bool = False, progress: Progress | None = None,
            should_stop: ShouldStop | None = None) -> dict:
    """Teacher-force sessions `a` and `b` (engine.run.session.Session or engine.backends.llamacpp.LlamaCppSession of
    the same model) on `prompt` plus `steps` tokens of a's greedy continuation; returns the JSON-ready result (see
    the module's docstring). Unsupported when the two are not one model; ValueError on a bad prompt or step count;
    Cancelled when should_stop says so between forward passes."""
    import numpy as np
    import torch

    t_start = time.perf_counter()
    A, B = _sides(a, b)
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    ids = [int(i) for i in a.tokenize(prompt, chat).ids]
    other = [int(i) for i in b.tokenize(prompt, chat).ids]
    if ids != other:
        raise Unsupported(f"the two tokenizers split the prompt differently ({len(ids)} against {len(other)} tokens)")
    a.check_prompt(ids, steps)
    b.check_prompt(ids, steps)
    room = min(A.cfg.context_length, B.cfg.context_length) - len(ids)
    if steps > room:
        raise ValueError(f"{len(ids)} prompt tokens leave room for {room} steps in this context, not {steps}")
    L, V = A.cfg.n_layers, A.cfg.vocab_size
    for side in (A, B):
        side.reset(len(ids) + steps)
    kl_by_step: list[list[float]] = []
    pending: list = []
    chunk = max(1, LENS_BYTES // ((L + 2) * V * 8))  # steps whose float64 lens one side holds at once
    js_sum, js_rows = np.zeros(L), np.zeros(L)
    tokens: list[int] = []
    flips: list[dict] = []
    feed, start = list(ids), 0
    for step in range(steps):
        check_stop(should_stop)
        la, sa, wa = A.step(feed, start)
        lb, sb, wb = B.step(feed, start)
        pending.append((sa, la.cpu(), sb, lb.cpu()))
        if len(pending) == chunk:
            kl_by_step += _lens_kl(A, B, pending)
            pending = []
        if A.attention and B.attention:
            for layer in range(L):
                rows = min(wa[layer].shape[1], wb[layer].shape[1])  # both keep the same last rows (Probe's bound)
                js = js_distance_bits(torch.from_numpy(wa[layer][:, -rows:]).double(),
                                      torch.from_numpy(wb[layer][:, -rows:]).double())  # (H, rows)
                js_sum[layer] += float(js.sum())
                js_rows[layer] += js.numel()
        ta, tb = int(torch.argmax(la)), int(torch.argmax(lb))
        if ta != tb:
            flips.append({"step": step, "a": ta, "b": tb, "a_piece": a.tokenizer.piece(ta),
                          "b_piece": b.tokenizer.piece(tb)})
        tokens.append(ta)
        start += len(feed)
        feed = [ta]
        if progress is not None:
            progress((step + 1) / (steps + 2), f"step {step + 1} of {steps} compared")
    if pending:
        kl_by_step += _lens_kl(A, B, pending)
    check_stop(should_stop)
    tpot_a = _tpot(a, ids, tokens)
    if progress is not None:
        progress((steps + 1) / (steps + 2), "TPOT of side a measured")
    check_stop(should_stop)
    tpot_b = _tpot(b, ids, tokens)
    if progress is not None:
        progress(1.0, "TPOT of side b measured")
    per_step = np.asarray(kl_by_step)  # (steps, L + 2)
    mean = per_step.mean(axis=0)
    return {
        "labels": [A.label, B.label],
        "prompt_ids": ids,
        "tokens": tokens,
        "pieces": [a.tokenizer.piece(t) for t in tokens],
        "steps": steps,
        "kl_unit": "nats: KL(a ‖ b), mean over the steps",
        "layers": ["embedding", *(f"layer {i}" for i in range(1, L + 1))],
        "kl": [float(x) for x in mean[:L + 1]],
        "kl_output": float(mean[L + 1]),
        "kl_by_step": kl_by_step,
        "attention_js": [float(s / n) for s, n in zip(js_sum, js_rows, strict=True)] if js_rows.all() else None,
        "top1_flips": flips,
        "bytes_per_token": [float(A.info.decode_weight_bytes), float(B.info.decode_weight_bytes)],
        "kernels": [A.info.kernels, B.info.kernels],
        "dtype": [A.info.dtype, B.info.dtype],
        "tpot_s": [tpot_a, tpot_b],
        "vocab_size": V,
        "seconds": time.perf_counter() - t_start,
    }


# ---- over a corpus -------------------------------------------------------------------------------------------------
BYTES_PER_TOKEN_READ = 32  # corpus bytes read per token compared: English runs near 4 bytes a token, so this is ample
KL_PERCENTILES = (90.0, 95.0, 99.0, 99.9)
DELTA_P_PERCENTILES = (0.1, 1.0, 5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.9)
QUANTILE_POINTS = 101  # the quantile curves a result carries for a plot: 0 %, 1 %, …, 100 %


def percentile_key(q: float) -> str:
    """A percentile's key in a result: p99, p99_9, p0_1."""
    return "p" + f"{q:g}".replace(".", "_")


def read_corpus(path: str | Path, max_tokens: int = CORPUS_MAX_TOKENS) -> str:
    """The text of a corpus file, read up to the bytes `max_tokens` tokens can take (BYTES_PER_TOKEN_READ each); one
    sentence (ValueError) for a missing file, a folder, a binary or non-UTF-8 file, or one that holds no text."""
    import codecs

    p = Path(path)
    limit = max(1, max_tokens) * BYTES_PER_TOKEN_READ
    try:
        with open(p, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise ValueError(f"no corpus file at {p}") from None
    except IsADirectoryError:
        raise ValueError(f"{p} is a folder: choose a text file as the corpus") from None
    except OSError as e:
        raise ValueError(f"cannot read the corpus {p}: {e.strerror or e}") from None
    cut = len(data) > limit
    data = data[:limit]
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{p.name} is not text: it holds a NUL byte at offset {nul} (a binary file?)")
    try:  # a read cut short may end inside a character: the incremental decoder keeps those bytes back
        text = codecs.getincrementaldecoder("utf-8")().decode(data, final=not cut)
    except UnicodeDecodeError as e:
        raise ValueError(f"{p.name} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start}") from None
    if not text.strip():
        raise ValueError(f"{p.name} holds no text to compare on" + (" (it is empty)" if not data else ""))
    return text


def _quantiles(values, qs):
    import numpy as np

    return [float(x) for x in np.percentile(values, qs)]  # numpy's "linear": llama.cpp's interpolation


def corpus_statistics(nll_a, nll_b, kl, p_a, p_b, same_top) -> dict:
    """The reported statistics of per-position arrays (float64 numpy, one entry per scored position)."""
    import numpy as np

    n = len(kl)
    dp = p_b - p_a
    kl_q = _quantiles(kl, KL_PERCENTILES)
    dp_q = _quantiles(dp, DELTA_P_PERCENTILES)
    mean_nll = [float(nll_a.mean()), float(nll_b.mean())]
    same = float(same_top.mean())
    return {
        "positions": n,
        "nll_mean": mean_nll,
        "ppl": [math.exp(x) for x in mean_nll],
        "ln_ppl_ratio": float((nll_b - nll_a).mean()),  # ln(PPL_b / PPL_a)
        "kl_stats": {"mean": float(kl.mean()),
                     "mean_se": float(kl.std(ddof=1) / math.sqrt(n)) if n > 1 else None,
                     "median": float(np.median(kl)),
                     **{percentile_key(q): v for q, v in zip(KL_PERCENTILES, kl_q, strict=True)},
                     "max": float(kl.max()), "min": float(kl.min())},
        "delta_p": {"mean": float(dp.mean()), "rms": float(np.sqrt(np.mean(dp * dp))),
                    **{percentile_key(q): v for q, v in zip(DELTA_P_PERCENTILES, dp_q, strict=True)},
                    "max": float(dp.max()), "min": float(dp.min())},
        "same_top": same,
        "kl_quantiles": _quantiles(kl, np.linspace(0, 100, QUANTILE_POINTS)),
        "delta_p_quantiles": _quantiles(dp, np.linspace(0, 100, QUANTILE_POINTS)),
    }


def _scored(logits_a, logits_b, targets):
    """Per position of one step: (nll_a, nll_b, kl, p_a, p_b, same top) as float64 numpy arrays."""
    import torch

    la, lb = torch.log_softmax(logits_a.double(), -1), torch.log_softmax(logits_b.double(), -1)
    t = torch.as_tensor(targets, dtype=torch.long).reshape(-1, 1)
    lpa, lpb = la.gather(1, t)[:, 0], lb.gather(1, t)[:, 0]
    same = torch.argmax(logits_a, -1) == torch.argmax(logits_b, -1)
    return [x.numpy() for x in (-lpa, -lpb, kl_nats(la, lb), lpa.exp(), lpb.exp(), same.double())]


def corpus_windows(ids: list[int], window: int, max_tokens: int, bos: int | None) -> list[list[int]]:
    """The windows of `ids` compared: whole windows of `window` tokens within the first `max_tokens`, each starting
    with `bos` where the model starts with one (it replaces the window's first token, as llama-perplexity does)."""
    n = min(len(ids), max_tokens) // window
    out = [list(ids[k * window:(k + 1) * window]) for k in range(n)]
    if bos is not None:
        for w in out:
            w[0] = bos
    return out


def compare_corpus(a, b, text: str, window: int = CORPUS_WINDOW, max_tokens: int = CORPUS_MAX_TOKENS,
                   name: str = "", progress: Progress | None = None, should_stop: ShouldStop | None = None,
                   lens: bool = False) -> dict:
    """Sessions `a` (the base) and `b` of one model over `text` in windows (the module's docstring); the JSON-ready
    result. With `lens`, also per residual point the KL of the two sides' logit-lens distributions (as `compare`
    reports for one sequence), mean over the last position of every step (a capture keeps the newest position's
    stream only). Unsupported when the two are not one model or tokenize the text differently; ValueError when the
    text gives no whole window or a window does not fit a side's cache; Cancelled when should_stop says so between
    steps."""
    import numpy as np
    import torch

    from engine.model.transformer import SPLIT_MAX_ROWS
    from engine.protocol import Capture
    from engine.run.session import check_finite
    from engine.runtime.base import Row

    t_start = time.perf_counter()
    A, B = _sides(a, b)
    if window < 4:
        raise ValueError(f"a window takes at least 4 tokens (half of them context), got {window}")
    if max_tokens < window:
        raise ValueError(f"at most {max_tokens} tokens leave no whole window of {window}")
    text = text[:max_tokens * BYTES_PER_TOKEN_READ]  # a long text is tokenized only as far as the cap can reach
    ids = [int(i) for i in a.tokenizer.encode(text, parse_special=False, add_special=False).ids]
    other = [int(i) for i in b.tokenizer.encode(text, parse_special=False, add_special=False).ids]
    if ids != other:
        raise Unsupported(f"the two tokenizers split the corpus differently ({len(ids)} against {len(other)} tokens)")
    tok = a.tokenizer
    windows = corpus_windows(ids, window, max_tokens, tok.bos_id if tok.add_bos else None)
    if not windows:
        raise ValueError(f"the corpus is {len(ids)} tokens, less than one window of {window}: give a longer text "
                         "or a smaller window")
    V = A.cfg.vocab_size
    outside = next((i for i in ids[:len(windows) * window] if not 0 <= i < V), None)
    if outside is not None:
        raise ValueError(f"the corpus holds token id {outside}, outside this model's vocabulary (0…{V - 1})")
    first = window // 2  # context only; positions first … window − 2 are scored
    per_window = window - 1 - first
    n = len(windows) * per_window
    cols = [np.empty(n) for _ in range(6)]  # nll_a, nll_b, kl, p_a, p_b, same top: one entry per scored position
    done = 0
    L = A.cfg.n_layers
    capture = Capture(lens_top=1) if lens else None  # lens_top: the residual stream of the step's newest position
    lens_sum, lens_n, pending = np.zeros(L + 2), 0, []
    chunk = max(1, LENS_BYTES // ((L + 2) * V * 8))  # steps whose float64 lens one side holds at once

    def lens_flush() -> None:
        nonlocal lens_n, pending
        if pending:
            by_step = np.asarray(_lens_kl(A, B, pending))  # (n, L + 2)
            lens_sum[:] += by_step.sum(axis=0)
            lens_n += len(by_step)
            pending = []

    for k, w in enumerate(windows):
        rts = []
        for side in (A, B):
            side.s.forget_cache()
            rt = side.s.runtime(window)
            if rt.capacity < window:
                raise ValueError(f"a window of {window} tokens does not fit {side.label}'s cache of {rt.capacity}")
            rts.append(rt)
            side.rt = rt  # the lens head is the runtime's
        check_stop(should_stop)
        for rt in rts:  # the context: one prefill, its logits unused
            rt.forward([Row(0, w[:first])])
        for j in range(first, window - 1, SPLIT_MAX_ROWS):
            check_stop(should_stop)
            feed = w[j:min(j + SPLIT_MAX_ROWS, window - 1)]
            logits, streams = [], []
            for side, rt in zip((A, B), rts, strict=True):
                row = Row(0, feed, all_logits=True, capture=capture)
                out = rt.forward([row])[0].float().cpu().reshape(len(feed), V)
                check_finite(out, j + len(feed) - 1, side.s.dtype_name)
                logits.append(out)
                if lens:
                    streams.append(torch.as_tensor(rt.captured(0).stream))
            if lens:
                pending.append((streams[0], logits[0][-1], streams[1], logits[1][-1]))
                if len(pending) == chunk:
                    lens_flush()
            for col, vals in zip(cols, _scored(logits[0], logits[1], w[j + 1:j + 1 + len(feed)]), strict=True):
                col[done:done + len(feed)] = vals
            done += len(feed)
        if progress is not None:
            progress((k + 1) / len(windows), f"window {k + 1} of {len(windows)}: {done} positions compared")
    lens_flush()
    for side in (A, B):
        side.s.forget_cache()
    nll_a, nll_b, kl, p_a, p_b, same = cols
    lens_mean = lens_sum / max(lens_n, 1)
    seconds = time.perf_counter() - t_start
    return {
        "mode": "corpus",
        "labels": [A.label, B.label],
        "corpus": name,
        "corpus_tokens": len(ids),
        "tokens": len(windows) * window,
        "window": window,
        "windows": len(windows),
        "scored_from": first,
        **corpus_statistics(nll_a, nll_b, kl, p_a, p_b, same),
        "lens": {"layers": ["embedding", *(f"layer {i}" for i in range(1, L + 1))],
                 "kl": [float(x) for x in lens_mean[:L + 1]], "kl_output": float(lens_mean[L + 1]),
                 "positions": lens_n, "every": SPLIT_MAX_ROWS} if lens else None,
        "units": {"ppl": "tokens (exp of the mean nll in nats)", "kl": "nats: KL(a ‖ b)",
                  "delta_p": "probability of the actual next token, b − a"},
        "bytes_per_token": [float(A.info.decode_weight_bytes), float(B.info.decode_weight_bytes)],
        "kernels": [A.info.kernels, B.info.kernels],
        "dtype": [A.info.dtype, B.info.dtype],
        "vocab_size": V,
        "seconds": seconds,
    }


# ---- the command line ------------------------------------------------------------------------------------------
def add_subcommand(sub: argparse._SubParsersAction) -> None:
    from engine.cliargs import add_kernels_arg, add_model_args, add_threads_arg, int_in

    q = sub.add_parser("compare", help="what quantization changed: two forms of one model, layer by layer")
    add_model_args(q)
    q.add_argument("--other", default=None, help="the other form (a .gguf file, a folder or a known model); "
                   "default: --model itself (then --other-backend or --other-kernels should differ)")
    q.add_argument("--other-backend", default="auto", choices=["auto", "torch", "llama.cpp"],
                   help="the runtime of --other, as --backend")
    add_kernels_arg(q, "--other-kernels", "--other")
    q.add_argument("--prompt", default=None, help="the prompt whose greedy continuation is compared")
    q.add_argument("--chat", action="store_true")
    q.add_argument("--steps", type=int_in(1, 4096), default=16, help="tokens of a's greedy continuation compared")
    q.add_argument("--corpus", default=None, metavar="FILE",
                   help="compare over this text file instead of a prompt, as llama-perplexity --kl-divergence "
                   "does: perplexity of each side, KL and Δp percentiles, same top token")
    q.add_argument("--window", type=int_in(4, 1 << 16), default=CORPUS_WINDOW,
                   help="--corpus: tokens per window, the first half context only")
    q.add_argument("--max-tokens", type=int_in(4, 1 << 22), default=CORPUS_MAX_TOKENS,
                   help="--corpus: the corpus's tokens compared at most (whole windows)")
    q.add_argument("--lens", action="store_true",
                   help="--corpus: also the KL of the two sides' logit lens per layer (L + 1 LM heads a step)")
    add_threads_arg(q)
    q.set_defaults(func=cmd_compare, local_only="needs every layer's residual stream and attention, which a server "
                                                "does not report")


def cmd_compare(a: argparse.Namespace) -> int:
    import sys

    from engine.backends import session_from_args
    from engine.cliargs import UsageError, one_line

    if (a.prompt is None) == (a.corpus is None):
        raise UsageError("give --prompt (one sequence) or --corpus FILE (a text, in windows), one of the two")
    text = read_corpus_or_fail(a.corpus, a.max_tokens) if a.corpus is not None else ""
    first = session_from_args(a)
    second = session_from_args(argparse.Namespace(**{**vars(a), "model": a.other if a.other else a.model,
                                                      "backend": a.other_backend, "kernels": a.other_kernels}))
    shown = None if a.json else (lambda f, m: print(f"  {m}", file=sys.stderr))
    if a.corpus is not None:
        return _corpus_cli(a, first, second, text, shown)
    n_prompt = len(first.tokenize(a.prompt, a.chat).ids)
    room = min(first.cfg.context_length, second.cfg.context_length) - n_prompt
    if a.steps > room:
        raise UsageError(f"--steps {a.steps} is past the context: {n_prompt} prompt tokens leave room for "
                         f"{max(room, 0)} steps")
    with one_line(Unsupported, ValueError, Cancelled):
        out = compare(first, second, a.prompt, a.steps, a.chat, progress=shown)
    if a.json:
        print(json.dumps(out, ensure_ascii=False))
        return 0
    print(f"a: {out['labels'][0]}\nb: {out['labels'][1]}")
    for k, side in enumerate("ab"):
        tpot = out["tpot_s"][k]
        print(f"{side}: {out['bytes_per_token'][k] / 2**20:,.1f} MiB of weights per token, TPOT "
              + (f"{tpot * 1e3:.1f} ms" if tpot is not None else "- (one step only)"))
    print(f"{out['steps']} steps of a's greedy continuation: {''.join(out['pieces'])!r}")
    js = out["attention_js"]
    print(f"{'point':<10} {'KL nats':>10} {'attn JS':>9}")
    for i, name in enumerate(out["layers"]):
        print(f"{name:<10} {out['kl'][i]:>10.2e} {'' if i == 0 or js is None else f'{js[i - 1]:.4f}':>9}")
    print(f"{'output':<10} {out['kl_output']:>10.2e}")
    flips = out["top1_flips"]
    print(f"top-1 differs at {len(flips)} of {out['steps']} steps" + (": " + ", ".join(
        f"step {f['step']} {f['a_piece']!r}→{f['b_piece']!r}" for f in flips) if flips else ""))
    print(f"[{out['seconds']:.1f} s]", file=sys.stderr)
    return 0


def read_corpus_or_fail(path: str, max_tokens: int) -> str:
    """read_corpus, its refusal a CliError (one line, exit code 1)."""
    from engine.cliargs import one_line

    with one_line(ValueError):
        return read_corpus(path, max_tokens)


def _corpus_cli(a: argparse.Namespace, first, second, text: str, shown) -> int:
    import sys

    from engine.cliargs import one_line

    with one_line(Unsupported, ValueError, Cancelled):
        out = compare_corpus(first, second, text, a.window, a.max_tokens, name=Path(a.corpus).name, progress=shown,
                             lens=a.lens)
    if a.json:
        print(json.dumps(out, ensure_ascii=False))
        return 0
    print(corpus_report(out))
    print(f"[{out['seconds']:.1f} s]", file=sys.stderr)
    return 0


def corpus_report(out: dict) -> str:
    """A corpus comparison as the lines the CLI prints (llama-perplexity's statistics, in its order)."""
    kl, dp = out["kl_stats"], out["delta_p"]
    se = f" ± {kl['mean_se']:.6f}" if kl["mean_se"] is not None else ""
    lines = [f"a: {out['labels'][0]}", f"b: {out['labels'][1]}",
             f"{out['corpus']}: {out['tokens']} of its {out['corpus_tokens']} tokens in {out['windows']} windows of "
             f"{out['window']}, {out['positions']} positions scored (each window's first {out['scored_from']} are "
             "context)",
             f"{'PPL(a)':<18} {out['ppl'][0]:.4f}", f"{'PPL(b)':<18} {out['ppl'][1]:.4f}",
             f"{'ln(PPL(b)/PPL(a))':<18} {out['ln_ppl_ratio']:+.6f}",
             f"{'Mean KL':<18} {kl['mean']:.6f}{se} nats"]
    lines += [f"{name:<18} {kl[key]:.6f}" for name, key in
              (("Maximum KL", "max"), ("99.9% KL", "p99_9"), ("99.0% KL", "p99"), ("95.0% KL", "p95"),
               ("90.0% KL", "p90"), ("Median KL", "median"), ("Minimum KL", "min"))]
    lines += [f"{'Mean Δp':<18} {100 * dp['mean']:+.4f} %", f"{'Maximum Δp':<18} {100 * dp['max']:+.4f} %"]
    lines += [f"{f'{q:.1f}% Δp':<18} {100 * dp[percentile_key(q)]:+.4f} %" for q in reversed(DELTA_P_PERCENTILES)]
    lines += [f"{'Minimum Δp':<18} {100 * dp['min']:+.4f} %", f"{'RMS Δp':<18} {100 * dp['rms']:.4f} %",
              f"{'Same top p':<18} {100 * out['same_top']:.3f} %"]
    lens = out.get("lens")
    if lens:
        lines.append(f"logit lens, KL(a ‖ b) in nats, mean over {lens['positions']} positions (the last of each "
                     f"step of {lens['every']}):")
        lines += [f"  {name:<16} {v:.6f}" for name, v in zip(lens["layers"], lens["kl"], strict=True)]
        lines.append(f"  {'output':<16} {lens['kl_output']:.6f}")
    return "\n".join(lines)

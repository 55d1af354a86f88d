"""Ablation on llama.cpp: its graph evaluation callback can change a tensor, not only read it.

llama.cpp's scheduler asks the callback (`cb_eval`) of every graph node whether it wants the value; for a node it
wants, it computes the graph up to that node, hands the node over (ask = False) and only then computes what reads
it. So values written into the node's data there are what the rest of the graph reads: zeroing head h's slice of
`kqv_out-L` (the heads' outputs concatenated head-major, before the output projection: hook_z) changes the logits
as the torch engine's hook does (measured on the tiny random checkpoint: tests/why/test_ablate.py holds the two
within llama.cpp's own float differences from the torch engine; the intact runs differ by as much).

The nodes, by llama.cpp's own names for them (the graph builders name them with cb(…, il)):
    head output z        kqv_out-L        every architecture (built by the shared attention code)
    attention output     attn_out-L       llama; attn_post_norm-L where the model normalises it (Gemma 3)
    MLP output           ffn_out-L        llama, Qwen; ffn_post_norm-L for Gemma 3
A node a model's graph does not name (Qwen3's attention output) is refused in one line once the run shows it absent.

This runs in a context of its own on the session's model (weights held once, as engine.runtime.llamacpp does), with
every position's logits requested so the last layer keeps every row, and the whole prompt in one batch so a node's
rows are the prompt's positions 0…T−1. The session's own context and its capture callback are left untouched, which
is also why a generation cannot continue from the ablated model on llama.cpp (engine.why.ablate.ablation is the
torch engine's).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from engine.backend import Unsupported

if TYPE_CHECKING:
    import torch


def check_session(session: object):
    """The session when it is llama.cpp's, with attention not fused (flash attention forms no kqv_out node)."""
    from engine.backends.llamacpp import LlamaCppSession

    if not isinstance(session, LlamaCppSession):
        raise Unsupported(f"ablation cannot edit a {type(session).__name__}'s forward pass: load the model locally")
    if session.flash_attn:
        raise Unsupported("llama.cpp's flash attention fuses the heads' outputs away: run without it to ablate")
    return session


def node_names(session: object, spec) -> dict[bytes, list[slice]]:
    """node name → the columns of it to ablate, for the components of `spec` (an engine.why.ablate.Ablation)."""
    cfg = session.cfg
    post = cfg.post_norms
    nodes: dict[bytes, list[slice]] = {}
    for layer, head in spec.heads:
        cols = slice(head * cfg.head_dim, (head + 1) * cfg.head_dim)
        nodes.setdefault(f"kqv_out-{layer}".encode(), []).append(cols)
    for layer in spec.attn_layers:
        nodes.setdefault(f"{'attn_post_norm' if post else 'attn_out'}-{layer}".encode(), []).append(slice(None))
    for layer in spec.mlp_layers:
        nodes.setdefault(f"{'ffn_post_norm' if post else 'ffn_out'}-{layer}".encode(), []).append(slice(None))
    return nodes


class _Editor:
    """The evaluation callback: records the chosen nodes (their (T, width) values) and writes the edits into them.

    `edits` maps a node to [(columns, value)]: value None is zero, else (width,) put at `positions` (all if None).
    """

    def __init__(self, ggml, nodes: set[bytes], edits: dict[bytes, list[tuple[slice, np.ndarray | None]]],
                 positions: Sequence[int] | None) -> None:
        self.ggml, self.nodes, self.edits = ggml, nodes, edits
        self.rows = slice(None) if positions is None else list(positions)
        self.seen: dict[bytes, np.ndarray] = {}
        self.error: str | None = None

    def __call__(self, t: int, ask: bool, _user_data: int) -> bool:
        from engine.backends.llamacpp import _NAME_OFFSET, _tensor_array

        name = ctypes.string_at(t + _NAME_OFFSET)
        if ask:
            return name in self.nodes
        try:
            a = _tensor_array(self.ggml, t)  # (1, 1, T, width): ggml (width, T)
            self.seen[name] = np.array(a[0, 0], dtype=np.float32)  # before any edit: the clean value
            for cols, value in self.edits.get(name, ()):
                a[0, 0, self.rows, cols] = 0 if value is None else value
        except Exception as e:  # noqa: BLE001 — an exception must not cross into C; the run reports it
            self.error = f"{name.decode(errors='replace')}: {type(e).__name__}: {e}"
        return True  # False would abort the graph


def _run(session: object, ids: Sequence[int], editor: _Editor) -> np.ndarray:
    """Float32 logits (V,) of the last prompt position, the prompt run in one batch in a fresh context."""
    L = session.llama
    n = len(ids)
    callback = L.ggml_backend_sched_eval_callback(editor)  # kept alive until the context is freed
    cp = L.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = n
    cp.n_outputs_max_per_seq = 0  # every position's logits: the last layer then keeps every row
    cp.n_threads = cp.n_threads_batch = session.n_threads
    cp.flash_attn_type = 0  # ggml's flash attention forms no kqv_out node
    cp.no_perf = True
    cp.cb_eval = callback
    ctx = L.llama_init_from_model(session._model, cp)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not make a context of {n} positions")
    batch = L.llama_batch_init(n, 0, 1)
    try:
        batch.n_tokens = n
        for i, token in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = int(token), i, 1, 1
            batch.seq_id[i][0] = 0
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        if editor.error:
            raise RuntimeError(f"the edit of node {editor.error}")
        V = session.cfg.vocab_size
        return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n, V))[-1].copy()
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        del callback


def before_after(session: object, spec, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits (V,) of the next token without and with the ablation, both run by llama.cpp."""
    import torch

    s = check_session(session)
    ggml = s.llama._lab_ggml
    nodes = node_names(s, spec)
    clean = _Editor(ggml, set(nodes), {}, None)
    before = _run(s, ids, clean)
    absent = [n.decode() for n in nodes if n not in clean.seen]
    if absent:
        raise Unsupported(f"llama.cpp's graph for this {s.cfg.architecture} model names no node {absent[0]}, so that "
                          "component cannot be ablated there: use --backend torch")
    edits: dict[bytes, list[tuple[slice, np.ndarray | None]]] = {}
    for name, parts in nodes.items():
        for cols in parts:
            value = clean.seen[name][:, cols].mean(axis=0) if spec.mean else None  # mean over the prompt's positions
            edits.setdefault(name, []).append((cols, value))
    after = _run(s, ids, _Editor(ggml, set(nodes), edits, spec.positions))
    return torch.from_numpy(before), torch.from_numpy(after)

"""The intervention seam on llama.cpp: engine.model.seam's points read and written through llama.cpp's graph callback.

llama.cpp's scheduler asks the callback (`cb_eval`) of every graph node, in order, whether it wants the value; for a
node it wants, it computes the graph up to that node, hands the node over (ask = False) and only then computes what
reads it. So values written into the node's data there are what the rest of the graph reads, as a torch hook's are.

A point and the node that holds it (llama.cpp's names, given by the graph builders' cb(…, il)):
    resid_pre.0     embd (the selected token embeddings), or inp_scaled where the model scales them (Gemma 3)
    resid_post.L    l_out-L, block L's output (after llama.cpp's own control-vector adapter, where one is set)
    attn.z.L        kqv_out-L, the heads' outputs concatenated head-major before the output projection
    attn_out.L      attn_out-L; attn_post_norm-L where the model normalises it (Gemma 3)
    mlp_out.L       ffn_out-L; ffn_post_norm-L for Gemma 3. The llama graph names two nodes ffn_out-L, the MLP's
                    output and the residual sum that adds ffn_inp-L to it: the point is the one that does not read
                    ffn_inp-L.
A node a model's graph does not form (Qwen3's attention output; kqv_out under flash attention) is refused in one
sentence once a run shows it absent.

The runs happen in a runtime of the seam's own on the session's model (weights held once; its step is every other
runtime's step, engine.runtime.llamacpp), with every position's logits requested so the last layer keeps every row,
and each prompt in one batch from an empty cache, so a node's rows are the prompt's positions 0…T−1. The session's
own context and its capture callback are left untouched; `Writes` keeps edits on in that context for a generation.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.backend import Unsupported
from engine.backends.ggml_tensor import NAME_OFFSET, GGMLTensor, tensor_array
from engine.model.seam import Edit, Point, Recording, check_prompts

if TYPE_CHECKING:
    from engine.model.config import ModelConfig


def node_of(point: Point, cfg: ModelConfig) -> bytes:
    """llama.cpp's name for the graph node that holds `point` (the module docstring's table)."""
    post = cfg.post_norms
    if point.site == "resid":
        if point.layer == 0:
            return b"inp_scaled" if cfg.embedding_scale != 1 else b"embd"
        return f"l_out-{point.layer - 1}".encode()
    if point.site == "z":
        return f"kqv_out-{point.layer}".encode()
    if point.site == "attn":
        return f"{'attn_post_norm' if post else 'attn_out'}-{point.layer}".encode()
    return f"{'ffn_post_norm' if post else 'ffn_out'}-{point.layer}".encode()


def _reads(t: int, name: bytes) -> bool:
    """Whether graph node `t` takes a node called `name` as an operand."""
    return any(src and ctypes.string_at(src + NAME_OFFSET) == name for src in GGMLTensor.from_address(t).src)


_ATTN, _LOUT = b"kq_soft_max-", b"l_out-"
_EMBEDDING = (b"embd", b"inp_embd", b"inp_scaled")  # the last of these a graph evaluates is the residual's start


class _Tap:
    """The evaluation callback: which graph nodes one step wants, and their values once computed.

    Attention rows are kept per layer as they arrive (a prefill longer than UBATCH arrives in pieces, each with the
    keys cached so far); only the last `keep_rows` query rows of the step are copied (engine.model.seam.Reads' bound).
    """

    def __init__(self, ggml) -> None:
        self.ggml = ggml
        self.active = False
        self.error: str | None = None
        self.layers: frozenset[int] = frozenset()
        self.residual = False
        self.n_rows = self.keep_rows = 0
        self.attn: dict[int, list[np.ndarray]] = {}
        self.rows_seen: dict[int, int] = {}
        self.resid: dict[int, np.ndarray] = {}
        self.callback = None  # the ctypes function object, built by the owner (it must outlive the context)
        # the seam's edits kept on for every step (engine.backends.llamacpp_seam.Writes), and the step they act in
        self.writes = None
        self.adapter = None  # engine.backends.llamacpp_seam.AdapterSteer: added vectors through llama.cpp's adapter
        self.start = self.n_step = 0
        self.written: dict[bytes, int] = {}  # rows of each written node this step so far

    def begin(self, layers: frozenset[int], residual: bool, n_rows: int, keep_rows: int) -> None:
        self.layers, self.residual = layers, residual
        self.n_rows, self.keep_rows = n_rows, keep_rows
        self.attn, self.rows_seen, self.resid = {}, {}, {}
        self.error = None
        self.active = bool(layers) or residual or self.writes is not None

    def end(self) -> None:
        self.layers, self.residual = frozenset(), False
        self.active = self.writes is not None

    def step(self, start: int, n: int) -> None:
        """A step of `n` tokens from position `start` begins (the positions the seam's edits are written at)."""
        self.start, self.n_step, self.written = start, n, {}
        if self.adapter is not None:
            self.adapter.update()

    def __call__(self, t: int, ask: bool, _user_data: int) -> bool:
        if not self.active:  # the fast path: one attribute read per graph node
            return False
        name = ctypes.string_at(t + NAME_OFFSET)
        if ask:
            return self._wants(t, name)
        try:
            self._record(t, name)
        except Exception as e:  # noqa: BLE001 — an exception must not cross into C; the step reports it
            self.error = f"{name.decode(errors='replace')}: {type(e).__name__}: {e}"
        return True  # False would abort the graph

    def _wants(self, t: int, name: bytes) -> bool:
        if self.writes is not None and self.writes.wants(t, name):
            return True
        if name.startswith(_ATTN):
            return name[len(_ATTN):].isdigit() and int(name[len(_ATTN):]) in self.layers
        if self.residual:
            return (name.startswith(_LOUT) and name[len(_LOUT):].isdigit()) or name in _EMBEDDING
        return False

    def _record(self, t: int, name: bytes) -> None:
        a = tensor_array(self.ggml, t)  # attention (1, H, q, n_kv); residual (1, 1, rows, d)
        if self.writes is not None and self.writes.wants(t, name):
            first = self.written.get(name, 0)
            self.written[name] = first + a.shape[2]
            self.writes.apply(name, a[0, 0], self.start, first, self.n_step)
            if not (self.residual and (name.startswith(_LOUT) or name in _EMBEDDING)):
                return
        if name.startswith(_ATTN):
            layer = int(name[len(_ATTN):])
            first = self.rows_seen.get(layer, 0)
            n = a.shape[2]
            self.rows_seen[layer] = first + n
            lo = max(0, self.n_rows - self.keep_rows - first)  # rows of this piece among the step's last keep_rows
            if lo < n:
                self.attn.setdefault(layer, []).append(np.array(a[0, :, lo:, :], dtype=np.float32))
        elif a.shape[2]:  # the last layer keeps only the rows whose logits are wanted: none in a prompt's early pieces
            index = 0 if name in _EMBEDDING else int(name[len(_LOUT):]) + 1
            self.resid[index] = np.array(a[0, 0, -1, :], dtype=np.float32)  # the newest position


class SeamRuntime:
    """A one-sequence llama.cpp runtime of the session's model with a graph callback of its own (a _Tap that only
    writes and keeps whole nodes): each run is a prompt from an empty cache, every position an output (so the last
    layer keeps every row). Made on first use, grown when a longer prompt comes, freed by close()."""

    def __init__(self, session) -> None:
        self.session = session
        self.tap = _Tap(session.llama._lab_ggml)
        self.tap.callback = session.llama.ggml_backend_sched_eval_callback(self.tap)  # outlives the context
        self.rt = None

    def close(self) -> None:
        if self.rt is not None:
            self.rt.close()
            self.rt = None

    def run(self, ids: Sequence[int], writes: Writes, every: bool = False) -> np.ndarray:
        """Float32 logits (V,) of the last position of `ids` (with `every`, (T, V) of each), run in one batch from
        an empty cache with `writes` (and the nodes it keeps) in the callback."""
        from engine.runtime.base import Row
        from engine.runtime.llamacpp import LlamaCppRuntime

        n = len(ids)
        if self.rt is None or self.rt.capacity < n:
            self.close()
            size = min(self.session.cfg.context_length, max(256, -(-n // 256) * 256))
            self.rt = LlamaCppRuntime(self.session, 1, size, callback=self.tap.callback)
            self.rt.tap = self.tap  # the runtime tells it where each step starts
        if n > self.rt.n_ubatch:  # a node's rows are the prompt's positions only when it runs as one graph
            raise ValueError(f"a seam run takes at most {self.rt.n_ubatch} tokens, got {n}")
        self.rt.remove(0)
        self.tap.writes, self.tap.error, self.tap.active = writes, None, True
        try:
            logits = self.rt.forward([Row(0, list(ids), all_logits=True)])[0].numpy()  # (T, V)
        finally:
            self.tap.writes, self.tap.active = None, False
        if self.tap.error:
            raise RuntimeError(f"the edit of node {self.tap.error}")
        return logits if every else logits[-1]


def run_points(session, prompts: Sequence[Sequence[int]], edits: Iterable[Edit] = (),
               record: Iterable[Point] = (), every: bool = False) -> tuple[torch.Tensor, Recording]:
    """engine.model.seam.run_points on llama.cpp: each prompt (batch row b) is its own run, given the edits that
    name row b (or every row). Returns the last positions' float32 logits (B, V) and the recorded points (B, T, W)."""
    cfg = session.cfg
    rows = check_prompts(prompts)
    edits, record = list(edits), list(dict.fromkeys(record))
    for p in [e.point for e in edits] + record:
        p.check(cfg)
    if any(p.site == "z" for p in [e.point for e in edits] + record) and session.flash_attn:
        raise Unsupported("llama.cpp's flash attention fuses the heads' outputs away: load without it to reach "
                          "a head's output")
    T, B = len(rows[0]), len(rows)
    for e in edits:
        if e.rows is not None and any(not 0 <= r < B for r in e.rows):
            raise ValueError(f"the edit of {e.point} names rows {list(e.rows)}, but there are {B} prompts")
        if e.positions is not None and any(not 0 <= p < T for p in e.positions):
            raise ValueError(f"the edit of {e.point} names positions outside the prompt's 0…{T - 1}")
    seam = session.seam_context()
    nodes = {p: node_of(p, cfg) for p in [e.point for e in edits] + record}
    keep = {nodes[p] for p in record}
    logits, seen = [], []
    for b, ids in enumerate(rows):
        mine = []  # the edits of row b, as one prompt's: a value per row chosen, a (T, W) value's positions named
        for e in edits:
            if e.rows is not None and b not in e.rows:
                continue
            width = e.point.width(cfg)
            positions = e.positions
            value = None
            if e.value is not None:
                n_pos = T if positions is None else len(positions)
                v = e.value.detach().float().cpu()
                try:
                    v = v.expand(1 if e.rows is None else len(e.rows), n_pos, width)
                except RuntimeError:
                    raise ValueError(f"the edit of {e.point} has a value of shape {tuple(v.shape)}, which does not "
                                     f"broadcast to (rows, positions {n_pos}, width {width})") from None
                value = v[0 if e.rows is None else e.rows.index(b)]  # (P, W)
                positions = tuple(range(T)) if positions is None else positions
            mine.append(Edit(e.point, value, positions, None, e.add))
        writes = Writes(mine, cfg, keep=keep)
        logits.append(seam.run(ids, writes, every))
        absent = [n for n in set(writes.by_node) | keep if n not in writes.hit]
        if absent:
            raise Unsupported(f"llama.cpp's graph for this {cfg.architecture} model forms no node "
                              f"{absent[0].decode()}, so that point cannot be reached there: use --backend torch")
        seen.append(writes.seen)
    rec = Recording()
    for p in record:
        rec._add(p, torch.from_numpy(np.stack([s[nodes[p]][:, p.columns(cfg)] for s in seen])))
    return torch.from_numpy(np.stack(logits)), rec


class Writes:
    """The seam's edits kept on for a whole generation in the session's own context (its graph callback, the
    session's _Tap, applies them each step): positions are absolute, so each step writes the positions it runs.

    A value is None (zero), (W,) for every edited position, or (P, W) for the P positions an edit names. The last
    layer's MLP output and block output hold only the rows whose logits a step asks for (llama.cpp drops the others
    before them): their rows are taken to be the step's last positions.
    """

    def __init__(self, edits: Iterable[Edit], cfg: ModelConfig, keep: set[bytes] = frozenset()) -> None:
        self.by_node: dict[bytes, list[tuple[slice, tuple[int, ...] | None, np.ndarray | None, bool]]] = {}
        self.keep = set(keep)  # nodes whose whole (rows, width) value is kept, after the writes (`seen`)
        self.seen: dict[bytes, np.ndarray] = {}
        self.hit: set[bytes] = set()  # the wanted nodes the graph formed
        for e in edits:
            e.point.check(cfg)
            if e.rows not in (None, (0,)):
                raise ValueError(f"the edit of {e.point} names batch rows {list(e.rows)}; a generation has one")
            value = None if e.value is None else e.value.detach().float().cpu().numpy()
            n_pos = None if e.positions is None else len(e.positions)
            if value is not None and value.ndim > 1 and (n_pos is None or value.reshape(-1, value.shape[-1]).shape[0]
                                                         != n_pos):
                raise ValueError(f"the edit of {e.point} kept on for a generation takes one vector, or one per "
                                 "position it names")
            if value is not None:
                value = value.reshape(-1, value.shape[-1]) if value.ndim > 1 else value
            self.by_node.setdefault(node_of(e.point, cfg), []).append(
                (e.point.columns(cfg), e.positions, value, e.add))
        last = cfg.n_layers - 1
        self.pruned = {node_of(Point.mlp(last), cfg), node_of(Point.resid(last + 1), cfg)}

    def wants(self, t: int, name: bytes) -> bool:
        """Whether graph node `t`, called `name`, is one to write or keep (the llama graph's second node called
        ffn_out-L, the residual sum that reads ffn_inp-L, is not the MLP's output)."""
        if name not in self.by_node and name not in self.keep:
            return False
        return not (name.startswith(b"ffn_out-") and _reads(t, b"ffn_inp-" + name[len(b"ffn_out-"):]))

    def apply(self, name: bytes, a: np.ndarray, start: int, first: int, n_step: int) -> None:
        """Write the edits of node `name` into `a` (rows, width), the rows being positions from start + first (or,
        for a node pruned to the step's outputs, its last positions); then keep a copy if it is kept."""
        self.hit.add(name)
        rows = a.shape[0]
        pos0 = start + first if name not in self.pruned or first or rows == n_step else start + n_step - rows
        for cols, positions, value, add in self.by_node.get(name, ()) if rows else ():
            if positions is None:
                local, v = slice(None), value
            else:
                which = [k for k, p in enumerate(positions) if pos0 <= p < pos0 + rows]
                if not which:
                    continue
                local = [positions[k] - pos0 for k in which]
                v = value if value is None or value.ndim == 1 else value[which]
            if v is None:
                a[local, cols] = 0
            elif add:
                a[local, cols] += v
            else:
                a[local, cols] = v
        if name in self.keep:
            self.seen[name] = np.array(a, dtype=np.float32)


class AdapterSteer:
    """Vectors added to blocks' outputs at every position, through llama.cpp's control-vector adapter on the
    session's own context (direction L is added at the end of block L, just before l_out-L; block 0 has none).
    `update`, before each step, sets the adapter again only when a vector changed (a steering scale moved): setting
    it makes llama.cpp plan its graph again, which costs the next step more than the seam's callback would."""

    def __init__(self, session, edits: Sequence[Edit]) -> None:
        self.session, self.edits = session, list(edits)
        self.last: np.ndarray | None = None

    @staticmethod
    def takes(edit: Edit, cfg: ModelConfig) -> bool:
        """Whether the adapter can do `edit`: one vector added to block L ≥ 1's output at every position and row."""
        return (edit.add and edit.point.site == "resid" and 2 <= edit.point.layer <= cfg.n_layers
                and edit.positions is None and edit.rows is None and edit.value is not None
                and edit.value.ndim == 1 and edit.value.shape[0] == cfg.d_model)

    def update(self) -> None:
        cfg, L = self.session.cfg, self.session.llama
        data = np.zeros((cfg.n_layers - 1, cfg.d_model), dtype=np.float32)  # layer 1 first, as llama.cpp wants
        for e in self.edits:
            data[e.point.layer - 2] += e.value.detach().float().cpu().numpy()
        if self.last is not None and np.array_equal(data, self.last):
            return
        flat = np.ascontiguousarray(data.reshape(-1))
        rc = L.llama_set_adapter_cvec(self.session._ctx, flat.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                      flat.size, cfg.d_model, 1, cfg.n_layers - 1)
        if rc != 0:
            raise RuntimeError(f"llama.cpp refused the control vector (llama_set_adapter_cvec returned {rc})")
        self.last = data

    def clear(self) -> None:
        """Take the vectors off the context (its KV cache is the caller's to forget)."""
        if self.last is not None:
            self.session.llama.llama_set_adapter_cvec(self.session._ctx, None, 0, self.session.cfg.d_model, -1, -1)
            self.last = None

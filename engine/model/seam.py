"""The intervention seam: the named places of a forward pass, and the torch engine's reads and writes of them.

Every capture, edit, patch and steer of a forward pass names its place with a Point, on either runtime: here the
torch engine reaches it through module hooks (`edited`, `run_points`), and engine.backends.llamacpp_seam maps the
same names onto llama.cpp's graph nodes. A Point's name (str(point), Point.parse), its constructor, and its tensor
in engine.model.transformer.Transformer, of width W:
    resid_pre.L     Point.resid(L): the residual stream block L reads (resid_pre.0: the embeddings × embedding_scale
                    as block 0 receives them), W = d
    resid_post.L    Point.resid(L + 1): block L's output (resid_post.n_layers−1 is what the final norm reads), W = d
    attn.z.L[.h]    Point.z(L, h): head h's output in layer L (TransformerLens's hook_z), the input of
                    layers[L].attn.wo, (B, T, H·hd) head-major, so head h is columns h·hd … (h+1)·hd − 1; W = hd
                    (h left out: every head of the layer, W = H·hd)
    attn.pattern.L  Point.pattern(L): layer L's attention weights after softmax, causal mask applied (read by
                    captures: `Reads`)
    attn_out.L      Point.attn(L): what layer L's attention adds to the residual stream: wo's output, after
                    post_attn_norm where the model has one (Gemma 3), W = d
    mlp_out.L       Point.mlp(L): what layer L's MLP adds to the residual stream, after post_mlp_norm where there is
                    one, W = d

An Edit replaces a point's value (zero, or a given value) at chosen absolute positions and batch rows; `edited`
applies edits and records points for the duration of a `with` block and always removes its hooks after it.
Positions are absolute (position p is the token at index p of the sequence), so an edit also holds across KV-cached
decode steps: a step edits the positions it runs, and an edit of every position (positions None) edits each new token.
A recorded point holds the value the model went on with (after any edit of that same point).

`Reads` is the seam's other use: what the panels and the lens copy out of every step as it runs (attention patterns
of chosen layers, the residual stream's last position at every resid point), recorded inside the forward pass
itself, since the attention computes its weights explicitly only when they are read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from engine.model.config import ModelConfig
from engine.protocol import ATTENTION_MAX_BYTES, Capture

Site = Literal["z", "attn", "mlp", "resid", "pattern"]


@dataclass(frozen=True)
class Point:
    """A place in the forward pass (see the module docstring for each site's tensor and width)."""

    site: Site
    layer: int
    head: int | None = None  # z only; None = every head of the layer

    @classmethod
    def z(cls, layer: int, head: int | None = None) -> Point:
        return cls("z", layer, head)

    @classmethod
    def attn(cls, layer: int) -> Point:
        return cls("attn", layer)

    @classmethod
    def mlp(cls, layer: int) -> Point:
        return cls("mlp", layer)

    @classmethod
    def resid(cls, layer: int) -> Point:
        return cls("resid", layer)

    @classmethod
    def pattern(cls, layer: int) -> Point:
        return cls("pattern", layer)

    def check(self, cfg: ModelConfig) -> None:
        """ValueError naming the model's layers and heads when this point is not one of its places."""
        if self.site not in ("z", "attn", "mlp", "resid", "pattern"):
            raise ValueError(f"unknown site {self.site!r}: choose z, attn, mlp, resid or pattern")
        if self.site == "pattern":
            raise ValueError(f"{self} is read by a step's captures (the panels' attention), not by a seam run")
        top = cfg.n_layers if self.site == "resid" else cfg.n_layers - 1
        what = "residual stream points 0 (the embeddings)" if self.site == "resid" else "layers 0"
        if not 0 <= self.layer <= top:
            raise ValueError(f"layer {self.layer} is out of range: this model has {what} to {top}")
        if self.head is not None and (self.site != "z" or not 0 <= self.head < cfg.n_heads):
            raise ValueError(f"head {self.head} is out of range: this model has heads 0 to {cfg.n_heads - 1} "
                             "in each layer" if self.site == "z" else f"a {self.site} point has no head")

    def columns(self, cfg: ModelConfig) -> slice:
        """The point's columns of the tensor that holds it (one head's of a layer's z; else all)."""
        if self.site == "z" and self.head is not None:
            return slice(self.head * cfg.head_dim, (self.head + 1) * cfg.head_dim)
        return slice(None)

    def width(self, cfg: ModelConfig) -> int:
        if self.site == "z":
            return cfg.q_dim if self.head is None else cfg.head_dim
        return cfg.d_model

    def __str__(self) -> str:
        if self.site == "z":
            return f"attn.z.{self.layer}" + ("" if self.head is None else f".{self.head}")
        if self.site == "resid":
            return "resid_pre.0" if self.layer == 0 else f"resid_post.{self.layer - 1}"
        if self.site == "pattern":
            return f"attn.pattern.{self.layer}"
        return f"{self.site}_out.{self.layer}"

    @classmethod
    def parse(cls, name: str) -> Point:
        """The point a name gives (the module docstring's names); ValueError listing them for anything else."""
        parts = name.strip().split(".")
        try:
            two = parts[:2] in (["attn", "z"], ["attn", "pattern"])
            nums = [int(x) for x in parts[2 if two else 1:]]
            kind = ".".join(parts[:2]) if two else parts[0]
            if kind == "attn.z" and len(nums) in (1, 2):
                return cls.z(*nums)
            if kind == "attn.pattern" and len(nums) == 1:
                return cls.pattern(nums[0])
            if len(nums) == 1 and kind in ("resid_pre", "resid_post", "attn_out", "mlp_out"):
                n = nums[0]
                return {"resid_pre": cls.resid(n), "resid_post": cls.resid(n + 1),
                        "attn_out": cls.attn(n), "mlp_out": cls.mlp(n)}[kind]
        except ValueError:
            pass
        raise ValueError(f"unknown point {name!r}: name one of resid_pre.L, resid_post.L, attn.z.L, attn.z.L.H, "
                         "attn_out.L, mlp_out.L, attn.pattern.L")


@dataclass(frozen=True, eq=False)
class Edit:
    """Set `point` to `value` (None: zero) at `positions` (absolute; None: every position a forward pass runs) in
    batch `rows` (None: every row); with `add`, add `value` to it instead (steering).

    `value` broadcasts to (R, P, W): R the rows edited, P the positions edited (len(positions), or the T positions
    of the forward pass when positions is None), W the point's width. So (W,) sets the same vector everywhere,
    (P, W) one vector per position, (R, P, W) one per row and position (patching sets a different one in each row).
    A forward pass that runs only some of the positions edits those (the matching slices of a (…, P, W) value).
    """

    point: Point
    value: torch.Tensor | None = None
    positions: tuple[int, ...] | None = None
    rows: tuple[int, ...] | None = None
    add: bool = False


class Reads:
    """What one forward pass copies out as it runs, for the panels and the lens: the attention patterns of the layers
    in `patterns` (`pattern[L]`: (B, H, rows, S)), and the residual stream's last position at every resid point,
    (B, n_layers + 1, d) (`stream`, when asked for) and its L2 norms (B, n_layers + 1) (`norms`).

    The pass keeps them as tensors where they were made; the first read brings them all to host memory at once, as
    detached numpy copies: on a GPU the step's captures then cost one wait for the device, not one per layer and
    read, and nothing keeps a tensor alive after the step.

    A step keeps all its query rows of attention, or, when they would take more than `max_attention_bytes` (a long
    prefill), only its last rows, as many as fit: a panel cannot show more, and the event says how many were left out.
    """

    def __init__(self, patterns: Iterable[int] = (), norms: bool = False, stream: bool = False,
                 max_attention_bytes: int = ATTENTION_MAX_BYTES) -> None:
        self.patterns, self.want_norms, self.want_stream = frozenset(patterns), norms, stream
        self.max_attention_bytes = max_attention_bytes
        self._made: dict[object, torch.Tensor] = {}  # layer, "norms" or "stream" → its tensor, not yet on the host
        self._pattern: dict[int, np.ndarray] = {}
        self._norms: np.ndarray | None = None
        self._stream: np.ndarray | None = None

    @classmethod
    def for_request(cls, capture: Capture) -> Reads | None:
        """The reads a Capture asks for, or None when it asks for nothing a forward pass must record."""
        if not capture.attention_layers and not capture.residual_norms and not capture.lens_top:
            return None
        return cls(capture.attention_layers, capture.residual_norms, capture.lens_top > 0,
                   capture.attention_max_bytes)

    def attention_rows(self, n_heads: int, n_queries: int, n_keys: int) -> int:
        """How many of a step's query rows (the last ones) to capture: all that fit in max_attention_bytes, ≥ 1."""
        return max(1, min(n_queries, self.max_attention_bytes // (n_heads * n_keys * 4)))

    def record_pattern(self, layer: int, weights: torch.Tensor) -> None:
        self._made[layer] = weights.detach().float()

    def record_resid(self, rows: list[torch.Tensor]) -> None:
        """The last position after the embedding and after each layer, (B, d) each: one stack and one norm for all."""
        stacked = torch.stack(rows, dim=1).detach().float()  # (B, n_layers + 1, d)
        if self.want_norms:
            self._made["norms"] = stacked.norm(dim=-1)
        if self.want_stream:
            self._made["stream"] = stacked

    def _host(self) -> None:
        if not self._made:
            return
        keys, made = list(self._made), list(self._made.values())
        self._made = {}
        device = made[0].device
        if device.type != "cpu":  # every copy queued, then one wait
            made = [t.to("cpu", non_blocking=True) for t in made]
            getattr(torch, device.type).synchronize(device)
        for key, t in zip(keys, made, strict=True):
            if key == "norms":
                self._norms = t.numpy()
            elif key == "stream":
                self._stream = t.numpy()
            else:
                self._pattern[key] = t.numpy()

    @property
    def pattern(self) -> dict[int, np.ndarray]:
        self._host()
        return self._pattern

    @property
    def norms(self) -> np.ndarray | None:
        self._host()
        return self._norms

    @property
    def stream(self) -> np.ndarray | None:
        self._host()
        return self._stream


class Recording:
    """The values of recorded points: each forward pass appends its (B, T, W) along the positions."""

    def __init__(self) -> None:
        self._parts: dict[Point, list[torch.Tensor]] = {}

    def _add(self, point: Point, value: torch.Tensor) -> None:
        self._parts.setdefault(point, []).append(value.detach().clone())

    def __contains__(self, point: Point) -> bool:
        return point in self._parts

    def __getitem__(self, point: Point) -> torch.Tensor:
        """(B, T, W): every position the block's forward passes ran, in order (KeyError if it never ran)."""
        parts = self._parts[point]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _positions_of(start: int | torch.Tensor, batch: int) -> list[int]:
    """Each row's first position in this forward pass (a ragged batch gives every row its own)."""
    if isinstance(start, torch.Tensor):
        return [int(s) for s in start.reshape(-1).tolist()]
    return [int(start)] * batch


def _apply(x: torch.Tensor, edit: Edit, cols: slice, starts: list[int]) -> None:
    """Write the edit into x (B, T, ·), in its columns `cols`, in place (x is the hook's own copy)."""
    B, T = x.shape[:2]
    rows = list(range(B)) if edit.rows is None else list(edit.rows)
    if any(not 0 <= r < B for r in rows):
        raise ValueError(f"the edit of {edit.point} names rows {rows}, but the forward pass has {B}")
    width = x[..., cols].shape[-1]
    n_pos = T if edit.positions is None else len(edit.positions)
    value = x.new_zeros(()) if edit.value is None else edit.value.to(device=x.device, dtype=x.dtype)
    try:
        value = value.expand(len(rows), n_pos, width)  # (R, P, W)
    except RuntimeError:
        raise ValueError(f"the edit of {edit.point} has a value of shape {tuple(value.shape)}, which does not "
                         f"broadcast to (rows {len(rows)}, positions {n_pos}, width {width})") from None
    # rows at one start (every batch but a ragged one) are written together; a ragged batch's rows one by one
    same_start = len({starts[r] for r in rows}) <= 1
    groups = [list(range(len(rows)))] if same_start else [[k] for k in range(len(rows))]  # indices into rows
    for group in groups:
        if not group:
            continue
        start = starts[rows[group[0]]]
        if edit.positions is None:
            which, local = list(range(T)), list(range(T))
        else:
            which = [k for k, p in enumerate(edit.positions) if start <= p < start + T]
            local = [edit.positions[k] - start for k in which]
        if not which:
            continue
        r = torch.tensor([rows[k] for k in group], device=x.device)[:, None]  # (R, 1)
        t = torch.tensor(local, device=x.device)[None, :]  # (1, P)
        v = value[torch.tensor(group, device=x.device)[:, None], torch.tensor(which, device=x.device)]
        if edit.add:
            x[r, t, cols] += v
        else:
            x[r, t, cols] = v


@contextlib.contextmanager
def edited(model: nn.Module, edits: Iterable[Edit] = (), record: Iterable[Point] = ()) -> Iterator[Recording]:
    """Apply `edits` to every forward pass of `model` (an engine Transformer) inside the block, recording the points
    in `record`; the hooks are removed when the block ends, also on an exception.

    ValueError (before any hook is placed) when a point is not one of the model's places.
    """
    cfg: ModelConfig = model.cfg
    edits, record = list(edits), list(dict.fromkeys(record))
    for p in [e.point for e in edits] + record:
        p.check(cfg)
    by_point: dict[Point, list[Edit]] = {}
    for e in edits:
        by_point.setdefault(e.point, []).append(e)
    rec = Recording()
    starts: dict[int, tuple[int | torch.Tensor, int]] = {}  # block → (start, batch) of the pass now running it
    handles: list[torch.utils.hooks.RemovableHandle] = []

    def rewrite(points: Sequence[Point], layer: int, x: torch.Tensor) -> torch.Tensor:
        start, batch = starts[layer]
        first = _positions_of(start, batch)
        if any(p in by_point for p in points):
            x = x.clone()  # the module's output may be a view another op still reads; edits go into a copy
        for p in points:
            for e in by_point.get(p, ()):
                _apply(x, e, p.columns(cfg), first)
            if p in record:
                rec._add(p, x[..., p.columns(cfg)])
        return x

    def on_block(layer: int):
        def pre(_m: nn.Module, args: tuple) -> tuple | None:
            x, start = args[0], args[1]
            starts[layer] = (start, x.shape[0])
            if layer == 0 and (points := [p for p in wanted if p == Point.resid(0)]):
                return (rewrite(points, 0, x), *args[1:])
            return None
        return pre

    wanted = set(by_point) | set(record)
    layers = sorted({_block_of(p) for p in wanted})
    try:
        for i in layers:
            block = model.layers[i]
            handles.append(block.register_forward_pre_hook(on_block(i)))
            for group, module, pre in _sites(block, i, wanted):
                if pre:
                    handles.append(module.register_forward_pre_hook(
                        lambda _m, args, g=group, i=i: (rewrite(g, i, args[0]), *args[1:])))
                else:
                    handles.append(module.register_forward_hook(
                        lambda _m, _args, out, g=group, i=i: rewrite(g, i, out)))
        yield rec
    finally:
        for h in handles:
            h.remove()


def _block_of(p: Point) -> int:
    """The block whose hooks reach p: resid(L) for L ≥ 1 is block L − 1's output, resid(0) block 0's input."""
    return p.layer - 1 if p.site == "resid" and p.layer > 0 else p.layer


def _sites(block: nn.Module, layer: int, wanted: set[Point]) -> list[tuple[list[Point], nn.Module, bool]]:
    """(points, module, is_pre_hook) for the hooks that reach `wanted`'s points in this block."""
    out: list[tuple[list[Point], nn.Module, bool]] = []
    z = [p for p in wanted if p.site == "z" and p.layer == layer]
    if z:  # every head's edit goes through the one pre-hook on wo, in a fixed order
        out.append((sorted(z, key=lambda p: -1 if p.head is None else p.head), block.attn.wo, True))
    if Point.attn(layer) in wanted:
        out.append(([Point.attn(layer)], block.attn if block.post_attn_norm is None else block.post_attn_norm, False))
    if Point.mlp(layer) in wanted:
        out.append(([Point.mlp(layer)], block.mlp if block.post_mlp_norm is None else block.post_mlp_norm, False))
    if Point.resid(layer + 1) in wanted:  # the block's output
        out.append(([Point.resid(layer + 1)], block, False))
    return out


def check_prompts(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """The prompts of a seam run as lists: one or more, all of one non-zero length (ValueError otherwise)."""
    rows = [[int(t) for t in p] for p in prompts]
    if not rows or len({len(r) for r in rows}) != 1 or not rows[0]:
        raise ValueError("a seam run takes one or more prompts of one non-zero length")
    return rows

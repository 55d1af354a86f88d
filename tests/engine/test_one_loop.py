"""One step loop (issue 29): which functions drive a generation, a fork and each lab on each runtime.

Every forward pass of the model (the torch Transformer's forward, llama.cpp's llama_decode) is recorded with the
function that made it, and every Runtime.forward with the function that called it. A generation or a fork on either
runtime is driven by Generation._run alone, through its runtime's forward; the labs loop in engine.labs over the
same Runtime.forward; and no model pass is made anywhere but in a runtime. A second loop (a backend's own copy of
the generation loop, a session stepping its model by hand) shows up here as a caller that is not in the table.

Also: one count of positions (a step at any other position than where the cache ends is refused; a failed step
leaves the cache and its record of tokens agreeing), and one ModelInfo per loaded model.
"""

from __future__ import annotations

import math
import sys
from collections import Counter

import pytest
import torch
from torch.testing import assert_close

from engine.events import Failed, Finished
from engine.model.kv_cache import KVCache
from engine.model.transformer import Transformer
from engine.protocol import Capture, SamplingParams
from engine.run.session import Generation, Session
from engine.runtime import Row, runtime_of
from engine.runtime.torch import ContiguousRuntime, TorchRuntime
from tests.requires import import_required

GREEDY = SamplingParams.greedy_params()
PROMPT = [5, 77, 140, 3, 250, 99, 12, 200, 41, 7]
GENERATION = {"engine.run.session:Generation._run"}
TORCH_PASSES = {"engine.runtime.torch:ContiguousRuntime.forward", "engine.runtime.torch:TorchRuntime.forward"}
LLAMA_PASSES = {"engine.runtime.llamacpp:LlamaCppRuntime._decode"}
# Who calls Runtime.forward in each lab, on either runtime: the lab's own loop in engine.labs, and the plain
# generation the speculative lab measures its speedup against. A new caller (a lab stepping a model its own way, a
# backend's copy of a loop) fails here until it is named.
LAB_CALLERS = {
    "batching": {"engine.labs.batching:decode_batch"},
    "speculative": {"engine.labs.speculative:_passes", *GENERATION},
    "scheduling": {"engine.labs.scheduler:warm_up", "engine.labs.scheduler:_timed_step"},
}
# Who calls Runtime.forward in each why-experiment that reads or writes the forward pass (through the seam,
# engine.model.seam): each runtime's seam run, and compare's step with a Capture.
SEAM = {"engine.run.session:Session.run_points", "engine.backends.llamacpp_seam:SeamRuntime.run"}
WHY_CALLERS = {
    "patch": SEAM, "ablate": SEAM, "steer": SEAM, "heads --ablate-top": SEAM,
    "compare": {"engine.why.compare:_Side.step", *GENERATION},  # and the greedy continuation it compares on
}
HERE = __name__


def _caller(depth: int) -> str:
    """`module:qualname` of the first frame `depth` up that is neither torch's module machinery nor this test."""
    f = sys._getframe(depth)
    while f is not None and (f.f_globals.get("__name__", "").startswith("torch") or f.f_globals["__name__"] == HERE):
        f = f.f_back
    return "?" if f is None else f"{f.f_globals.get('__name__')}:{f.f_code.co_qualname}"


@pytest.fixture
def calls(monkeypatch):
    """{"forward": Counter of Runtime.forward's callers, "pass": Counter of the model passes' makers}."""
    seen = {"forward": Counter(), "pass": Counter()}
    classes = [TorchRuntime, ContiguousRuntime]
    try:  # counted where it is installed; the llama.cpp runtime's tests require it (the `session` fixture)
        import llama_cpp

        from engine.runtime.llamacpp import LlamaCppRuntime

        classes.append(LlamaCppRuntime)
        decode = llama_cpp.llama_decode

        def counted_decode(ctx, batch):
            seen["pass"][_caller(2)] += 1
            return decode(ctx, batch)

        monkeypatch.setattr(llama_cpp, "llama_decode", counted_decode)
    except ImportError:
        pass
    for cls in classes:
        def counted(self, rows, _orig=cls.forward):
            seen["forward"][_caller(2)] += 1
            return _orig(self, rows)

        monkeypatch.setattr(cls, "forward", counted)
    model_forward = Transformer.forward

    def counted_model(self, *a, **kw):
        seen["pass"][_caller(2)] += 1
        return model_forward(self, *a, **kw)

    monkeypatch.setattr(Transformer, "forward", counted_model)
    return seen


def _require_llama_cpp():
    return import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")


@pytest.fixture(params=["torch", "llama.cpp"])
def session(request, tiny_lm, tiny_dir):
    """(runtime name, a session on it, the functions that may make its model passes), for each runtime; llama.cpp
    missing is a missing dependency (tests/requires.py), never a runtime quietly left out."""
    if request.param == "torch":
        yield "torch", Session(tiny_lm), TORCH_PASSES
        return
    _require_llama_cpp()
    from engine.backends.llamacpp import LlamaCppSession

    s = LlamaCppSession(tiny_dir.gguf, n_ctx=256)
    try:
        yield "llama.cpp", s, LLAMA_PASSES
    finally:
        s.close()


def _finish(events) -> Finished:
    last = list(events)[-1]
    assert isinstance(last, Finished), last
    return last


def test_a_generation_and_a_fork_run_in_the_one_loop_on_both_runtimes(tiny_lm, calls, session):
    everything = Capture.everything(tiny_lm.cfg.n_layers, funnel_top=5)
    name, s, passes = session
    for what in ("generate", "fork"):
        calls["forward"].clear()
        calls["pass"].clear()
        if what == "generate":
            fin = _finish(s.generate(PROMPT, GREEDY, 6, everything, ignore_eos=True))
        else:
            _finish(s.fork(PROMPT, fin.ids.tolist(), 3, 9, GREEDY, 4, ignore_eos=True))
        assert set(calls["forward"]) == GENERATION, (name, what, calls["forward"])
        assert calls["pass"] and set(calls["pass"]) <= passes, (name, what, calls["pass"])
        assert sum(calls["pass"].values()) == sum(calls["forward"].values()), (name, what)  # a pass per step
    overriders = [c.__qualname__ for c in _subclasses(Generation) if "_run" in vars(c)]
    assert overriders == [], f"a second generation loop: {overriders}"


def _subclasses(cls) -> list[type]:
    out = []
    for c in cls.__subclasses__():
        out += [c, *_subclasses(c)]
    return out


def test_the_labs_loop_over_runtime_forward_on_both_runtimes(calls, session):
    from engine.labs import speculative as sp
    from engine.labs.batching import bench_batch
    from engine.labs.schedule_events import SchedConfig
    from engine.labs.scheduler import schedule

    sched = SchedConfig(n_requests=3, rate=math.inf, prompt_len=6, output_len=4, range_ratio=0.5, max_batch=2, seed=1)
    labs = {
        "batching": lambda s: bench_batch(s, (1, 2), prompt_tokens=6, new_tokens=3),
        "speculative": lambda s: list(sp.speculate(s, PROMPT * 2, sp.SpecConfig(k=2, source="lookup",
                                                                               ignore_eos=True), GREEDY, 6)),
        "scheduling": lambda s: list(schedule(s, sched)),
    }
    name, s, passes = session
    for lab, run in labs.items():
        calls["forward"].clear()
        calls["pass"].clear()
        run(s)
        assert set(calls["forward"]) == LAB_CALLERS[lab], (lab, name, calls["forward"])
        assert calls["pass"] and set(calls["pass"]) <= passes, (lab, name, calls["pass"])


def test_the_why_experiments_step_through_the_runtimes_on_both_runtimes(calls, session):
    """Patching, ablation, steering, head ablation and compare: every forward pass through a runtime's one step, and
    the same experiment on either runtime (a seam run on torch or llama.cpp: engine.model.seam's points)."""
    from engine.formats.control_vector import ControlVector
    from engine.why.ablate import ablate
    from engine.why.compare import compare
    from engine.why.heads import ablation_loss
    from engine.why.patch import patch
    from engine.why.steer import next_token_logits

    name, s, passes = session
    d = s.cfg.d_model
    experiments = {
        "patch": lambda: patch(s, "zq vx kj wy", "zq vx kb wy", "k", "j", heads=True),
        "ablate": lambda: ablate(s, "zq vx kj wy", heads=[(1, 2)], mean=True),
        "steer": lambda: next_token_logits(s, PROMPT, ControlVector({1: torch.ones(d).numpy()}), 2.0),
        "heads --ablate-top": lambda: ablation_loss(s, PROMPT * 2, 2, [(0, 1)]),
        "compare": lambda: compare(s, other, "zq vx kj wy", 3),
    }
    other = s.sibling(s.info.path)  # a second session of the same file: compare keeps a cache on each side
    for what, run in experiments.items():
        calls["forward"].clear()
        calls["pass"].clear()
        run()
        assert set(calls["forward"]) <= WHY_CALLERS[what] and calls["forward"], (what, name, calls["forward"])
        assert calls["pass"] and set(calls["pass"]) <= passes, (what, name, calls["pass"])
    other.close()


# ---- one count of positions ------------------------------------------------------------------------------------
def _reference(lm, ids: list[int]) -> torch.Tensor:
    """Logits (V,) after `ids`, from a fresh cache: the model's single-sequence path."""
    with torch.inference_mode():
        return lm.model(torch.tensor([ids]), KVCache(lm.cfg, 1, len(ids), lm.dtype))[0]


def test_a_step_runs_only_where_the_cache_ends(tiny_lm):
    s = Session(tiny_lm)
    fin = _finish(s.generate(PROMPT, GREEDY, 4, ignore_eos=True))
    held = len(PROMPT) + len(fin.ids) - 1  # the last token sampled is not run yet
    assert s.cache.pos == len(s.cached_ids) == held
    assert s.cached_ids == PROMPT + fin.ids.tolist()[:-1]
    with pytest.raises(ValueError, match=f"cache holds {held} positions"):
        s._forward([1], held - 2)  # the caller's count drifted from the cache's: refused, nothing written
    assert s.cache.pos == len(s.cached_ids) == held
    got = s._forward([int(fin.ids[-1])], held)
    assert_close(got, _reference(tiny_lm, PROMPT + fin.ids.tolist()), rtol=1e-4, atol=1e-4)


def test_a_failed_step_leaves_the_cache_and_its_tokens_agreeing(tiny_lm, monkeypatch):
    rt = ContiguousRuntime(tiny_lm, 32)
    rt.forward([Row(0, PROMPT[:6])])
    layer = tiny_lm.model.layers[1]

    def broken(*a, **kw):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(layer, "forward", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        rt.forward([Row(0, PROMPT[6:])])  # layer 0 wrote its keys, layer 1 failed
    monkeypatch.undo()
    assert rt.length(0) == len(rt.held(0)) == 6 and rt.held(0) == PROMPT[:6]
    got = rt.forward([Row(0, PROMPT[6:])])[0]  # the same step again, at the same positions
    assert_close(got, _reference(tiny_lm, PROMPT), rtol=1e-4, atol=1e-4)


def test_a_failed_generation_forgets_the_whole_cache(tiny_lm, monkeypatch):
    s = Session(tiny_lm)
    _finish(s.generate(PROMPT, GREEDY, 3, ignore_eos=True))
    n = {"steps": 0}
    model_forward = Transformer.forward

    def fails_on_the_third(self, *a, **kw):
        n["steps"] += 1
        if n["steps"] == 3:
            raise RuntimeError("out of memory")
        return model_forward(self, *a, **kw)

    monkeypatch.setattr(Transformer, "forward", fails_on_the_third)
    last = list(s.generate(PROMPT[:4], GREEDY, 5, ignore_eos=True))[-1]
    assert isinstance(last, Failed) and "out of memory" in last.message
    assert s.cache is None and s.cached_ids == []
    monkeypatch.undo()
    again = _finish(s.generate(PROMPT, GREEDY, 3, ignore_eos=True))
    assert again.ids.tolist() == _finish(Session(tiny_lm).generate(PROMPT, GREEDY, 3, ignore_eos=True)).ids.tolist()


def test_llamacpp_positions_are_its_runtimes_and_a_failed_decode_changes_nothing(tiny_dir, monkeypatch):
    llama_cpp = _require_llama_cpp()
    from engine.backends.llamacpp import LlamaCppSession

    s = LlamaCppSession(tiny_dir.gguf, n_ctx=256)
    try:
        fin = _finish(s.generate(PROMPT, GREEDY, 4, ignore_eos=True))
        rt = s.runtime()
        held = len(PROMPT) + len(fin.ids) - 1
        assert rt.length(0) == len(s.cached_ids) == held
        with pytest.raises(ValueError, match=f"cache holds {held} positions"):
            s._forward([1], held + 3)
        assert rt.length(0) == held
        monkeypatch.setattr(llama_cpp, "llama_decode", lambda ctx, batch: 1)
        with pytest.raises(RuntimeError, match="llama_decode returned 1"):
            rt.forward([Row(0, [1, 2])])
        assert rt.length(0) == len(rt.held(0)) == held  # nothing recorded for a step that did not run
        last = list(s.generate(PROMPT, GREEDY, 3, ignore_eos=True))[-1]
        assert isinstance(last, Failed) and rt.length(0) == 0 and s.cached_ids == []
    finally:
        s.close()


# ---- one ModelInfo per loaded model ------------------------------------------------------------------------------
def test_every_torch_runtime_shares_the_models_one_modelinfo(tiny_lm):
    s = Session(tiny_lm)
    assert s.runtime(64).info is tiny_lm.info
    with runtime_of(s, 2, 16) as rt:
        assert rt.info is tiny_lm.info


def test_every_llamacpp_runtime_shares_the_models_one_modelinfo(tiny_dir, monkeypatch):
    _require_llama_cpp()
    import engine.backends.llamacpp as backend

    lcpp = backend.LlamaCppSession(tiny_dir.gguf, n_ctx=256)
    try:
        assert lcpp.info.sha256  # a saved session names the file without hashing it again
        made = []
        monkeypatch.setattr(backend, "model_info", lambda *a, **kw: made.append(kw))  # its one ModelInfo
        monkeypatch.setattr(backend, "_sha256", lambda path: made.append(path))
        assert lcpp.runtime().info is lcpp.info
        with runtime_of(lcpp, 2, 16) as rt:
            assert rt.info is lcpp.info
        assert made == []
    finally:
        lcpp.close()

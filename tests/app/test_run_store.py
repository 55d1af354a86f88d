"""The run store (app.run_store): bounded memory on a long run and many runs, the context of a step rebuilt from the
run, server runs; sessions written and read off the GUI thread, autosaves coalesced, the tokenizer serialised once."""

from __future__ import annotations

import io
import json
import threading
import zipfile

import numpy as np
import pytest

from app import exports, run_store, session_io
from app.run_store import LOGITS_BYTES, MAX_RUNS, RunStore, logits_steps
from engine.events import (
    Finished,
    Funnel,
    KVCacheGrew,
    PrefillDone,
    PromptTokenized,
    ResidualNorms,
    RunSource,
    RunStarted,
    StepCost,
    TokenSampled,
)
from engine.protocol import FUNNEL_TOP, SamplingParams
from engine.remote.backend import RemoteTokenSampled, TopNFunnel
from engine.run.refunnel import funnel_stages
from engine.session_file import load_session, save_session
from tests.app.conftest import wait_loaded
from tests.app.test_sessions import generate
from tests.session_v1 import save_v1

pytestmark = pytest.mark.qt_log_ignore("This plugin does not support raise")

VOCAB, LAYERS = 49_152, 30  # SmolLM2-135M's shapes
COST = StepCost(flops=1.0, weight_bytes=1.0, kv_read_bytes=0.0, kv_write_bytes=0.0)


def funnel(rng, n: int = FUNNEL_TOP, cls=Funnel, **kw) -> Funnel:
    p = np.sort(rng.random(n).astype(np.float32))[::-1]
    return cls(ids=rng.integers(0, VOCAB, n), pieces=tuple("x" for _ in range(n)), logits=p.copy(), p_raw=p,
               p_temperature=p, p_top_k=p, p_top_p=p, p_final=p, kept_top_k=n, kept_top_p=n, kept_final=n,
               vocab_size=VOCAB, greedy=False, **kw)


def synthetic_run(n_tokens: int, n_prompt: int = 32, seed: int = 0, source: str = "local"):
    """The events of a local run at SmolLM2's shapes: full logits, a funnel and residual norms at every step."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, n_prompt)
    yield RunStarted(source=RunSource(kind=source, name="synthetic"))
    yield PromptTokenized(text="p" * n_prompt, ids=prompt, pieces=("p",) * n_prompt,
                          offsets=np.zeros((n_prompt, 2), np.int64), byte_offsets=np.zeros((n_prompt, 2), np.int64),
                          special=np.zeros(n_prompt, bool))
    ids = []
    for step in range(n_tokens):
        yield ResidualNorms(step=step, norms=rng.random(LAYERS + 1).astype(np.float32))
        yield KVCacheGrew(step=step, n_tokens=n_prompt + step, bytes_used=1, bytes_allocated=1)
        if step == 0:
            yield PrefillDone(n_tokens=n_prompt, n_reused=0, seconds=0.01, cost=COST)
        tok = int(rng.integers(0, VOCAB))
        ids.append(tok)
        yield TokenSampled(step=step, phase="prefill" if step == 0 else "decode", position=n_prompt + step,
                           token_id=tok, piece="t", text="t", seconds=0.01, cost=COST, funnel=funnel(rng),
                           logits=rng.standard_normal(VOCAB).astype(np.float32))
    yield Finished(reason="length", prompt_ids=prompt, ids=np.asarray(ids), text="t" * n_tokens, ttft_s=0.01,
                   tpot_s=0.01, step_seconds=np.full(n_tokens - 1, 0.01))


def test_a_4096_token_run_stays_under_its_bound(qapp):
    store = RunStore()
    for ev in synthetic_run(4096):
        store.record(ev)
    run = store.runs[0]
    toks = run.tokens
    assert len(toks) == 4096 and run.finished is not None
    # Stated bound: full logits within LOGITS_BYTES (64 MiB), and at most 2 KiB of arrays a step for the rest (a
    # 20-candidate funnel, 31 residual norms, the Finished event's ids and times). Keeping every step's logits, as the
    # app did, is 4,096 × 192 KiB = 768 MiB.
    bound = LOGITS_BYTES + 4096 * 2048
    assert store.nbytes() <= bound, f"{store.nbytes() / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"
    kept = [t.logits is not None for t in toks]
    n = logits_steps(VOCAB)
    assert sum(kept) == n and all(kept[-n:]) and not any(kept[:-n])  # the newest steps keep them
    assert all(t.funnel is not None for t in toks)  # an older step keeps its funnel
    # the context of a step: the prompt's ids and the ids generated before it
    np.testing.assert_array_equal(run.context_ids(3), np.concatenate([run.prompt.ids, [t.token_id for t in toks[:3]]]))
    assert len(run.context_ids(4095)) == 32 + 4095


def test_runs_are_capped_and_the_shown_run_stays(qapp):
    store = RunStore()
    for ev in synthetic_run(4, seed=0):
        store.record(ev)
    first = store.runs[0].id
    store.expect_fork(first, 2, 7, "fork @ 2")
    for ev in synthetic_run(4, seed=1):
        store.record(ev)
    assert store.runs[1].parent == first and store.shown == store.runs[1].id
    for seed in range(2, MAX_RUNS + 4):
        for ev in synthetic_run(3, seed=seed):
            store.record(ev)
    assert len(store.runs) == MAX_RUNS
    assert store.run(first) is None and all(r.parent is None for r in store.runs)  # the fork's parent went
    assert store.shown == store.recording == store.runs[-1].id  # the newest run is shown
    assert [r.name for r in store.runs][-1] == f"run {MAX_RUNS + 3}"  # names go on counting
    # the runs that went took their arrays with them: the store holds the kept runs' events and no more (counted from
    # the events as generated, not from the store), and its count of logits bytes, which trims the oldest steps'
    # logits, is what the kept runs hold
    kept = range(MAX_RUNS + 4 - len(store.runs), MAX_RUNS + 4)  # the seeds of the newest runs (run s from seed s)
    assert [r.name for r in store.runs] == [f"run {s}" for s in kept]
    assert store.nbytes() == sum(run_store.nbytes(list(synthetic_run(3, seed=s))) for s in kept)
    assert store._logit_bytes == sum(t.logits.nbytes for r in store.runs for t in r.tokens if t.logits is not None)
    # an opened session with more runs than the cap keeps the newest, and the one it showed
    records = [{"name": f"r{i}", "events": list(synthetic_run(2, seed=i))} for i in range(MAX_RUNS + 3)]
    store.load(records, shown=1)
    assert len(store.runs) == MAX_RUNS and store.shown_run().name == "r1"
    assert [r.name for r in store.runs][1:] == [f"r{i}" for i in range(4, MAX_RUNS + 3)]


def test_the_context_of_a_step_rebuilds_the_funnel_the_engine_sampled(qtbot, window):
    """A repetition penalty: the funnel re-run from the store's context equals the engine's own at a late step."""
    params = SamplingParams(temperature=1.0, repetition_penalty=3.0, seed=0)
    window.bridge.set_params(params)
    generate(qtbot, window, text="the the the cat the the", n=8)
    store = window.run_store
    for t in store.shown_run().tokens:
        stages = funnel_stages(t.logits, params, store.context_ids(t.step))
        np.testing.assert_allclose(stages["p_temperature"][t.funnel.ids], t.funnel.p_temperature, rtol=1e-4,
                                   atol=1e-6)
    # without the context the numbers differ: the check above can fail
    last = store.shown_run().tokens[-1]
    plain = funnel_stages(last.logits, params, None)["p_temperature"][last.funnel.ids]
    assert np.abs(plain - last.funnel.p_temperature).max() > 1e-3
    # the sampling panel re-runs it with that context when a knob moves
    panel = window.panels["sampling"]
    panel._params = SamplingParams(temperature=1.0, repetition_penalty=3.0, top_k=5, seed=0)
    f = panel.current_funnel()
    np.testing.assert_allclose(f.p_temperature[: len(last.funnel.ids)][:5], last.funnel.p_temperature[:5], rtol=1e-4,
                               atol=1e-6)


def server_run():
    rng = np.random.default_rng(5)
    yield RunStarted(source=RunSource(kind="server", name="m @ host:1", cannot=("attention", "full_logits")))
    yield PromptTokenized(text="hi", ids=np.array([1, 2]), pieces=("h", "i"), offsets=np.zeros((2, 2), np.int64),
                          byte_offsets=np.zeros((2, 2), np.int64), special=np.zeros(2, bool))
    for step in range(3):
        yield RemoteTokenSampled(step=step, phase="prefill" if step == 0 else "decode", position=2 + step,
                                 token_id=int(rng.integers(0, VOCAB)), piece="t", text="t", seconds=0.0, cost=COST,
                                 funnel=funnel(rng, 5, TopNFunnel, top_n=5), arrival_s=0.1 * step, logprob=-0.5)
    yield Finished(reason="length", prompt_ids=np.array([1, 2]), ids=np.arange(3), text="ttt", ttft_s=0.1,
                   tpot_s=0.1)


def test_a_server_run_is_held_and_exported(qapp):
    store = RunStore()
    for ev in server_run():
        store.record(ev)
    run = store.runs[0]
    assert [type(t).__name__ for t in run.tokens] == ["RemoteTokenSampled"] * 3 and run.finished is not None
    rows = exports.funnel_rows(store.events())
    assert len(rows) == 15 and {r["step"] for r in rows} == {0, 1, 2}
    assert len(exports.timeline_rows(store.events())) == 3


def test_a_server_run_is_saved_and_read_back(qapp, tmp_path):
    store = RunStore()
    for ev in server_run():
        store.record(ev)
    path = tmp_path / "server.ilab"
    session_io.write(path, session_io.SavedSession(events=store.events(), prompt="hi"))
    back = load_session(path, with_tokenizer=False)
    toks = [e for e in back.events if isinstance(e, TokenSampled)]
    assert [type(t).__name__ for t in toks] == ["RemoteTokenSampled"] * 3
    assert isinstance(toks[0].funnel, TopNFunnel) and toks[0].funnel.top_n == 5


def test_a_session_saved_with_context_ids_still_opens(qtbot, window, tmp_path):
    """Files written before TokenSampled lost its context_ids field keep opening (the field is ignored)."""
    generate(qtbot, window, n=3)
    path, old = tmp_path / "new.ilab", tmp_path / "old.ilab"
    save_v1(path, session_io.current_session(window))  # as those files were written
    with zipfile.ZipFile(path) as z:
        files = {n: z.read(n) for n in z.namelist()}
    doc = json.loads(files["session.json"])
    n = 0
    for e in doc["events"]:
        if e.get("$type") == "TokenSampled":
            e["fields"]["context_ids"] = {"$tuple": [1, 2, 3]}
            n += 1
    assert n == 3
    files["session.json"] = json.dumps(doc).encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    old.write_bytes(buf.getvalue())
    assert session_io.open_session_from(window, old), window.last_error
    assert [t.token_id for t in window.run_store.shown_run().tokens] == [
        e.token_id for e in load_session(path).events if isinstance(e, TokenSampled)]


class SlowWriter:
    """Stands in for session_file.save_session: blocks until released, records the threads and overlaps."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[tuple[str, int]] = []  # (path, thread id)
        self.running = 0
        self.most = 0
        self.lock = threading.Lock()

    def __call__(self, path, session) -> None:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.calls.append((str(path), threading.get_ident(), session))
        try:
            assert self.release.wait(30)
            save_session(path, session)
        finally:
            with self.lock:
                self.running -= 1


def test_saving_runs_in_the_writer_thread_and_the_gui_goes_on(qtbot, window, tmp_path, monkeypatch):
    generate(qtbot, window, n=3)
    slow = SlowWriter()
    monkeypatch.setattr(session_io, "save_session", slow)
    path = tmp_path / "s.ilab"
    assert session_io.save_session_to(window, path, wait=False)
    qtbot.waitUntil(lambda: len(slow.calls) == 1, timeout=10_000)
    ticked = []
    from PySide6 import QtCore

    QtCore.QTimer.singleShot(10, lambda: ticked.append(1))
    qtbot.waitUntil(lambda: bool(ticked), timeout=5_000)  # the GUI thread runs its timers while the file is written
    assert not path.exists() and slow.calls[0][1] != threading.get_ident()
    assert "Saving" in window.message.text()
    slow.release.set()
    qtbot.waitUntil(lambda: "Session saved" in window.message.text(), timeout=30_000)
    assert len(load_session(path).events) == len(window.run_store.events())


def test_autosaves_coalesce_one_writer_at_a_time_and_a_clean_exit_waits(qtbot, make_window, monkeypatch):
    w = make_window()  # keeps settings: autosaves
    wait_loaded(qtbot, w)
    slow = SlowWriter()
    monkeypatch.setattr(session_io, "save_session", slow)
    generate(qtbot, w, n=2)  # its end asks for an autosave, which now waits in the writer
    qtbot.waitUntil(lambda: len(slow.calls) == 1, timeout=10_000)
    for _ in range(4):  # newer requests replace each other while the first is being written
        session_io.autosave(w)
    explicit = session_io.save_session_to(w, session_io.autosave_path().with_name("mine.ilab"), wait=False)
    assert explicit
    slow.release.set()
    w.session_writer.wait()
    kinds = [p for p, _t, _s in slow.calls]
    assert len(kinds) == 3 and kinds.count(str(session_io.autosave_path())) == 2 and slow.most == 1
    # a clean exit waits for the writer, drops an autosave not yet started, and removes the file
    slow.release.clear()
    session_io.autosave(w)
    qtbot.waitUntil(lambda: len(slow.calls) == 4, timeout=10_000)
    session_io.autosave(w)  # waiting behind the one being written: dropped by the exit
    threading.Timer(0.2, slow.release.set).start()
    w.close()
    assert len(slow.calls) == 4 and not w.session_writer.busy()
    assert not session_io.autosave_path().exists()


def test_a_runs_autosave_waits_for_the_windows_last_draws_and_a_clean_exit_drops_it(qtbot, make_window,
                                                                                    monkeypatch):
    """At a run's end the window draws first and the autosave starts AUTOSAVE_AFTER_MS later (its encoding, in this
    process, would take turns with the draws for the GIL); meanwhile the writer says it is busy, waiting for it writes
    it at once, and a clean exit drops it."""
    monkeypatch.setattr(session_io, "AUTOSAVE_AFTER_MS", 60_000)  # so it would not start by itself during the test
    w = make_window()  # keeps settings: autosaves
    wait_loaded(qtbot, w)
    auto = session_io.autosave_path()
    generate(qtbot, w, n=2)
    w.tick_panels(flush=True)
    assert w.session_writer.busy() and not auto.exists()  # asked for, not started: the draws came first
    w.session_writer.wait()
    assert not w.session_writer.busy() and len(load_session(auto).events) == len(w.run_store.events())
    auto.unlink()
    generate(qtbot, w, n=2)
    assert w.session_writer.busy()
    w.close()  # a clean exit: the autosave not yet started is dropped, the file stays away
    assert not w.session_writer.busy() and not auto.exists()


def test_the_tokenizer_is_serialised_once_per_model(qtbot, window, tmp_path, monkeypatch):
    generate(qtbot, window, n=2)
    window.session_writer.wait()  # the run's autosave has its tokenizer files before this test counts
    tok = window.bridge.tokenizer
    calls = []
    real = type(tok).save
    monkeypatch.setattr(type(tok), "save", lambda self, d: (calls.append(d), real(self, d))[1])
    monkeypatch.setattr(session_io, "_tok_cache", [None, None])
    cached = session_io._cached_tokenizer_files
    monkeypatch.setattr(session_io, "_cached_tokenizer_files", lambda _p: None)  # no engine cache…
    monkeypatch.setattr(session_io, "_files_from_child", lambda _p, _t: None)  # …nor a child's: serialised here
    for name in ("a.ilab", "b.ilab"):
        assert session_io.save_session_to(window, tmp_path / name), window.last_error
    assert len(calls) == 1
    # with the engine's tokenizer cache of the model file, its files are read, never serialised (which holds the GIL)
    from pathlib import Path

    from engine.tokenizer.load import tokenizer_cache_dir

    real(tok, tokenizer_cache_dir(Path(window.bridge.info.path)))
    monkeypatch.setattr(session_io, "_cached_tokenizer_files", cached)
    monkeypatch.setattr(session_io, "_tok_cache", [None, None])
    assert session_io.save_session_to(window, tmp_path / "c.ilab"), window.last_error
    assert len(calls) == 1
    for name in ("a.ilab", "b.ilab", "c.ilab"):
        back = load_session(tmp_path / name).tokenizer
        assert back.encode("the cat sat").ids == tok.encode("the cat sat").ids


def test_the_store_is_found_from_the_bridge(window):
    assert run_store.store_for(window.bridge) is window.run_store


def test_opening_a_long_session_honours_the_logits_cap(qapp):
    """RunStore.load used to append a run's events before the run was in the store, so the logits cap found no run
    to trim and kept every step's logits (here 600 × 192 KiB = 113 MiB)."""
    store = RunStore()
    store.load([{"name": "run 1", "events": list(synthetic_run(600))}])
    toks = store.runs[0].tokens
    kept = [t.logits is not None for t in toks]
    n = logits_steps(VOCAB)
    assert sum(kept) == n and all(kept[-n:])
    assert store.nbytes() <= LOGITS_BYTES + 600 * 2048


def test_a_fork_the_engine_refuses_does_not_name_the_next_run(qtbot, window):
    panel = window.panels["branches"]
    context = window.bridge.cfg.context_length
    generate(qtbot, window, n=context)  # runs until the context is full
    qtbot.waitUntil(lambda: window.bridge.state == "idle", timeout=10_000)
    run = window.run_store.runs[0]
    n = len(run.tokens)
    assert len(run.prompt.ids) + n >= context
    with qtbot.waitSignal(window.bridge.sig_failed, timeout=10_000) as failed:
        assert panel.fork(n, 1)  # its prefix fills the context: the engine refuses the request
    assert f"context holds {context}" in failed.args[0]
    qtbot.waitUntil(lambda: window.bridge.state == "idle", timeout=10_000)
    generate(qtbot, window, n=3)
    names = [r.name for r in window.run_store.runs]
    assert names == ["run 1", "run 2"] and window.run_store.runs[1].parent is None


def test_a_runs_autosave_starts_after_every_panel_has_drawn_the_runs_end(qtbot, make_window, monkeypatch):
    """A panel that drew during the run waits out its rate limit (up to a second) before it draws again, so the run's
    last draws came while the autosave's encoding ran and took turns with it for the GIL; at a run's end the panels
    now draw at once, and the autosave starts when none has anything left to draw."""
    from app.panels.base import Panel

    monkeypatch.setattr(Panel, "paint_budget", 1e-9)  # every draw looks costly: the next one a second later
    monkeypatch.setattr(session_io, "AUTOSAVE_AFTER_MS", 0)
    w = make_window()  # keeps settings: autosaves
    wait_loaded(qtbot, w)
    undrawn_at_autosave: list[list[str]] = []
    real = session_io.autosave
    monkeypatch.setattr(session_io, "autosave", lambda win: (
        undrawn_at_autosave.append([n for n, p in win.panels.items() if p.dirty]), real(win))[1])
    generate(qtbot, w, n=6)
    qtbot.waitUntil(lambda: bool(undrawn_at_autosave), timeout=10_000)
    assert undrawn_at_autosave == [[]]
    w.session_writer.wait()
    assert len(load_session(session_io.autosave_path()).events) == len(w.run_store.events())

"""Long runs (issue 26), the GUI's side: a session of thousands of events opens in slices of the event loop (with
progress, Esc cancels), the autosave of a long run reopens equal, version 1's arrays.npz holds more members than a
plain zip counts, and the Generation panel appends a token without repainting the paragraph it ends."""

from __future__ import annotations

import dataclasses
import io
import zipfile

import numpy as np
import pytest
from PySide6 import QtCore, QtWidgets
from PySide6.QtTest import QTest

from app import session_io
from engine.events import (
    AttentionCaptured,
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
from engine.protocol import SamplingParams
from engine.session_file import SavedSession, load_session, save_session
from tests.session_v1 import save_v1

pytestmark = pytest.mark.qt_log_ignore("This plugin does not support")  # offscreen
COST = StepCost(flops=1e6, weight_bytes=1e5, kv_read_bytes=1e3, kv_write_bytes=1e2)


def run_events(cfg, tokenizer, n_steps: int, n_prompt: int = 6, logits: bool = True) -> list:
    """A run as the engine sends it with every layer captured: RunStarted, the prompt, the prefill's attention, then
    per step each layer's attention row, the residual norms, the token (with its funnel) and the KV cache's size."""
    rng = np.random.default_rng(0)
    vocab, heads, layers = cfg.vocab_size, cfg.n_heads, cfg.n_layers
    ids = rng.integers(10, vocab, n_prompt)
    pieces = tuple(tokenizer.piece(int(i)) for i in ids)
    text = "".join(pieces)
    ends = np.cumsum([len(p) for p in pieces])
    offsets = np.stack([ends - [len(p) for p in pieces], ends], 1)
    out: list = [RunStarted(source=RunSource(kind="local", name="synthetic")),
                 PromptTokenized(text=text, ids=ids, pieces=pieces, offsets=offsets, byte_offsets=offsets.copy(),
                                 special=np.zeros(n_prompt, bool))]
    q = np.arange(n_prompt)[:, None]
    block = ((np.arange(n_prompt)[None, :] <= q) / (q + 1.0)).astype(np.float32)
    out += [AttentionCaptured(step=0, phase="prefill", layer=i, query_start=0,
                              weights=np.repeat(block[None], heads, 0), group_size=2) for i in range(layers)]
    out.append(PrefillDone(n_tokens=n_prompt, n_reused=0, seconds=0.01, cost=COST))
    generated = []
    for step in range(n_steps):
        pos = n_prompt + step
        if step:
            w = rng.random((heads, 1, pos), dtype=np.float32)
            w /= w.sum(-1, keepdims=True)
            out += [AttentionCaptured(step=step, phase="decode", layer=i, query_start=pos - 1, weights=w.copy(),
                                      group_size=2) for i in range(layers)]
        out.append(ResidualNorms(step=step, norms=rng.random(layers + 1, dtype=np.float32)))
        top = rng.choice(np.arange(10, vocab), 5, replace=False)
        p = np.sort(rng.random(5))[::-1] / 3
        f = Funnel(ids=top, pieces=tuple(tokenizer.piece(int(i)) for i in top), logits=p * 10, p_raw=p.copy(),
                   p_temperature=p.copy(), p_top_k=p.copy(), p_top_p=p.copy(), p_final=p.copy(), kept_top_k=5,
                   kept_top_p=5, kept_final=5, vocab_size=vocab, greedy=True)
        tid = int(top[0])
        generated.append(tid)
        piece = tokenizer.piece(tid)
        out.append(TokenSampled(step=step, phase="prefill" if step == 0 else "decode", position=pos, token_id=tid,
                                piece=piece, text=piece, seconds=0.01, cost=COST, funnel=f,
                                logits=rng.random(vocab, dtype=np.float32) if logits else None,
                                params=SamplingParams(temperature=0.0)))
        out.append(KVCacheGrew(step=step, n_tokens=pos + 1, bytes_used=(pos + 1) * 64, bytes_allocated=(pos + 1) * 64))
    out.append(Finished(reason="length", prompt_ids=ids, ids=np.array(generated), text="", ttft_s=0.01,
                        tpot_s=0.01, step_seconds=np.full(max(0, n_steps - 1), 0.01), total_s=0.01 * n_steps))
    return out


def assert_same_events(got: list, want: list) -> None:
    assert [type(e) for e in got] == [type(e) for e in want]
    for a, b in zip(got, want, strict=True):
        for f in dataclasses.fields(b):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if isinstance(y, np.ndarray):
                np.testing.assert_array_equal(x, y)
            elif dataclasses.is_dataclass(y):
                assert_same_events([x], [y])
            else:
                assert x == y, f.name


def test_a_long_session_opens_in_slices_with_progress_and_the_panels_agree_at_the_end(qtbot, window, tmp_path):
    w = window
    events = run_events(w.bridge.cfg, w.bridge.tokenizer, 1000)
    assert len(events) >= 5000
    path = tmp_path / "long.ilab"
    save_session(path, SavedSession(events=events, prompt=events[1].text, info=w.bridge.info, cfg=w.bridge.cfg,
                                    tokenizer=w.bridge.tokenizer))
    turns, progress = [0], []
    probe = QtCore.QTimer()
    probe.setInterval(0)

    def tick() -> None:
        turns[0] += 1
        job = w.replay_job
        if job is not None and job.active:
            progress.append((w.progress.isVisible(), w.progress.value(), w.message.text()))

    probe.timeout.connect(tick)
    probe.start()
    assert session_io.open_session_from(w, path, wait=False)
    qtbot.waitUntil(lambda: w.replay_job is not None and not w.replay_job.active, timeout=120_000)
    probe.stop()
    job = w.replay_job
    assert job.completed and job.reached >= len(events)
    # the work went in many slices, and the event loop turned between them (paints, input: the GUI answered)
    assert job.slices >= 5
    assert turns[0] >= job.slices - 1
    assert progress and all(visible for visible, _v, _m in progress)
    assert any("of" in m and "Esc" in m for _vis, _v, m in progress)
    values = [v for _vis, v, _m in progress]
    assert values == sorted(values) and values[-1] > values[0]
    assert not w.progress.isVisible()
    # every panel shows the whole run: the same tokens as the file, the store's run is the file's
    gen = w.panels["generation"]
    toks = [e.token_id for e in events if isinstance(e, TokenSampled)]
    assert [t.token_id for t in gen.tokens] == toks
    assert gen.finished is not None
    assert [t.token_id for t in w.run_store.shown_run().tokens] == toks
    assert w.last_error == ""


def test_escape_stops_a_replay_and_the_panels_show_the_run_up_to_there(qtbot, window, tmp_path):
    w = window
    events = run_events(w.bridge.cfg, w.bridge.tokenizer, 1000, logits=False)
    path = tmp_path / "long.ilab"
    save_session(path, SavedSession(events=events, prompt=events[1].text, info=w.bridge.info, cfg=w.bridge.cfg,
                                    tokenizer=w.bridge.tokenizer))
    assert session_io.open_session_from(w, path, wait=False)
    n_load = len(events)
    # let it reach the replay of the shown run, past the store's loading
    qtbot.waitUntil(lambda: w.replay_job is not None and w.replay_job.reached > n_load + 50, timeout=120_000)
    QTest.keyClick(w, QtCore.Qt.Key.Key_Escape)
    job = w.replay_job
    assert not job.active and not job.completed
    reached = job.reached - n_load
    assert 50 < reached < len(events)
    qtbot.wait(50)  # no slice runs after the cancel
    assert job.reached - n_load == reached
    assert "stopped at event" in w.message.text()
    sent = events[:reached]
    gen = w.panels["generation"]
    assert [t.token_id for t in gen.tokens] == [e.token_id for e in sent if isinstance(e, TokenSampled)]
    assert gen.finished is None and not w.progress.isVisible()


def test_a_branch_switch_replays_in_slices(qtbot, window, tmp_path):
    w = window
    events = run_events(w.bridge.cfg, w.bridge.tokenizer, 600, logits=False)
    short = run_events(w.bridge.cfg, w.bridge.tokenizer, 3, logits=False)
    w.run_store.load([{"name": "long", "events": events}, {"name": "short", "events": short}], shown=1)
    panel = w.panels["branches"]
    panel.show_branch(0)
    job = w.replay_job
    assert job is not None and job.active  # not done in one block
    qtbot.waitUntil(lambda: not job.active, timeout=120_000)
    assert job.completed and job.slices >= 2
    gen = w.panels["generation"]
    assert [t.token_id for t in gen.tokens] == [e.token_id for e in events if isinstance(e, TokenSampled)]


def test_the_autosave_of_a_long_run_reopens_equal(qtbot, window):
    w = window  # keeps settings: autosaves after every run
    writer = w.session_writer
    events = run_events(w.bridge.cfg, w.bridge.tokenizer, 400)
    for ev in events[:-1]:
        w.run_store.record(ev)
    writer.wait()
    w.run_store.record(events[-1])  # Finished: the autosave
    auto = session_io.autosave_path()
    qtbot.waitUntil(lambda: not writer.busy() and auto.is_file(), timeout=60_000)
    saved = load_session(auto)
    assert_same_events(saved.events, w.run_store.events())
    # and a second save of the same runs writes the same events
    again = auto.with_name("again.ilab")
    assert session_io.save_session_to(w, again)
    assert_same_events(load_session(again).events, saved.events)


def test_saving_a_long_run_leaves_the_windows_objects_out_of_the_collectors_walks(qtbot, window, tmp_path):
    """The writer's own objects start full collections while it saves; each full walk of every object the window
    holds kept the GIL from the GUI thread (BENCHMARKS.md, "The writer's collections"). Whatever existed when the
    save began is frozen, so a walk during the save sees only the objects made since."""
    import gc

    w = window
    w.run_store.load([{"name": "long", "events": run_events(w.bridge.cfg, w.bridge.tokenizer, 400)}])
    gc.unfreeze()
    before = len(gc.get_objects())
    walked: list[int] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            walked.append(len(gc.get_objects(generation=2)))

    gc.callbacks.append(on_gc)
    try:
        assert session_io.save_session_to(w, tmp_path / "long.ilab")
        gc.collect()  # a full collection, as the writer's allocations start them
    finally:
        gc.callbacks.remove(on_gc)
    assert gc.get_freeze_count() >= before * 0.9
    assert walked and max(walked) < before / 4
    assert_same_events(load_session(tmp_path / "long.ilab").events, w.run_store.events())


def test_an_opened_long_session_is_left_out_of_the_collectors_walks(qtbot, window, tmp_path):
    """The runs an open loads and the panels' copies of the shown one stay as long as the window shows them; a full
    collection after the open walks only what was made since, not the session (as age_heap does for a live run)."""
    import gc

    w = window
    events = run_events(w.bridge.cfg, w.bridge.tokenizer, 400)
    path = tmp_path / "long.ilab"
    save_session(path, SavedSession(events=events, prompt=events[1].text, info=w.bridge.info, cfg=w.bridge.cfg,
                                    tokenizer=w.bridge.tokenizer))
    del events
    gc.unfreeze()
    gc.collect()
    before = len(gc.get_objects())
    assert session_io.open_session_from(w, path)
    assert w.replay_job.completed
    walked: list[int] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            walked.append(len(gc.get_objects()))

    gc.callbacks.append(on_gc)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(on_gc)
    made = gc.get_freeze_count() - before  # the session's objects (and the window's, frozen with them)
    assert made > 2_000
    assert walked and walked[0] < made / 10
    assert len(w.run_store.shown_run().tokens) == 400


def test_arrays_npz_with_more_members_than_a_plain_zip_counts(tmp_path):
    """Version 1: past 65,535 arrays the end of arrays.npz is the zip64 record; numpy's own reader reads it too."""
    many = [np.full(i % 4, i, np.int32) for i in range(66_000)]
    path = tmp_path / "many.ilab"
    save_v1(path, SavedSession(events=[], settings={"many": many, "f": np.linspace(0, 1, 7)}))
    back = load_session(path, with_tokenizer=False)
    assert len(back.settings["many"]) == len(many)
    for a, b in zip(back.settings["many"], many, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(back.settings["f"], np.linspace(0, 1, 7))
    with zipfile.ZipFile(path) as z, np.load(io.BytesIO(z.read("arrays.npz")), allow_pickle=False) as npz:
        assert len(npz.files) == len(many) + 1
        by_value = {int(npz[k][0]) for k in npz.files if npz[k].dtype == np.int32 and npz[k].size}
        assert by_value == {i for i in range(66_000) if i % 4}


def render(view: QtWidgets.QWidget) -> bytes:
    img = view.grab().toImage()
    return bytes(img.constBits())


def test_the_generation_panel_appends_tokens_as_the_whole_render_would_draw_them(qtbot, bridge, tiny_lm):
    from app.panels.generation import GenerationPanel, _formats
    from app.token_view import Segments, TokenTextEdit, utf16_len
    from engine.protocol import Loaded

    tok = tiny_lm.tokenizer
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    panel = GenerationPanel(bridge)
    qtbot.addWidget(panel)
    panel.resize(700, 500)
    panel.show()
    events = run_events(tiny_lm.cfg, tok, 300, logits=False)
    prompt = events[1]
    panel._on_prompt(prompt)
    panel._on_prefill(next(e for e in events if isinstance(e, PrefillDone)))
    panel.draw()
    calls = []
    hl = panel.output.highlighter
    real = hl.setFormat
    hl.setFormat = lambda *a: (calls.append(a), real(*a))[1]
    tokens = [e for e in events if isinstance(e, TokenSampled)]
    per_draw = []
    for i, t in enumerate(tokens):
        panel._on_token(t)
        if i % 7 == 6 or i == len(tokens) - 1:
            calls.clear()
            panel.draw()
            per_draw.append(len(calls))
    # one paragraph of 300 tokens: a draw paints at most the prompt's segments again, never the tokens before
    assert max(per_draw) <= len(prompt.ids)
    panel._on_step_selected(137)
    panel.draw()

    # the old whole render: every segment in the highlighter, the text set at once
    ref = TokenTextEdit(read_only=True)
    qtbot.addWidget(ref)
    ref.set_formats(_formats())
    seg, kinds = panel._prompt_segments(True)
    starts, ends, toks = list(seg.starts), list(seg.ends), list(seg.tokens)
    pos, n = utf16_len(prompt.text), len(prompt.ids)
    for i, t in enumerate(panel.tokens):
        m = utf16_len(t.shown)
        starts.append(pos)
        ends.append(pos + m)
        toks.append((n + i,))
        kinds.append(panel._token_kind(t, i))
        pos += m
    ref.highlighter.set_segments(Segments(starts, ends, toks, [()] * len(starts)), kinds, rehighlight=False)
    ref.setPlainText(prompt.text + "".join(t.shown for t in panel.tokens))
    assert ref.toPlainText() == panel.output.toPlainText()
    assert ref.highlighter.starts == hl.starts and ref.highlighter.tokens == hl.tokens
    ref.setExtraSelections(panel.output.extraSelections())
    ref.resize(panel.output.size())
    ref.show()
    for view in (ref, panel.output):
        view.verticalScrollBar().setValue(0)
    qtbot.wait(20)
    assert render(ref) == render(panel.output)
    ref.verticalScrollBar().setValue(ref.verticalScrollBar().maximum())
    panel.output.verticalScrollBar().setValue(panel.output.verticalScrollBar().maximum())
    qtbot.wait(20)
    assert render(ref) == render(panel.output)

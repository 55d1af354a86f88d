"""Long runs (issue 26): the app's memory does not grow with the square of the run. A run's attention is kept within
a byte budget (app.run_store), the Attention panel holds one layer within its own, and both say which steps they
hold. The shapes are SmolLM2-135M's (30 layers, 9 heads), the model the app starts with."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

from app import run_store
from app.run_store import ATTENTION_BYTES, ATTENTION_HEAD, RunStore
from engine.events import AttentionCaptured, LensCaptured, PromptTokenized, RunSource, RunStarted
from engine.protocol import Loaded

LAYERS, HEADS = 30, 9
N_PROMPT = 8


def prompt(n: int = N_PROMPT) -> PromptTokenized:
    return PromptTokenized(text="p" * n, ids=np.arange(n), pieces=("p",) * n, offsets=np.zeros((n, 2), np.int64),
                           byte_offsets=np.zeros((n, 2), np.int64), special=np.zeros(n, bool))


def attention_run(n_steps: int, layers: int = LAYERS, heads: int = HEADS):
    """A run's attention as the engine sends it with every layer captured: the prefill's (heads, P, P) block, then
    one (heads, 1, position + 1) row per layer and decode step. Each row is uniform over the keys it may read
    (views of one buffer: the test itself stays small, what the store keeps is its own)."""
    yield RunStarted(source=RunSource(kind="local", name="synthetic"))
    yield prompt()
    q = np.arange(N_PROMPT)[:, None]
    block = (np.arange(N_PROMPT)[None, :] <= q) / (q + 1.0)
    block = np.broadcast_to(block.astype(np.float32), (heads, N_PROMPT, N_PROMPT))
    for layer in range(layers):
        yield AttentionCaptured(step=0, phase="prefill", layer=layer, query_start=0, weights=block, group_size=3)
    buf = np.empty((heads, 1, N_PROMPT + n_steps), np.float32)
    for step in range(1, n_steps):
        pos = N_PROMPT + step - 1  # the token sampled at the step before is this step's query
        buf[:, :, : pos + 1] = 1.0 / (pos + 1)
        for layer in range(layers):
            yield AttentionCaptured(step=step, phase="decode", layer=layer, query_start=pos,
                                    weights=buf[:, :, : pos + 1], group_size=3)


def test_a_long_run_keeps_its_attention_within_the_budget_first_and_newest_steps(qapp):
    n = 2500  # every layer of a 2,500-token run: 9 × 30 × 2,500² / 2 weights, 3.2 GB as float32
    store = RunStore()
    full = 0
    for ev in attention_run(n):
        store.record(ev)
        if isinstance(ev, AttentionCaptured):
            full += ev.weights.nbytes
    assert full > 3e9
    run = store.runs[0]
    assert store.nbytes() <= ATTENTION_BYTES, f"{store.nbytes() / 2**20:.0f} MiB"
    held = sorted({e.step for e in run.events if isinstance(e, AttentionCaptured)})
    # the first steps (the prefill and the start, up to 1/ATTENTION_HEAD of the budget) and the newest steps stay;
    # the oldest steps between them went, as one range
    assert held[0] == 0 and held[-1] == n - 1
    gap = [b for a, b in zip(held, held[1:], strict=False) if b != a + 1]
    assert len(gap) == 1
    lo, hi = run.dropped
    assert held == [s for s in range(n) if not lo <= s <= hi]
    first_bytes = sum(e.weights.nbytes for e in run.events if isinstance(e, AttentionCaptured) and e.step < lo)
    assert ATTENTION_BYTES // ATTENTION_HEAD // 2 < first_bytes <= ATTENTION_BYTES // ATTENTION_HEAD + 30 * 9 * 2 * n
    # every layer of a held step is there, as sent
    newest = [e for e in run.events if isinstance(e, AttentionCaptured) and e.step == n - 1]
    assert sorted(e.layer for e in newest) == list(range(LAYERS))
    np.testing.assert_array_equal(newest[0].weights, 1.0 / np.float32(N_PROMPT + n - 1))
    note = run.attention_note()
    assert f"steps 0–{lo - 1:,} and {hi + 1:,}–{n - 1:,}" in note and f"{lo:,}–{hi:,} were dropped" in note
    # what a session would save: the held events only
    assert len(store.events()) == sum(e is not None for e in run.events) < len(run.events)


def test_the_attention_panel_holds_one_layer_and_says_which_steps_are_kept(qtbot, bridge, tiny_lm, monkeypatch):
    from app.panels import attention

    monkeypatch.setattr(run_store, "ATTENTION_BYTES", 4 << 20)  # a small budget, so a short test reaches it
    monkeypatch.setattr(attention, "MATRIX_BYTES", 1 << 20)
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    store = RunStore(bridge)
    panel = attention.PANEL(bridge)
    qtbot.addWidget(panel)
    panel.resize(700, 450)
    panel.show()
    layers, n = tiny_lm.cfg.n_layers, 600
    shown = layers - 1
    panel.layer_spin.setValue(shown)
    for ev in attention_run(n, layers=layers):
        bridge.replay(ev)
    panel.flush()
    run = store.runs[0]
    assert run.dropped is not None and store.nbytes() <= 4 << 20
    am = panel._matrices[shown]
    assert list(panel._matrices) == [shown] and am.nbytes <= 2 << 20  # one layer: its budget and one spare of it
    m = panel.matrix()
    s = N_PROMPT + n - 1
    assert m.shape[2] == s and 0 < m.shape[1] < s and panel.first_row() == s - m.shape[1]
    np.testing.assert_allclose(np.nansum(m[:, -1], -1), 1.0, rtol=1e-5)  # the newest row, at its real position
    assert panel.image.image.shape == m.shape[1:]
    text = panel.status.text()
    assert f"the newest {m.shape[1]:,} query rows are shown" in text
    assert run.attention_note() in text and "were dropped to bound memory" in text

    # another layer comes from the store: the steps it holds, at their rows; the dropped ones are not drawn
    panel.layer_spin.setValue(0)
    panel.flush()
    lo, hi = run.dropped
    m1 = panel.matrix()
    r0 = panel.first_row()
    assert m1 is not None and m1.shape[2] == s
    rows_of = {step: N_PROMPT + step - 1 for step in range(1, n)}
    for step in (lo, hi, n - 1):
        r = rows_of[step] - r0
        if 0 <= r < m1.shape[1]:
            assert np.isnan(m1[0, r]).all() == (lo <= step <= hi)
    assert run.attention_note() in panel.status.text()


def test_the_lens_panel_bounds_its_steps_and_says_so(qtbot, bridge, tiny_lm):
    from app.panels import lens

    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    panel = lens.PANEL(bridge)
    qtbot.addWidget(panel)
    bridge.replay(prompt())
    rows, n_steps = tiny_lm.cfg.n_layers + 2, 3000
    for step in range(n_steps):
        bridge.replay(LensCaptured(step=step, position=N_PROMPT + step, ids=np.zeros((rows, 5), np.int64),
                                   probs=np.full((rows, 5), 0.2, np.float32), entropy_bits=np.ones(rows, np.float32)))
    assert len(panel.lens) == lens.LENS_STEPS
    assert min(panel.lens) == 0 and max(panel.lens) == n_steps - 1
    bridge.select_step(lens.LENS_FIRST + 10)
    panel.flush()
    assert f"No lens is held for step {lens.LENS_FIRST + 10}" in panel.header.text()
    assert "let go to bound memory" in panel.header.text()


def test_the_branches_text_grows_by_appending_and_reads_as_the_whole_page(qtbot, bridge, tiny_lm):
    """Token by token the Branches panel appends to its text; what it shows equals the page drawn whole, with each
    token an anchor to its step in its confidence colour."""
    from app.panels import branches
    from tests.app.test_run_store import synthetic_run

    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    store = RunStore(bridge)
    panel = branches.PANEL(bridge)
    qtbot.addWidget(panel)
    panel.attach_store(store)
    for i, ev in enumerate(synthetic_run(120)):
        bridge.replay(ev)
        if i % 7 == 0:
            panel.flush()
    panel.flush()
    run = store.runs[0]
    assert panel._page_tokens == run.n_tokens == 120
    whole = branches.QtWidgets.QTextBrowser()
    whole.setHtml(branches.branch_html(run, "prob", tiny_lm.tokenizer))
    assert panel.view.toPlainText() == whole.toPlainText()
    doc = panel.view.document()
    block = doc.lastBlock()
    frags = []
    it = block.begin()
    while not it.atEnd():
        frags.append(it.fragment())
        it += 1
    last = frags[-1].charFormat()
    t = run.tokens[-1]
    assert last.anchorHref() == f"step:{t.step}"
    assert last.background().color().name() == branches.token_look(t, "prob", tiny_lm.tokenizer)[1]


def test_attention_exports_of_a_long_run_stream_every_weight(qtbot, tmp_path):
    """The attention export writes every captured weight of the layer, one event at a time, in CSV and JSON."""
    import csv
    import json

    from app import exports

    events = [e for e in attention_run(40, layers=2, heads=3) if isinstance(e, AttentionCaptured)]
    want = {(e.step, h, e.query_start + q, k): float(e.weights[h, q, k]) for e in events if e.layer == 1
            for h, q, k in zip(*np.nonzero(e.weights > 0), strict=True)}
    for ext in (".csv", ".json"):
        path = tmp_path / f"attention{ext}"
        exports.write_attention(path, events, layer=1)
        if ext == ".csv":
            with open(path, newline="") as fh:
                rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(fh)]
        else:
            rows = json.loads(path.read_text())
        got = {(int(r["step"]), int(r["head"]), int(r["query"]), int(r["key"])): r["weight"] for r in rows}
        assert got.keys() == want.keys() and len(rows) == len(want)
        assert all(abs(got[k] - v) <= 1e-7 * v for k, v in want.items())


def test_a_saved_long_run_says_which_steps_it_holds_when_reopened(qapp, tmp_path, monkeypatch):
    from engine.session_file import SavedSession, load_session, save_session

    monkeypatch.setattr(run_store, "ATTENTION_BYTES", 1 << 20)
    store = RunStore()
    for ev in attention_run(300, layers=2, heads=3):
        store.record(ev)
    run = store.runs[0]
    assert run.dropped is not None
    held = sorted({e.step for e in run.events if isinstance(e, AttentionCaptured)})
    # one run: the file's `dropped`; several: each branch's
    one, many = tmp_path / "one.ilab", tmp_path / "many.ilab"
    save_session(one, SavedSession(events=store.events(), dropped=list(run.dropped)))
    save_session(many, SavedSession(events=store.events(), branches=store.records()))
    saved = load_session(one, with_tokenizer=False)
    assert saved.dropped == list(run.dropped) and not saved.branches
    for records in ([{"name": "run 1", "events": saved.events, "dropped": saved.dropped}],
                    load_session(many, with_tokenizer=False).branches):
        opened = RunStore()
        opened.load(records)
        again = opened.runs[0]
        assert again.dropped == run.dropped and again.attention_note() == run.attention_note()
        assert sorted({e.step for e in again.events if isinstance(e, AttentionCaptured)}) == held
    # the events and their branch share their arrays: each is stored once, in the packs and in version 1's npz
    weights = {id(e.weights): e.weights for e in run.events if isinstance(e, AttentionCaptured)}
    prompt_ev = next(e for e in store.events() if isinstance(e, PromptTokenized))
    prompt_bytes = sum(a.nbytes for a in (prompt_ev.ids, prompt_ev.offsets, prompt_ev.byte_offsets, prompt_ev.special))
    with zipfile.ZipFile(many) as z:
        packs = [n for n in z.namelist() if n.startswith("arrays/")]
        stored = sum(z.getinfo(n).file_size - 128 for n in packs)  # each pack: a 128-byte .npy header, its values
        assert stored == sum(w.nbytes for w in weights.values()) + prompt_bytes


def test_a_session_whose_dropped_steps_are_not_a_range_is_refused(tmp_path):
    import json as json_mod

    from engine.session_file import SavedSession, SessionFileError, load_session, save_session

    path = tmp_path / "s.ilab"
    save_session(path, SavedSession(events=[prompt()], dropped=[5, 9]))
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    doc = json_mod.loads(members["session.json"])
    for bad in ([9, 5], [1], "all", [-1, 3]):
        doc["dropped"] = bad
        members["session.json"] = json_mod.dumps(doc).encode()
        with zipfile.ZipFile(path, "w") as z:
            for n, data in members.items():
                z.writestr(n, data)
        with pytest.raises(SessionFileError, match="dropped"):
            load_session(path, with_tokenizer=False)


def test_the_long_run_benchmark_runs_end_to_end(tiny_dir):
    """benchmarks/longrun.py in a subprocess, a few tokens of the tiny model: one JSON line with its figures."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), QT_QPA_PLATFORM="offscreen")
    r = subprocess.run([sys.executable, "-m", "benchmarks.longrun", "--tokens", "20", "--after", "1", "--model",
                        str(tiny_dir.gguf)], capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["tokens"] == 20 and d["kv_cache_allocated_mib"] > 0
    assert len(d["stall_p99_ms_per_tenth"]) == 10 and d["stall_max_ms"] >= max(d["stall_max_ms_per_tenth"])
    assert d["tpot_ms_first_tenth"] > 0 and d["tpot_last_over_first"] > 0
    assert d["gui_rss_start_mib"] > 0 and d["engine_rss_start_mib"] > 0


def test_older_runs_give_up_their_attention_first_across_the_store(qapp, monkeypatch):
    monkeypatch.setattr(run_store, "ATTENTION_BYTES", 1 << 20)
    monkeypatch.setattr(run_store, "ATTENTION_TOTAL", 3 << 19)  # one and a half runs' budgets
    store = RunStore()
    for _ in range(3):
        for ev in attention_run(300, layers=2, heads=3):
            store.record(ev)
    old, middle, newest = store.runs
    assert store._capture_bytes == sum(r.capture_bytes for r in store.runs) <= 3 << 19
    assert newest.capture_bytes > (1 << 20) * 0.9  # the run being recorded keeps its whole budget
    assert old.capture_bytes == 0 and old.dropped == (0, 299)
    assert old.attention_note().startswith("this run holds no step's attention or lens: steps 0–299 were dropped")
    assert 0 < middle.capture_bytes < 1 << 20


@pytest.mark.parametrize("n", [40, 400])
def test_a_run_whose_unshown_layers_came_at_its_end_is_held_as_if_they_had_come_live(qapp, monkeypatch, n):
    """Issue 50: the engine sends a step's shown layer with the step and the layers captured for the record once, at
    the run's end (engine.server.ForTheRecord). The store then holds what it held when every layer came live: the
    same captures of the same steps, the same dropped range, under a budget the run exceeds or not."""
    from engine.events import Finished
    from engine.server import ForTheRecord

    monkeypatch.setattr(run_store, "ATTENTION_BYTES", 4 << 20)
    live, routed = RunStore(), RunStore()
    record = ForTheRecord(frozenset({LAYERS - 1}), every_layer_below=1 << 20)
    end = Finished(reason="length", prompt_ids=np.arange(N_PROMPT), ids=np.arange(n), text="", ttft_s=0.0,
                   tpot_s=0.0, step_seconds=np.zeros(0), total_s=0.0)
    for ev in attention_run(n):
        live.record(ev)
        for sent in record.route([ev]):
            routed.record(sent)
    held = record.end()
    assert (len(held) > 1) == (n == 400)  # a large record comes in several messages
    for sent in [*held, end]:
        routed.record(sent)
    live.record(end)

    def held(store):
        run = store.runs[0]
        return sorted((e.step, e.layer) for e in run.events if isinstance(e, AttentionCaptured)), run.dropped, \
            [s for s, _w in run._first]

    assert held(routed) == held(live)
    assert (held(live)[1] is not None) == (n == 400)  # the long one went past the budget
    assert routed.nbytes() == live.nbytes() <= 4 << 20

"""The kernel mode (engine.model.kernel_cache.KERNEL_MODES) in the app: chosen in the Engine menu and the model picker,
remembered, sent with every load; the mode a run ran in named wherever its numbers are (the status bar, the
roofline's caption, whose analytic decode point is priced at the bytes the kernels read as its measured steps are,
and the timeline's header), a reopened session's included; the Why panel's compare offers the other mode."""

from __future__ import annotations

import dataclasses

import pytest

from app import session_io
from app.units import fmt_bytes
from engine import protocol as P
from engine.events import TokenSampled
from engine.run.sampling import SamplingParams
from engine.run.session import Session
from engine.session_file import SavedSession, save_session
from tests.engine.test_session_file_kernels import info_fields, rewrite

N_NEW = 5
FAST_SHARE = 0.3  # a fast-mode model's decode step reads about this share of the float weights' bytes (int4 forms)


@pytest.fixture(scope="module")
def tiny_run(tiny_lm):
    """One real generation on the tiny model (exact mode: the only one a tiny random model's float file has)."""
    gen = Session(tiny_lm).generate("the cat sat on the mat", SamplingParams(temperature=0.0), max_new_tokens=N_NEW,
                                    ignore_eos=True)
    return list(gen)


def ran_in(mode: str, tiny_lm, run: list) -> tuple:
    """The tiny model's facts and run as the engine reports them in `mode`: in fast mode its decode steps read
    fewer weight bytes (ModelInfo.decode_weight_bytes, and each step's cost)."""
    info = tiny_lm.info
    if mode == "exact":
        return dataclasses.replace(info, kernels="exact"), run
    read = round(FAST_SHARE * info.decode_weight_bytes)
    fast = dataclasses.replace(info, kernels=mode, decode_weight_bytes=read)
    steps = [dataclasses.replace(e, cost=dataclasses.replace(e.cost, weight_bytes=float(read)))
             if isinstance(e, TokenSampled) and e.phase == "decode" else e for e in run]
    return fast, steps


def show(w, info, tiny_lm, events=()) -> None:
    """The window told that `info`'s model is loaded, then its run's events, as the engine would send them."""
    w.bridge.replay(P.Loaded(info, tiny_lm.tokenizer, tiny_lm.cfg))
    for ev in events:
        w.bridge.replay(ev)
    w.tick_panels(flush=True)


def quiet_window(make_window):
    w = make_window(persist=False, load=False)
    w.panels["roofline"].auto_measure = False
    w.panels["roofline"].select_hardware("h100-sxm")  # roofs to draw against, measured nowhere
    return w


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_the_mode_a_run_ran_in_is_named_wherever_its_numbers_are(qtbot, make_window, tiny_lm, tiny_run, mode):
    info, run = ran_in(mode, tiny_lm, tiny_run)
    w = quiet_window(make_window)
    show(w, info, tiny_lm)
    assert w.model_label.text().endswith(f"· {info.dtype} · {mode} kernels on {info.device}")
    roof, timeline = w.panels["roofline"], w.panels["timeline"]
    assert roof.kernels_label.text() == f"{mode} kernels" and roof.kernels_label.isVisibleTo(roof)
    # before any step: the analytic decode point reads what the model's kernels read
    assert roof.analytic_costs()["decode"].weight_bytes == info.decode_weight_bytes
    assert f"({info.dtype} · {mode} kernels)" in roof.takeaway.text()

    for ev in run:
        w.bridge.replay(ev)
    w.tick_panels(flush=True)
    last = [e for e in run if isinstance(e, TokenSampled) and e.phase == "decode"][-1]
    analytic, (measured_intensity, _flops) = roof.analytic_costs()["decode"], roof.measured_points()["decode"]
    assert analytic.weight_bytes == last.cost.weight_bytes  # one figure for both
    assert analytic.intensity == pytest.approx(measured_intensity)  # the latest step sits on its analytic point
    caption = roof.takeaway.text()
    assert f"({info.dtype} · {mode} kernels)" in caption
    assert f"{fmt_bytes(last.cost.weight_bytes)} of weights" in caption
    assert f"{info.dtype} · {mode} kernels on {info.device}" in timeline.stats_text()
    assert f"with {mode} kernels" in timeline.help_text and f"with {mode} kernels" in roof.help_text


def test_another_dtype_on_the_roofline_prices_every_weight_and_says_what_ran(qtbot, make_window, tiny_lm, tiny_run):
    info, run = ran_in("fast", tiny_lm, tiny_run)
    w = quiet_window(make_window)
    show(w, info, tiny_lm, run)
    roof = w.panels["roofline"]
    roof.dtype_combo.setCurrentText("bf16")  # a what-if, not what ran: every weight at bf16
    roof.flush()
    assert roof.analytic_costs()["decode"].weight_bytes != info.decode_weight_bytes
    assert f"at bf16 weights (it ran {info.dtype} · fast kernels)" in roof.takeaway.text()


def test_the_engine_menu_choice_is_sent_with_every_load_and_remembered(qtbot, make_window, tiny_lm):
    w = make_window(load=False)
    assert w.kernels == "exact" and w.kernels_group.checkedAction().data() == "exact"  # the default
    actions = {a.data(): a for a in w.kernels_group.actions()}
    assert set(actions) == {"exact", "file", "fast"}
    assert all(a.toolTip().startswith(f"{m}: ") for m, a in actions.items())  # KERNEL_MODES' sentence
    sent = []
    w.bridge._post = sent.append  # what would go to the engine process
    actions["fast"].trigger()
    assert not [c for c in sent if isinstance(c, P.Load)]  # no model loaded: nothing to reload
    w.load_model()
    (load,) = [c for c in sent if isinstance(c, P.Load)]
    assert load.kernels == "fast"

    w2 = make_window(load=False)  # a later start
    assert w2.kernels == "fast" and w2.kernels_group.checkedAction().data() == "fast"


def test_changing_the_mode_of_a_loaded_model_loads_it_again_in_that_mode(qtbot, make_window, tiny_lm):
    w = make_window(load=False)
    w.panels["roofline"].auto_measure = False
    show(w, dataclasses.replace(tiny_lm.info, kernels="exact"), tiny_lm)
    sent = []
    w.bridge._post = sent.append
    next(a for a in w.kernels_group.actions() if a.data() == "file").trigger()
    assert [c.kernels for c in sent if isinstance(c, P.Load)] == ["file"]
    w.set_kernels("file")  # the mode it is being loaded in already: nothing more
    assert len([c for c in sent if isinstance(c, P.Load)]) == 1
    w.bridge.load_on_torch()  # a reload after a crash keeps the mode too
    assert [c.kernels for c in sent if isinstance(c, P.Load)] == ["file", "file"]


def test_the_model_picker_offers_the_mode(qtbot):
    from app.model_picker import ModelPicker

    picker = ModelPicker(kernels="fast", find=list, memory=1 << 30)
    qtbot.addWidget(picker)
    assert picker.kernels() == "fast"
    picker.kernels_combo.setCurrentIndex(picker.kernels_combo.findData("file"))
    assert picker.kernels() == "file"


def test_a_reopened_session_names_the_mode_it_ran_in(qtbot, make_window, tiny_lm, tiny_run, tmp_path):
    """The same model loaded in another mode: the session's own mode is shown, not the loaded one's; a session
    saved before the mode was recorded says so."""
    info, run = ran_in("fast", tiny_lm, tiny_run)
    save_session(tmp_path / "fast.ilab", SavedSession(events=run, prompt="the cat sat on the mat", info=info,
                                                      cfg=tiny_lm.cfg, tokenizer=tiny_lm.tokenizer))
    w = quiet_window(make_window)
    show(w, dataclasses.replace(tiny_lm.info, kernels="exact"), tiny_lm)
    assert "exact kernels" in w.model_label.text()
    assert session_io.open_session_from(w, tmp_path / "fast.ilab"), w.last_error
    w.tick_panels(flush=True)
    assert w.model_label.text().endswith(f"{info.dtype} · fast kernels on {info.device}")
    assert "fast kernels" in w.panels["timeline"].stats_text()
    assert "fast kernels" in w.panels["roofline"].takeaway.text()
    assert w.bridge.info.kernels == "exact"  # the loaded model stays for the next generation

    old = rewrite(tmp_path / "fast.ilab", lambda d: info_fields(d).pop("kernels"))
    assert session_io.open_session_from(w, old), w.last_error
    w.tick_panels(flush=True)
    assert "kernels: not recorded" in w.model_label.text()
    assert "kernels: not recorded" in w.panels["timeline"].stats_text()


def test_the_why_compare_offers_the_other_mode(qtbot, make_window, tiny_lm):
    w = make_window(persist=False, load=False)
    w.panels["roofline"].auto_measure = False
    why = w.panels["why"]
    show(w, dataclasses.replace(tiny_lm.info, kernels="exact"), tiny_lm)
    assert why.other_kernels.currentData() == "fast"  # one click shows what the fast kernels cost
    why.set_mode("compare")
    why.other_edit.setText(tiny_lm.info.path)
    assert why.params().kernels == "fast"
    show(w, dataclasses.replace(tiny_lm.info, kernels="fast"), tiny_lm)
    assert why.params().kernels == "exact"

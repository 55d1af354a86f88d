"""Each lab's end reaches its panel as typed data: the engine's LabDone (done, cancelled, failed, unsupported) goes
through the bridge's routing table to the lab's sig_…_done, and the panel keeps its outcome and says its sentence —
no panel reads the words of a message to learn how a lab ended."""

from __future__ import annotations

import pytest
from PySide6 import QtGui

from app.panels import batching, load_lab, scheduling, speculative
from engine import protocol as P
from engine.protocol import LabDone

PANELS = {"batch": batching, "spec": speculative, "sched": scheduling, "serve": load_lab}
SIGNALS = {"batch": "sig_batch_done", "spec": "sig_spec_done", "sched": "sig_sched_done", "serve": "sig_serve_done"}


def panels_on(qtbot, bridge) -> dict:
    out = {}
    for job, module in PANELS.items():
        panel = module.PANEL(bridge)
        qtbot.addWidget(panel)
        panel.resize(700, 450)
        panel.show()
        out[job] = panel
    return out


def shown(job: str, panel) -> str:
    """What the panel says of the run's end, as the user reads it."""
    panel.flush()
    if job == "spec":  # rich text: as the label shows it
        doc = QtGui.QTextDocument()
        doc.setHtml(panel.summary.text())
        return doc.toPlainText()
    if job == "serve":
        return panel.status_label.text()
    if job == "batch":
        return f"{panel.summary.text()} {panel.progress.format()}"
    return panel.summary.text()


def test_each_outcome_reaches_each_labs_panel_as_typed_data(qtbot, bridge):
    panels = panels_on(qtbot, bridge)
    sentence = {"failed": "the lab broke in a way worth one sentence",
                "unsupported": "this runtime cannot run that lab: load the model with the torch backend"}
    for job, panel in panels.items():
        for outcome in ("done", "cancelled", "failed", "unsupported"):
            panel.running = True  # a run in flight: its end is what arrives
            done = LabDone(job, outcome, sentence.get(outcome, ""))
            with qtbot.waitSignal(getattr(bridge, SIGNALS[job]), timeout=5_000) as got:
                bridge.replay(done)  # through the bridge's one routing table, as a message from the engine
            assert got.args == [done] and isinstance(got.args[0], LabDone)
            assert panel.outcome == outcome and not panel.running, (job, outcome)
            text = shown(job, panel)
            if outcome in sentence:
                assert sentence[outcome] in text, (job, outcome, text)
            if outcome == "cancelled":
                assert "cancelled" in text.lower(), (job, text)
            if outcome != "failed":
                assert "failed" not in text.lower(), (job, outcome, text)


def test_the_engine_process_ends_every_lab_with_a_lab_done(qtbot, bridge):
    """No model loaded: the real engine process answers each lab with its typed refusal; the bridge forgets the job
    (an engine death afterwards reports nothing for it) and the panel shows the one sentence."""
    panels = panels_on(qtbot, bridge)
    for job, lab in (("batch", P.BatchBench((1,), 4, 2)), ("spec", P.Speculate("the cat")),
                     ("sched", P.Schedule(scheduling.SchedConfig())), ("serve", P.ServeBench({}))):
        panels[job].running = True
        with qtbot.waitSignal(getattr(bridge, SIGNALS[job]), timeout=60_000) as got:
            bridge.run_lab(lab)
        done = got.args[0]
        assert (done.job, done.outcome) == (job, "failed") and job not in bridge._jobs
        assert panels[job].outcome == "failed" and done.message in shown(job, panels[job])


def test_the_load_lab_on_the_local_model_is_unsupported_in_one_sentence(qtbot, bridge, tiny_dir):
    panel = panels_on(qtbot, bridge)["serve"]
    with qtbot.waitSignal(bridge.sig_model_loaded, timeout=60_000):
        bridge.load_model(str(tiny_dir.gguf), "cpu", "float32", backend="torch")
    panel.running = True
    with qtbot.waitSignal(bridge.sig_serve_done, timeout=60_000) as got:
        bridge.run_serve_bench({"concurrency": [1], "num_prompts": 1})
    assert got.args[0].outcome == "unsupported" and panel.outcome == "unsupported"
    assert "the load lab measures a server: connect to one first" in shown("serve", panel)


@pytest.mark.slow
def test_early_exit_on_llamacpp_is_unsupported_in_the_speculative_panel(qtbot, bridge, tiny_dir):
    from tests.requires import import_required

    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    panel = panels_on(qtbot, bridge)["spec"]
    with qtbot.waitSignal(bridge.sig_model_loaded, timeout=60_000):
        bridge.load_model(str(tiny_dir.gguf), "cpu", "float32", backend="llama.cpp")
    panel.prompt_edit.setPlainText("the cat sat")
    panel.tokens_spin.setValue(4)
    panel.source_combo.setCurrentIndex(panel.source_combo.findData("early-exit"))
    with qtbot.waitSignal(bridge.sig_spec_done, timeout=60_000) as got:
        assert panel.run()
    assert got.args[0].outcome == "unsupported" and panel.outcome == "unsupported"
    assert not panel.running and panel.run_button.isEnabled()
    text = shown("spec", panel)
    assert text.startswith("early-exit drafting needs a runtime that can stop after some of its layers")
    assert "\n" not in text


def test_an_engine_that_dies_mid_lab_ends_the_lab_as_failed(qtbot, bridge, tiny_dir):
    """The engine killed while the batching lab runs: the panel gets a LabDone saying it failed, and why."""
    import os
    import signal

    panel = panels_on(qtbot, bridge)["batch"]
    with qtbot.waitSignal(bridge.sig_model_loaded, timeout=60_000):
        bridge.load_model(str(tiny_dir.gguf), "cpu", "float32", backend="torch")
    with qtbot.waitSignal(bridge.sig_batch_row, timeout=60_000):
        panel.run((4,) * 40, prompt_tokens=8, new_tokens=200)
    with qtbot.waitSignal(bridge.sig_batch_done, timeout=60_000) as got:
        os.kill(bridge.process.pid, signal.SIGKILL)
    done = got.args[0]
    assert (done.job, done.outcome) == ("batch", "failed") and done.message.startswith("the engine process stopped")
    assert panel.outcome == "failed" and not panel.running and done.message in shown("batch", panel)
    with qtbot.waitSignal(bridge.sig_engine_restarted, timeout=60_000):
        pass  # the new engine has the model again before the fixture shuts it down

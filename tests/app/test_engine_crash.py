"""The app survives its engine: killed mid-generation by SIGILL, SIGKILL or SIGSEGV, it says why, keeps the steps
that arrived (panels, run store, autosave), starts a new engine with the same model, and Generate works again; a
fourth death in a row is not restarted, and opening a model starts a new engine."""

from __future__ import annotations

import os
import signal

from app.bridge import MAX_RESTARTS, EngineLost, death_cause
from app.session_io import autosave_path
from app.units import fmt_bytes
from engine.events import Finished, TokenSampled
from engine.session_file import load_session
from tests.app.conftest import wait_loaded
from tests.requires import import_required

STEPS_BEFORE = 3  # steps that have arrived when the engine is killed (prefill's token and two decode steps)


def kill_mid_generation(qtbot, w, sig: int) -> EngineLost:
    """Prefill and step to STEPS_BEFORE tokens, resume, and kill the engine as the next token arrives (the engine
    is then decoding the rest of a long run)."""
    gen, bridge = w.panels["generation"], w.bridge
    gen.max_tokens.setValue(gen.max_tokens.maximum())
    assert gen.generate(start_paused=True)
    qtbot.waitUntil(lambda: gen.state == "paused" and len(gen.tokens) == 1, timeout=60_000)
    for n in range(2, STEPS_BEFORE + 1):
        gen.step()
        qtbot.waitUntil(lambda n=n: len(gen.tokens) == n, timeout=30_000)
    process = bridge.process
    pid = process.pid

    def kill(_ev) -> None:
        bridge.sig_token.disconnect(kill)
        os.kill(pid, sig)

    bridge.sig_token.connect(kill)
    with qtbot.waitSignal(bridge.sig_engine_lost, timeout=60_000) as lost:
        bridge.resume()
    assert process.exitcode == -sig and lost.args[0].exitcode == -sig
    return lost.args[0]


def assert_run_kept(qtbot, w, lost: EngineLost) -> None:
    """Every step that arrived is in the Generation panel, the run store and the autosave file, ended as an
    interrupted run."""
    gen = w.panels["generation"]
    n = len(gen.tokens)
    assert n > STEPS_BEFORE and lost.kept_steps == n
    assert gen.finished is not None and gen.finished.reason == "engine lost" and len(gen.finished.ids) == n
    qtbot.waitUntil(lambda: gen.state == "idle", timeout=10_000)
    w.tick_panels(flush=True)
    assert f"finished (engine lost)</b> · {n} tokens generated" in gen.status.text()
    run = w.run_store.shown_run()
    assert [t.token_id for t in run.tokens] == [t.token_id for t in gen.tokens]
    assert run.finished is not None and run.finished.reason == "engine lost"
    w.session_writer.wait()
    saved = load_session(autosave_path(), with_tokenizer=False)
    steps = [e for e in saved.events if isinstance(e, TokenSampled)]
    assert [e.token_id for e in steps] == [t.token_id for t in gen.tokens]
    assert isinstance(saved.events[-1], Finished) and saved.events[-1].reason == "engine lost"


def assert_cause_shown(w, lost: EngineLost, *words: str) -> None:
    for word in words:
        assert word in lost.cause
    gen = w.panels["generation"]
    assert gen.notice.isVisible() and lost.cause.split(":")[0] in gen.notice.text()
    assert lost.cause.split(":")[0] in w.message.text()
    assert lost.torch_offer == "" and "Load it on" not in gen.notice.text()  # torch crashed: nothing to offer


def test_the_app_survives_its_engine(qtbot, make_window, tiny_dir):
    w = make_window()
    wait_loaded(qtbot, w)
    bridge, gen = w.bridge, w.panels["generation"]
    info = bridge.info
    gen.ignore_eos = True
    w.panels["prompt"].set_text("Hello world")
    causes = {
        signal.SIGILL: ("SIGILL", "an instruction this CPU", "the torch runtime"),
        signal.SIGKILL: ("SIGKILL", "lack of memory", f"{info.name} needs {fmt_bytes(info.weight_bytes)} for its "
                         "weights at float32 on the torch runtime"),
        signal.SIGSEGV: ("SIGSEGV", "native code", "the model file changed on disk while it was mapped"),
    }
    for sig, words in causes.items():
        pid = bridge.process.pid
        with qtbot.waitSignal(bridge.sig_engine_restarted, timeout=120_000) as restarted:
            lost = kill_mid_generation(qtbot, w, sig)
            assert lost.restarted
            assert_cause_shown(w, lost, *words)
            assert_run_kept(qtbot, w, lost)
        assert bridge.process.pid != pid and bridge.process.is_alive()
        assert restarted.args[0].path == info.path and restarted.args[0].dtype == "float32"
        assert "loaded again" in gen.notice.text() and gen._loaded  # the next kill's run shows Generate works

    # The fourth death in a row (no generation finished since the first): not restarted, and said so.
    assert MAX_RESTARTS == 3
    lost = kill_mid_generation(qtbot, w, signal.SIGILL)
    assert not lost.restarted and "not restarted again" in lost.outcome
    assert "not restarted again" in gen.notice.text()
    assert_run_kept(qtbot, w, lost)
    qtbot.wait(300)
    assert not bridge.process.is_alive() and not bridge.engine_running
    with qtbot.waitSignal(bridge.sig_failed, timeout=5_000) as refused:
        assert gen.generate()
    assert "not running" in refused.args[0]
    qtbot.waitUntil(lambda: gen.state == "idle", timeout=5_000)

    # Opening a model starts a new engine; a generation that finishes resets the count of deaths in a row.
    with qtbot.waitSignal(bridge.sig_model_loaded, timeout=120_000):
        w.load_model(str(tiny_dir.gguf))
    qtbot.waitUntil(lambda: gen._loaded, timeout=10_000)
    gen.max_tokens.setValue(8)
    with qtbot.waitSignal(bridge.sig_finished, timeout=60_000) as done:
        assert gen.generate()
    assert done.args[0].reason == "length" and len(done.args[0].ids) == 8
    qtbot.waitUntil(lambda: gen.state == "idle", timeout=10_000)
    assert not gen.notice.isVisible()
    assert bridge.deaths == 0


def test_the_cause_in_one_sentence():
    """Each exit the engine can have, named from its code, with the model's own figures for memory."""
    need = (2_200_000_000, "its file and a KV cache of 4,096 positions")
    ill = death_cause(-signal.SIGILL, "llama.cpp", "Llama-3.2-1B", need, 8_000_000_000)
    assert "SIGILL" in ill and "the llama.cpp runtime ran an instruction this CPU" in ill
    oom = death_cause(-signal.SIGKILL, "llama.cpp", "Llama-3.2-1B", need, 1_500_000_000)
    assert ("Llama-3.2-1B needs 2.2 GB for its file and a KV cache of 4,096 positions on the llama.cpp runtime, "
            "and 1.5 GB of memory is available") in oom
    assert "lack of memory." in death_cause(-signal.SIGKILL, "torch", "m", (0, ""), 0)  # no figure: none invented
    assert "crashed (SIGBUS)" in death_cause(-signal.SIGBUS, "torch", "m", need, 0)
    assert "code 3" in death_cause(3, "torch", "m", need, 0)
    for text in (ill, oom):
        assert text.count(". ") == 0 and text.endswith(".")


def test_a_llamacpp_crash_offers_the_torch_runtime(qtbot, make_window, tiny_dir):
    """The llama.cpp runtime dies (SIGILL, as on a CPU whose AMX the OS has not enabled): the app names that
    runtime, restarts on it, and offers the torch runtime with what the weights need there; taking the offer loads
    the model on torch and Generate runs to its end."""
    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    w = make_window(load=False)
    bridge, gen = w.bridge, w.panels["generation"]
    bridge.load_model(str(tiny_dir.gguf), "cpu", "float32", "llama.cpp")
    wait_loaded(qtbot, w)
    assert bridge.runtime == "llama.cpp"
    info = bridge.info
    gen.ignore_eos = True
    w.panels["prompt"].set_text("Hello world")
    with qtbot.waitSignal(bridge.sig_engine_restarted, timeout=120_000):
        lost = kill_mid_generation(qtbot, w, signal.SIGILL)
        assert "the llama.cpp runtime ran an instruction this CPU" in lost.cause and lost.restarted
        assert f"weights in {fmt_bytes(4 * info.n_params)} at float32" in lost.torch_offer
        assert "Load it on the torch runtime" in gen.notice.text()
        assert_run_kept(qtbot, w, lost)
    assert bridge.runtime == "llama.cpp"  # restarted as it was: switching is the user's choice

    with qtbot.waitSignal(bridge.sig_model_loaded, timeout=120_000):
        gen.notice.linkActivated.emit("torch")
    assert bridge.runtime == "torch" and bridge.info.dtype == "float32"
    qtbot.waitUntil(lambda: gen._loaded and gen.state == "idle", timeout=10_000)
    gen.max_tokens.setValue(8)
    with qtbot.waitSignal(bridge.sig_finished, timeout=60_000) as done:
        assert gen.generate()
    assert done.args[0].reason == "length" and len(done.args[0].ids) == 8


def test_killed_while_loading_names_what_the_model_needs(qtbot, make_window, tiny_dir, tiny_lm):
    """Out of memory strikes most often while a model loads: the figure then comes from the file's header, and the
    new engine loads the model and shows it."""
    w = make_window(load=False)
    bridge = w.bridge
    bridge.load_model(str(tiny_dir.gguf), "cpu", "float32")
    with qtbot.waitSignal(bridge.sig_engine_lost, timeout=30_000) as lost:
        os.kill(bridge.process.pid, signal.SIGKILL)
    need = fmt_bytes(4 * tiny_lm.info.n_params)  # float32: 4 bytes a weight, as the torch loader counted them
    assert (f"lack of memory: {tiny_dir.gguf.name} needs {need} for its weights at float32 on the torch runtime"
            in lost.args[0].cause)
    assert lost.args[0].restarted and lost.args[0].kept_steps == 0
    with qtbot.waitSignal(bridge.sig_model_loaded, timeout=120_000) as loaded:
        pass
    assert loaded.args[0].path == tiny_lm.info.path and w.panels["generation"]._loaded

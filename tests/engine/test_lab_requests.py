"""The labs behind the backend seam: one typed request (engine.protocol.Lab) to one Backend.run_lab, and one typed
outcome (LabDone: done, cancelled, failed or unsupported) from the engine process, on the torch engine, llama.cpp and
a server alike; and the command line refusing what a runtime cannot run in one line, with a non-zero exit code."""

from __future__ import annotations

import types

import pytest

from engine import protocol as P
from engine.backend import Backend, Unsupported
from engine.events import Failed
from engine.labs.schedule_events import SchedConfig, SchedSummary
from engine.labs.spec_events import SpecFinished, SpecStep
from tests.engine.test_server import Client
from tests.why.conftest import run_cli

LABS = (P.BatchBench((1,), 4, 2), P.Speculate("the cat"), P.Schedule(SchedConfig()), P.ServeBench({}))


def one_sentence(text: str) -> bool:
    return bool(text.strip()) and "\n" not in text and "Traceback" not in text


@pytest.fixture
def engine(tiny_dir):
    c = Client()
    c.send(P.Load(str(tiny_dir.gguf), "cpu", "float32"))
    assert isinstance(c.until(lambda m: isinstance(m, (P.Loaded, P.LoadFailed)))[-1], P.Loaded)
    yield c
    c.send(P.Quit())
    c.thread.join(10)


def lab_done(client: Client, timeout: float = 120) -> tuple[list, P.LabDone]:
    msgs = client.until(lambda m: isinstance(m, P.LabDone), timeout=timeout)
    return msgs[:-1], msgs[-1]


def test_every_lab_is_one_request_type_with_one_job_name():
    assert set(P.LAB_JOBS) == {type(lab) for lab in LABS} and set(P.LAB_JOBS.values()) == set(P.LAB_NAMES)
    with pytest.raises(ValueError, match="not a lab outcome"):
        P.LabDone("batch", "failed: oops")  # the old string protocol is not an outcome
    with pytest.raises(ValueError, match="not a lab"):
        P.LabDone("measure")


def test_a_server_runs_only_the_load_lab_and_the_local_model_every_other(tiny_lm):
    """Each backend says in one sentence which labs it cannot run; nothing runs, nothing is sent."""
    from engine.backends.local import LocalBackend
    from engine.remote.served import ServerBackend
    from engine.run.session import Session

    sent = []
    info = types.SimpleNamespace(url="http://127.0.0.1:8000", model="m")
    server = ServerBackend(client=None, info=info)
    for lab in LABS[:3]:
        with pytest.raises(Unsupported) as e:
            server.run_lab(lab, sent.append, lambda: False)
        assert one_sentence(str(e.value)) and "disconnect from the server" in str(e.value)
    local = LocalBackend(Session(tiny_lm))
    with pytest.raises(Unsupported, match="the load lab measures a server: connect to one first"):
        local.run_lab(LABS[3], sent.append, lambda: False)

    class Bare(Backend):  # a backend that states no lab of its own
        source = property(lambda self: types.SimpleNamespace(name="a bare runtime"))
        generate = preview = tokenize = None

    for lab in LABS:
        with pytest.raises(Unsupported, match="does not run on a bare runtime"):
            Bare().run_lab(lab, sent.append, lambda: False)
    assert sent == []


def test_no_model_no_lab_each_says_so(tiny_dir):
    c = Client()
    try:
        for lab in LABS:
            c.send(lab)
            _, done = lab_done(c)
            assert done.job == P.LAB_JOBS[type(lab)] and done.outcome == "failed" and one_sentence(done.message)
            assert ("connect to a server first" if isinstance(lab, P.ServeBench) else "load a model first") \
                in done.message
    finally:
        c.send(P.Quit())
        c.thread.join(10)


def test_each_outcome_of_the_torch_engines_labs(engine):
    """done with its events first, cancelled by Cancel, failed with the lab's own sentence, unsupported with the
    backend's: each a LabDone, nothing else ends a lab (no Failed, no Done with words to parse)."""
    engine.send(P.Speculate("the cat sat on the mat. the cat", k=2, max_new_tokens=6))
    events, done = lab_done(engine)
    assert (done.job, done.outcome, done.message) == ("spec", "done", "") and done.seconds > 0
    assert any(isinstance(e, SpecStep) for e in events) and isinstance(events[-1], SpecFinished)

    engine.send(P.Speculate("the cat", k=99))  # the lab's own check: k is 1…16
    events, done = lab_done(engine)
    assert (done.job, done.outcome) == ("spec", "failed") and done.message.startswith("k (tokens drafted per pass)")

    engine.send(P.Schedule(SchedConfig(n_requests=3, prompt_len=4, output_len=3, max_batch=2)))
    events, done = lab_done(engine)
    assert (done.job, done.outcome) == ("sched", "done")
    assert {e.policy for e in events if isinstance(e, SchedSummary)} == {"static", "continuous"}

    engine.send(P.Schedule(SchedConfig(prompt_len=400)))  # beyond the tiny model's context of 256
    _, done = lab_done(engine)
    assert (done.job, done.outcome) == ("sched", "failed") and one_sentence(done.message)
    assert "context" in done.message

    engine.send(P.Speculate("the cat", k=4, max_new_tokens=200, sweep=True))
    engine.send(P.Cancel())
    events, done = lab_done(engine)
    assert (done.job, done.outcome, done.message) == ("spec", "cancelled", "")

    engine.send(P.ServeBench({"concurrency": [1]}))
    _, done = lab_done(engine)
    assert (done.job, done.outcome) == ("serve", "unsupported") and one_sentence(done.message)
    assert not [m for m in engine.seen if isinstance(m, (P.Done, Failed))]


@pytest.mark.slow
def test_llamacpp_refuses_early_exit_as_unsupported_and_runs_lookup(tiny_dir):
    from tests.requires import import_required

    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    c = Client()
    try:
        c.send(P.Load(str(tiny_dir.gguf), "cpu", "float32", backend="llama.cpp"))
        assert isinstance(c.until(lambda m: isinstance(m, (P.Loaded, P.LoadFailed)))[-1], P.Loaded)
        c.send(P.Speculate("the cat sat", source="early-exit", max_new_tokens=4))
        events, done = lab_done(c)
        assert (done.job, done.outcome) == ("spec", "unsupported") and one_sentence(done.message) and not events
        assert done.message.startswith("early-exit drafting needs a runtime that can stop after some of its layers")
        c.send(P.Speculate("the cat sat. the cat sat", source="lookup", max_new_tokens=4))
        events, done = lab_done(c)
        assert done.outcome == "done" and isinstance(events[-1], SpecFinished)
    finally:
        c.send(P.Quit())
        c.thread.join(10)


# ---- the command line: a lab a runtime cannot run is refused in one line, exit code non-zero ----------------------
@pytest.mark.slow
def test_cli_speculate_early_exit_on_llamacpp_is_refused_in_one_line(capsys, tiny_dir):
    from tests.requires import import_required

    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    code, out, err = run_cli(capsys, "speculate", "--backend", "llama.cpp", "--model", str(tiny_dir.gguf),
                             "--prompt", "the cat", "--source", "early-exit", "--max-new-tokens", "4")
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    assert err.startswith("error: early-exit drafting needs a runtime that can stop after some of its layers")


@pytest.mark.parametrize("argv, says", [
    (("speculate", "--url", "http://127.0.0.1:9", "--prompt", "x"), "`speculate` needs the model's forward pass"),
    (("serve-bench",), "serve-bench needs --url"),
])
def test_cli_labs_on_the_wrong_side_of_the_seam_are_refused_in_one_line(capsys, argv, says):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and says in err

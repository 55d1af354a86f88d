"""The engine server headless: commands in, events out, as the app drives it (here in a thread, not a process)."""

import multiprocessing
import threading

import pytest

from engine import protocol as P
from engine.events import Failed, Finished, RunStarted, TokenSampled
from engine.protocol import Capture, GenerateRequest, PreviewResult, SamplingParams
from engine.server import serve


class Client:
    def __init__(self):
        cmd_recv, self.commands = multiprocessing.Pipe(duplex=False)
        self.events, events_send = multiprocessing.Pipe(duplex=False)
        self.thread = threading.Thread(target=serve, args=(cmd_recv, events_send), daemon=True)
        self.thread.start()
        self.queued = []
        self.seen = []  # every message so far, in order

    def send(self, cmd: P.Command) -> None:
        self.commands.send(cmd)

    def quiet(self):
        """Everything the engine sent until it answered a Ping: what it did with the commands before it."""
        self.send(P.Ping(id(self)))
        return self.until(lambda m: isinstance(m, P.Pong))[:-1]

    def until(self, pred, timeout=60):
        seen = []
        while self.queued or self.events.poll(timeout):
            if not self.queued:
                got = self.events.recv()
                self.queued.extend(got if isinstance(got, list) else [got])  # a step's events come as one list
            msg = self.queued.pop(0)
            seen.append(msg)
            self.seen.append(msg)
            if pred(msg):
                return seen
        raise AssertionError(f"timed out; last messages: {seen[-3:]}")


@pytest.fixture
def client(tiny_dir):
    c = Client()
    c.send(P.Load(str(tiny_dir.gguf), "cpu", "float32"))
    loaded = c.until(lambda m: isinstance(m, (P.Loaded, P.LoadFailed)))[-1]
    assert isinstance(loaded, P.Loaded), loaded  # every test below needs the model
    yield c
    c.send(P.Quit())
    c.thread.join(10)
    assert not c.thread.is_alive()


def test_generate_pause_step_resume(client):
    req = GenerateRequest("the cat sat", chat=False, max_new_tokens=8, params=SamplingParams.greedy_params(),
                          capture=Capture(funnel_top=5), ignore_eos=True, start_paused=True)
    client.send(P.Generate(req))
    first = client.until(lambda m: isinstance(m, TokenSampled))
    assert P.State("paused") in first and first[-1].step == 0 and first[-1].funnel.greedy
    assert isinstance(first[1], RunStarted) and first[1].source.kind == "local"  # after State
    assert not any(isinstance(m, TokenSampled) for m in client.quiet())  # paused: nothing more comes
    client.send(P.Step())
    step = client.until(lambda m: isinstance(m, TokenSampled))
    assert step[-1].step == 1 and step[-1].funnel.greedy
    assert not any(isinstance(m, TokenSampled) for m in client.quiet())  # one step, then paused again
    new = SamplingParams(temperature=1.0, top_k=1)
    client.send(P.SetParams(new))
    client.send(P.Resume())
    rest = client.until(lambda m: isinstance(m, Finished))
    assert rest[-1].reason == "length" and len(rest[-1].ids) == 8
    later = [m for m in rest if isinstance(m, TokenSampled)]
    assert [t.step for t in later] == list(range(2, 8))
    # the new settings applied from the next token on: sampled (not greedy), top-k 1 keeps one token
    assert all(t.params == new and not t.funnel.greedy and t.funnel.kept_top_k == 1 for t in later)
    assert client.until(lambda m: isinstance(m, P.State))[-1] == P.State("idle")


def test_stop_ends_early_and_bad_prompt_fails_cleanly(client):
    client.send(P.Generate(GenerateRequest("the cat", chat=False, max_new_tokens=200, ignore_eos=True,
                                            params=SamplingParams(temperature=1.0, seed=1))))
    client.until(lambda m: isinstance(m, TokenSampled) and m.step == 2)
    client.send(P.Stop())
    fin = client.until(lambda m: isinstance(m, Finished))[-1]
    assert fin.reason == "stopped" and len(fin.ids) < 200
    client.until(lambda m: m == P.State("idle"))
    client.send(P.Generate(GenerateRequest("", chat=False)))
    msgs = client.until(lambda m: m == P.State("idle"))
    assert any(isinstance(m, Failed) and "empty" in m.message for m in msgs)


def test_stale_previews_are_dropped(client):
    for i, text in enumerate(["the", "the cat", "the cat sat"], start=1):
        client.send(P.Preview(i, text, False, 5))
    res = client.until(lambda m: isinstance(m, PreviewResult) and m.request_id == 3)
    previews = [m for m in res if isinstance(m, PreviewResult)]
    assert previews[-1].text == "the cat sat" and len(previews[-1].funnel.ids) == 5
    # requests queued behind the one being computed collapse into the newest, so one of the three is never
    # computed: 2 (queued behind 1), or 1 (when 1 and 2 were read together, before 3 arrived)
    assert [p.request_id for p in previews] in ([1, 3], [2, 3], [3])


def test_batch_bench_rows_and_cancel(client):
    client.send(P.BatchBench((1, 2), 6, 3))
    msgs = client.until(lambda m: isinstance(m, P.LabDone))
    assert [m.row.batch for m in msgs if isinstance(m, P.BatchMeasured)] == [1, 2]
    assert (msgs[-1].job, msgs[-1].outcome, msgs[-1].message) == ("batch", "done", "") and msgs[-1].seconds > 0
    client.send(P.BatchBench((1, 2, 4, 8, 16), 6, 40))
    client.send(P.Cancel())
    done = client.until(lambda m: isinstance(m, P.LabDone))[-1]
    assert (done.job, done.outcome) == ("batch", "cancelled")


def test_commands_during_a_bench_wait_for_it(client):
    """A slider moved while the batching lab runs must neither hang the bench nor be lost."""
    client.send(P.BatchBench((1, 2, 4), 6, 4))
    client.send(P.SetParams(SamplingParams(temperature=0.5)))
    client.send(P.Preview(7, "the cat", False, 5))
    msgs = client.until(lambda m: isinstance(m, PreviewResult), timeout=60)
    ends = [i for i, m in enumerate(msgs) if isinstance(m, P.LabDone)]
    assert len(ends) == 1 and msgs[ends[0]].outcome == "done" and ends[0] < len(msgs) - 1
    assert msgs[-1].request_id == 7


def test_step_while_generating_pauses_and_says_so(client):
    client.send(P.Generate(GenerateRequest("the cat", chat=False, max_new_tokens=50, ignore_eos=True,
                                            params=SamplingParams.greedy_params())))
    client.until(lambda m: isinstance(m, TokenSampled))
    client.send(P.Step())
    msgs = client.until(lambda m: m == P.State("paused"))
    assert not any(isinstance(m, Finished) for m in msgs)
    client.send(P.Stop())
    assert client.until(lambda m: isinstance(m, Finished))[-1].reason == "stopped"


def test_a_preview_asked_for_during_a_generation_runs_after_it(client):
    client.send(P.Generate(GenerateRequest("the cat", chat=False, max_new_tokens=20, ignore_eos=True,
                                            params=SamplingParams.greedy_params(), start_paused=True)))
    client.until(lambda m: isinstance(m, TokenSampled))
    client.send(P.Preview(11, "the cat sat", False, 5))
    client.send(P.Resume())
    msgs = client.until(lambda m: isinstance(m, PreviewResult))
    assert any(isinstance(m, Finished) for m in msgs) and msgs[-1].request_id == 11


def test_the_server_ends_when_the_app_goes_away(tiny_dir):
    c = Client()
    c.commands.close()
    c.thread.join(5)
    assert not c.thread.is_alive()


def test_threads_setting_applies_from_the_next_step(client, monkeypatch):
    import torch

    counts = []  # torch's thread count is per OS thread: record what the server's thread asks for
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (counts.append(n), real(n)))
    req = GenerateRequest("the cat sat", chat=False, max_new_tokens=4, params=SamplingParams.greedy_params(),
                          ignore_eos=True, start_paused=True)
    client.send(P.Generate(req))
    client.until(lambda m: isinstance(m, TokenSampled))
    client.send(P.SetThreads(1))  # while paused inside a generation
    client.send(P.Step())
    client.until(lambda m: isinstance(m, TokenSampled))
    assert counts and counts[-1] == 1
    client.send(P.SetThreads(0))
    assert "threads" in client.until(lambda m: isinstance(m, Failed))[-1].message  # refused, with the reason
    client.send(P.Resume())
    assert client.until(lambda m: isinstance(m, Finished))[-1].reason == "length"


def test_a_fork_request_continues_from_its_prefix(client):
    greedy = SamplingParams.greedy_params()
    client.send(P.Generate(GenerateRequest("the cat sat", chat=False, max_new_tokens=6, params=greedy,
                                            ignore_eos=True)))
    base = client.until(lambda m: isinstance(m, Finished))[-1]
    prefix = tuple(base.prompt_ids.tolist() + base.ids[:2].tolist())
    alt = (int(base.ids[2]) + 1) % 300
    client.send(P.Generate(GenerateRequest("fork", chat=False, max_new_tokens=4, params=greedy, ignore_eos=True,
                                            prompt_ids=prefix, forced=((0, alt),))))
    seen = client.until(lambda m: isinstance(m, Finished))
    fork = seen[-1]
    assert fork.prompt_ids.tolist() == list(prefix) and fork.ids[0] == alt
    assert [m.forced for m in seen if isinstance(m, TokenSampled)] == [True, False, False, False]


def test_a_damaged_model_fails_to_load_and_the_server_goes_on(tiny_dir, tmp_path):
    """Asked to open a damaged file, the engine answers one clear line and still loads the next model."""
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(tiny_dir.gguf.read_bytes()[:5000])
    c = Client()
    try:
        c.send(P.Load(str(bad), "cpu", "float32"))
        failed = c.until(lambda m: isinstance(m, (P.Loaded, P.LoadFailed)))[-1]
        assert isinstance(failed, P.LoadFailed) and "cut.gguf is damaged" in failed.message
        assert "\n" not in failed.message
        c.send(P.Load(str(tiny_dir.gguf), "cpu", "float32"))
        assert isinstance(c.until(lambda m: isinstance(m, (P.Loaded, P.LoadFailed)))[-1], P.Loaded)
    finally:
        c.send(P.Quit())
        c.thread.join(10)
    assert not c.thread.is_alive()


def test_a_measurement_yields_to_a_generation_and_resumes_after_it(client, monkeypatch, tmp_path):
    """The user's Generate never waits behind a background measurement: the measurement stops, the generation runs,
    then the measurement runs again and ends with the machine's roofs."""
    monkeypatch.setenv("INFERENCE_LAB_CACHE", str(tmp_path))  # the measurement is this test's alone
    client.send(P.Measure("cpu", "fp32"))
    client.send(P.Generate(GenerateRequest("the cat", chat=False, max_new_tokens=3, ignore_eos=True,
                                           params=SamplingParams.greedy_params())))
    msgs = client.until(lambda m: isinstance(m, P.Done) and m.job == "measure", timeout=120)
    finished = next(i for i, m in enumerate(msgs) if isinstance(m, Finished))
    answer = next(i for i, m in enumerate(msgs) if isinstance(m, P.ThisMachine))
    assert finished < answer  # the generation came first, the measurement's result after it
    assert msgs[answer].hardware is not None and msgs[-1] == P.Done("measure")


def test_a_measurement_asked_for_during_a_generation_runs_after_it(client, monkeypatch, tmp_path):
    monkeypatch.setenv("INFERENCE_LAB_CACHE", str(tmp_path))  # the measurement is this test's alone
    client.send(P.Generate(GenerateRequest("the cat", chat=False, max_new_tokens=3, ignore_eos=True,
                                           params=SamplingParams.greedy_params(), start_paused=True)))
    client.until(lambda m: isinstance(m, TokenSampled))
    client.send(P.Measure("cpu", "fp32", {"quick": True}))
    client.send(P.Resume())
    msgs = client.until(lambda m: isinstance(m, P.Done) and m.job == "measure", timeout=120)
    kinds = [type(m).__name__ for m in msgs]
    assert kinds.index("Finished") < kinds.index("ThisMachine") and msgs[-1] == P.Done("measure")


def test_an_ablated_generation_is_checked_and_ends_with_the_model_intact(client):
    """An ablation names a part the model lacks: one line, no run. A valid one runs; the next plain generation of
    the same prompt is the intact model's again (the hooks came off and the ablated KV cache was not reused)."""
    def tokens(req):
        client.send(P.Generate(req))
        msgs = client.until(lambda m: isinstance(m, (Finished, Failed)))
        return msgs[-1], [m.token_id for m in msgs if isinstance(m, TokenSampled)]

    greedy = dict(chat=False, max_new_tokens=3, ignore_eos=True, params=SamplingParams.greedy_params())
    end, got = tokens(GenerateRequest("the cat sat on the", ablation=P.Ablated(mlp_layers=(2,)), **greedy))
    assert isinstance(end, Failed) and got == [] and "MLP layer 2 is not in this model" in end.message
    _, intact = tokens(GenerateRequest("the cat sat on the", **greedy))
    _, ablated = tokens(GenerateRequest("the cat sat on the", ablation=P.Ablated(mlp_layers=(0,)), **greedy))
    _, again = tokens(GenerateRequest("the cat sat on the", **greedy))
    assert ablated != intact and again == intact
    with pytest.raises(ValueError, match="nothing to ablate"):
        P.Ablated()
    assert P.Ablated(((18, 6),), mlp_layers=(3,), mean=True).label == "mean-ablated 18:6, MLP 3"


def test_a_server_refuses_an_ablated_generation_in_one_sentence():
    from engine.backend import Backend, Unsupported
    from engine.why.ablated import generate_ablated

    class Remote(Backend):  # what the base class answers for a backend with no model of ours (a server)
        source = generate = preview = tokenize = None

    with pytest.raises(Unsupported, match="disconnect from the server to continue as a branch"):
        generate_ablated(Remote(), GenerateRequest("the cat", ablation=P.Ablated(mlp_layers=(0,))))


def test_engine_process_keeps_openmps_own_spin_as_the_cli_does():
    """The app's engine process (serve in a main thread) leaves GOMP_SPINCOUNT as it found it: libgomp's default, the
    CLI's, unless the user set one."""
    import os
    import subprocess
    import sys

    code = ("import os\nfrom multiprocessing import Pipe\nfrom engine.server import serve\n"
            "a, b = Pipe(False); c, d = Pipe(False); b.close()\nserve(a, d)\nprint(os.environ.get('GOMP_SPINCOUNT'))")
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "None"


def _messages(client, until):
    """The engine's messages (a step's list as one) until `until` matches an event in one."""
    got = []
    while client.events.poll(60):
        msg = client.events.recv()
        got.append(msg)
        if any(until(m) for m in (msg if isinstance(msg, list) else [msg])):
            return got
    raise AssertionError(f"timed out; last messages: {got[-3:]}")


def test_steps_carry_the_shown_layer_and_the_record_comes_once_at_the_end(client, tiny_lm):
    """Issue 50: a step's message carries the layers a panel shows; every layer captured for the record
    (every_layer_below) comes once, in step and layer order, before Finished, and a layer turned to mid-run comes at
    once: together exactly the captures the generation made (read from the engine itself, not through the server)."""
    from engine.events import AttentionCaptured
    from engine.run.session import Session

    capture = Capture(attention_layers=frozenset({1}), residual_norms=True, every_layer_below=64)
    req = GenerateRequest("the cat sat", chat=False, max_new_tokens=6, params=SamplingParams.greedy_params(),
                          capture=capture, ignore_eos=True, start_paused=True)
    client.send(P.Generate(req))
    msgs = _messages(client, lambda m: isinstance(m, TokenSampled))
    client.send(P.CaptureAttention(frozenset({0})))  # a panel turns to layer 0 after the prefill
    client.send(P.Resume())
    msgs += _messages(client, lambda m: isinstance(m, Finished))
    after = client.until(lambda m: isinstance(m, P.State))  # the run's end, and nothing failed after it
    failed = [m for m in after + client.quiet() if isinstance(m, Failed)]
    assert after[-1] == P.State("idle") and not failed, failed
    steps = [m for m in msgs if isinstance(m, list) and any(isinstance(e, TokenSampled) for e in m)]
    assert len(steps) == 6
    held = [m for m in msgs for m in (m if isinstance(m, list) else [m]) if isinstance(m, P.HeldAttention)]
    assert len(held) == 2  # layer 0's prefill when it was turned to; the rest at the end
    assert [(e.step, e.layer) for e in held[0].events] == [(0, 0)]
    flat = [m for m in msgs for m in (m if isinstance(m, list) else [m])]
    assert flat.index(held[1]) < flat.index(next(e for e in flat if isinstance(e, Finished)))
    assert [(e.step, e.layer) for e in held[1].events] == [(s, 1) for s in range(1, 6)]  # layer 1 once not shown
    sent_live = [(e.step, e.layer) for m in steps for e in m if isinstance(e, AttentionCaptured)]
    assert sent_live == [(0, 1)] + [(s, 0) for s in range(1, 6)]  # the shown layer only: 1, then 0
    # the same captures as the engine makes when nothing is routed
    s = Session(tiny_lm)
    direct = sorted((e.step, e.layer, e.weights.tobytes()) for e in s.generate(
        "the cat sat", max_new_tokens=6, params=SamplingParams.greedy_params(), ignore_eos=True,
        capture=Capture(attention_layers=frozenset({0, 1}), residual_norms=True))
        if isinstance(e, AttentionCaptured))
    routed = sorted((e.step, e.layer, e.weights.tobytes()) for e in (
        *(e for m in steps for e in m if isinstance(e, AttentionCaptured)), *held[0].events, *held[1].events))
    assert routed == direct


def test_the_lens_follows_capture_lens_from_the_next_token(client):
    """Issue 50: the Logit lens panel asks for the lens while it is on screen (CaptureLens) and stops asking when it
    is hidden; a running generation follows from its next token."""
    from engine.events import LensCaptured

    req = GenerateRequest("the cat sat", chat=False, max_new_tokens=5, params=SamplingParams.greedy_params(),
                          capture=Capture(), ignore_eos=True, start_paused=True)
    client.send(P.Generate(req))
    client.until(lambda m: isinstance(m, TokenSampled))  # the prefill's token, without a lens
    client.send(P.CaptureLens(3))
    client.send(P.Step())
    client.send(P.Step())
    lens = [m for m in client.until(lambda m: isinstance(m, TokenSampled) and m.step == 2)
            if isinstance(m, LensCaptured)]
    assert [e.step for e in lens] == [1, 2] and lens[0].ids.shape[1] == 3
    client.send(P.CaptureLens(0))
    client.send(P.Resume())
    rest = client.until(lambda m: isinstance(m, Finished))
    assert not any(isinstance(m, LensCaptured) for m in rest)

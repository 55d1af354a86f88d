"""Against real servers on loopback: vLLM (the exported default model) and llama.cpp's server (the default GGUF).

References: each server's own non-streamed answer and its own /tokenize (read with urllib, not our client), and our
local engine (the GGUF, float32) for the tokenization and the first step's log-probabilities.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from tests.remote.conftest import API_KEY
from tests.requires import missing

pytestmark = [pytest.mark.slow, pytest.mark.server]

ENV = dict(os.environ, INFERENCE_LAB_API_KEY=API_KEY)
PROMPT = "The capital of France is"
DIGITS = "In 2024, 1,234 apples cost $5.99 each."


def raw(url: str, path: str, body: dict | None = None, key: str | None = API_KEY) -> dict:
    """The server's answer read with urllib: the reference our client is checked against."""
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def cli(*args: str, env: dict = ENV, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def backend(server, key: str | None = API_KEY):
    from engine.remote.backend import RemoteBackend

    b = RemoteBackend(server.url, api_key=key)
    b.probe()
    return b


# ------------------------------------------------------------------------------------------------------- vLLM

def test_vllm_probe(vllm_server):
    info = backend(vllm_server).info
    assert info.kind == "vllm" and info.model == "smollm2-135m-instruct"
    assert info.metrics and info.tokenize == "/tokenize" and info.max_model_len == 2048


def test_vllm_tokenize_equals_server_and_local(vllm_server, real_lm):
    r = cli("tokenize", "--url", vllm_server.url, "--text", DIGITS, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    ref = raw(vllm_server.url, "/tokenize", {"model": "smollm2-135m-instruct", "prompt": DIGITS})
    assert got["ids"] == ref["tokens"]
    assert got["ids"] == real_lm.tokenizer.encode(DIGITS).ids  # the export kept llama.cpp's digit split
    assert got["pieces"][:6] == ["In", " ", "2", "0", "2", "4"]
    assert "".join(got["pieces"]) == DIGITS
    assert got["offsets"][-1][1] == len(DIGITS)


def test_vllm_greedy_stream_equals_nonstreamed(vllm_server):
    r = cli("generate", "--url", vllm_server.url, "--prompt", PROMPT, "--greedy", "--max-new-tokens", "24",
            "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    ref = raw(vllm_server.url, "/v1/completions", {"model": "smollm2-135m-instruct", "prompt": PROMPT,
                                                   "max_tokens": 24, "temperature": 0, "return_token_ids": True})
    choice = ref["choices"][0]
    assert got["text"] == choice["text"]
    assert got["ids"] == choice["token_ids"]
    # the prompt's ids as the server reported them with its answer, and as its own /tokenize gives them
    tokenized = raw(vllm_server.url, "/tokenize", {"model": "smollm2-135m-instruct", "prompt": PROMPT})["tokens"]
    assert got["prompt_ids"] == choice["prompt_token_ids"] == tokenized
    assert got["server"]["kind"] == "vllm" and got["finish_reason"] in ("length", "eos")
    assert got["ttft_s"] > 0 and got["tpot_s"] > 0 and got["tokens_per_s"] > 0
    assert len(got["ids"]) == ref["usage"]["completion_tokens"]


def test_vllm_logprobs_equal_server_and_local_model(vllm_server, real_lm):
    """Streamed top-N equals the server's non-streamed logprobs; the first step also equals our own model's."""
    import torch

    from engine.run.sampling import SamplingParams
    from engine.run.session import Session

    b = backend(vllm_server)
    toks = [ev for ev in b.generate(PROMPT, SamplingParams(temperature=0.0), 4, top_logprobs=5)
            if type(ev).__name__ == "RemoteTokenSampled"]
    ref = raw(vllm_server.url, "/v1/completions", {"model": "smollm2-135m-instruct", "prompt": PROMPT,
                                                   "max_tokens": 4, "temperature": 0, "logprobs": 5})
    ref_lp = ref["choices"][0]["logprobs"]
    assert [t.logprob for t in toks] == pytest.approx(ref_lp["token_logprobs"], abs=1e-5)
    for t, top in zip(toks, ref_lp["top_logprobs"], strict=True):
        assert sorted(t.funnel.logits.tolist(), reverse=True) == pytest.approx(
            sorted(top.values(), reverse=True), abs=1e-5)
        assert t.funnel.source.startswith("server top-N")
    ids = real_lm.tokenizer.encode(PROMPT).ids
    logits, _, _ = Session(real_lm).next_token_logits(ids)
    local = torch.log_softmax(logits.float(), -1)
    f = toks[0].funnel
    np.testing.assert_allclose(f.logits, local[torch.from_numpy(f.ids)].numpy(), atol=2e-3)


def test_vllm_logits_cli(vllm_server):
    r = cli("logits", "--url", vllm_server.url, "--prompt", PROMPT, "--top", "5", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert len(d["candidates"]) == 5 and d["kept"] is None
    ps = [c["prob_raw"] for c in d["candidates"]]
    assert ps == sorted(ps, reverse=True) and 0 < sum(ps) <= 1 + 1e-6
    assert all(isinstance(c["id"], int) for c in d["candidates"])


def serve_bench(server, *args: str) -> dict:
    """`serve-bench --json` at concurrency 1 and 4 (4 prompts, 16 new tokens each): its output."""
    r = cli("serve-bench", "--url", server.url, "--concurrency", "1,4", "--num-prompts", "4", "--max-new-tokens", "16",
            "--time-limit", "90", *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_vllm_serve_bench(vllm_server, tmp_path):
    out = tmp_path / "bench.csv"
    d = serve_bench(vllm_server, "--slo-ttft-ms", "60000", "--out", str(out))
    assert [run["concurrency"] for run in d["runs"]] == [1, 4]
    for run in d["runs"]:
        assert run["completed"] == 4 and run["failed"] == 0
        assert run["output_throughput"] > 0 and run["mean_tpot_ms"] > 0 and run["mean_ttft_ms"] > 0
        assert run["p99_ttft_ms"] >= run["median_ttft_ms"] > 0 and run["p99_e2el_ms"] >= run["mean_e2el_ms"] * 0.5
        assert run["mean_e2el_ms"] > run["mean_ttft_ms"]
        # the vllm-bench definition, checked against the run's own figures
        assert run["output_throughput"] == pytest.approx(64 / run["duration_s"], rel=1e-6)
        assert run["goodput"] == pytest.approx(run["request_throughput"])
    assert out.read_text().splitlines()[0].startswith("concurrency,request_rate,completed")


@pytest.mark.timing
def test_vllm_batching_raises_system_throughput(vllm_server):
    """Four streams at once give the system more tokens/s than one at a time: a ratio of two measured speeds, which
    a busy machine can break, so it is run by hand on a quiet one (pytest -m timing)."""
    one, four = serve_bench(vllm_server)["runs"]
    assert four["output_throughput"] > 1.3 * one["output_throughput"]


def test_vllm_poisson_arrivals_bounded(vllm_server):
    from engine.remote import loadlab as bench

    b = backend(vllm_server)
    done = []
    run = bench.run_once(b, concurrency=2, num_prompts=3, max_new_tokens=4, request_rate=20.0, seed=1,
                         time_limit_s=60, on_request=done.append)
    assert run.completed == 3 and len(done) == 3
    starts = sorted(r.start_s for r in done)
    assert starts[-1] > 0  # gamma gaps: not all sent at t = 0


def test_vllm_errors(vllm_server):
    r = cli("generate", "--url", vllm_server.url, "--prompt", "hi", env={**os.environ, "INFERENCE_LAB_API_KEY": ""})
    assert r.returncode != 0 and "HTTP 401" in r.stderr and "API key" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = cli("generate", "--url", vllm_server.url + "/nope", "--prompt", "hi")
    assert r.returncode != 0 and "HTTP 404" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_vllm_metrics(vllm_server):
    b = backend(vllm_server)
    m = b.metrics()
    assert m is not None and m.kv_usage is not None and 0 <= m.kv_usage <= 1
    assert m.running is not None and m.waiting is not None


# ------------------------------------------------------------------------------------------------- llama.cpp

def test_llamacpp_probe_and_tokenize(llama_server, real_lm):
    b = backend(llama_server, key=None)
    assert b.info.kind == "llama-cpp-python"
    t = b.tokenize(DIGITS)
    ref = raw(llama_server.url, "/extras/tokenize", {"input": DIGITS}, key=None)["tokens"]
    assert t.ids.tolist() == ref == real_lm.tokenizer.encode(DIGITS).ids


def test_llamacpp_greedy_chat_equals_nonstreamed_and_logprobs(llama_server):
    r = cli("generate", "--url", llama_server.url, "--chat", "--prompt", "What is 2+2?", "--greedy",
            "--max-new-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    ref = raw(llama_server.url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 12, "temperature": 0,
        "logprobs": True, "top_logprobs": 5}, key=None)
    c = ref["choices"][0]
    assert got["text"] == c["message"]["content"]
    assert got["logprobs"] == pytest.approx([e["logprob"] for e in c["logprobs"]["content"]], abs=1e-4)
    assert got["server"]["kind"] == "llama-cpp-python"


def test_llamacpp_server_decodes_64_tokens_after_a_20_token_prompt(llama_server):
    """The AMX class's crash (issue 25) killed the server on any prompt past a few tokens; it must answer and live."""
    prompt = ("The capital of France is a city that many people visit every year, because its museums, its food "
              "and its old streets are famous")
    r = cli("generate", "--url", llama_server.url, "--prompt", prompt, "--greedy", "--max-new-tokens", "64",
            "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert len(got["prompt_ids"]) >= 20 and len(got["ids"]) >= 1
    assert backend(llama_server, key=None).info.kind == "llama-cpp-python"  # still serving


def test_llamacpp_killed_mid_stream(server_logs):
    """A server that dies mid-stream gives one clear message, and the tokens that arrived are kept."""
    from engine.loaders import default_model_path
    from engine.run.sampling import SamplingParams
    from tests.remote import servers

    if not servers.LLAMA_PY.exists():
        missing("servers", f"llama-cpp-python's virtual environment is missing ({servers.LLAMA_PY})")
    s = servers.start_llamacpp(default_model_path(), server_logs)
    try:
        b = backend(s, key=None)
        events = []
        for ev in b.generate("Tell me a long story about a dragon.", SamplingParams(temperature=0.0), 400,
                             chat=True, ignore_eos=True):
            events.append(ev)
            if type(ev).__name__ == "RemoteTokenSampled" and ev.step == 3:
                os.killpg(s.proc.pid, signal.SIGKILL)  # a crash, not a shutdown
        failed = events[-1]
        assert type(failed).__name__ == "Failed", type(failed).__name__
        assert "dropped" in failed.message or "ended early" in failed.message, failed.message
        assert sum(type(e).__name__ == "RemoteTokenSampled" for e in events) >= 4
    finally:
        s.stop()
    r = cli("generate", "--url", s.url, "--prompt", "hi")  # a hang would end at cli()'s timeout
    assert r.returncode != 0 and "connection refused" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_app_renders_a_vllm_run_and_the_load_lab(vllm_server, tmp_path):
    """`python -m app --url`: a real generation on vLLM, then the Load lab at two levels, in one screenshot."""
    from PySide6 import QtGui

    shot = tmp_path / "vllm.png"
    env = dict(ENV, QT_QPA_PLATFORM="offscreen")
    r = subprocess.run([sys.executable, "-m", "app", "--url", vllm_server.url, "--prompt", PROMPT, "--greedy",
                        "--max-new-tokens", "8", "--load-lab", "1,4", "--screenshot", str(shot)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    image = QtGui.QImage(str(shot))
    assert image.width() > 800 and image.height() > 600
    colours = {image.pixel(x, y) for x in range(0, image.width(), 7) for y in range(0, image.height(), 7)}
    assert len(colours) > 200


def test_a_vllm_run_saves_and_reopens_with_its_source(vllm_server, tmp_path):
    """A generation on a real vLLM saved as a session (--save-session) reopens without the model or the server,
    and says where it came from: a server, which gave no attention."""
    from engine.events import RunStarted, TokenSampled
    from engine.session_file import load_session

    ilab = tmp_path / "vllm.ilab"
    env = dict(ENV, QT_QPA_PLATFORM="offscreen")
    r = subprocess.run([sys.executable, "-m", "app", "--url", vllm_server.url, "--prompt", PROMPT, "--greedy",
                        "--max-new-tokens", "6", "--save-session", str(ilab)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    saved = load_session(ilab)
    started = next(e for e in saved.events if isinstance(e, RunStarted))
    assert started.source.kind == "server" and not started.source.can("attention")
    assert len([e for e in saved.events if isinstance(e, TokenSampled)]) == 6
    shot = tmp_path / "reopened.png"
    r = subprocess.run([sys.executable, "-m", "app", "--open-session", str(ilab), "--screenshot", str(shot)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert shot.stat().st_size > 10_000

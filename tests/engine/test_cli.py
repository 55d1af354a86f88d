"""`python -m engine`: JSON shapes on the real model and one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def cli(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_info_json_facts():
    r = cli("info", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["n_layers"], d["d_model"], d["n_heads"], d["n_kv_heads"], d["head_dim"], d["vocab_size"]) == (
        30, 576, 9, 3, 64, 49152)
    assert d["n_params"] == 134_515_008 and d["kv_bytes_per_token"] == 46_080
    assert d["dtype"] == "float32" and d["weight_bytes"] == 134_515_008 * 4
    assert d["kernels"] == "exact" and d["decode_weight_bytes"] > 0  # the default: the file's weights, exactly


@pytest.mark.slow
def test_tokenize_json_spans():
    text = "Héllo 2024 😀"
    d = json.loads(cli("tokenize", "--text", text, "--json").stdout)
    assert len(d["ids"]) == len(d["pieces"]) == len(d["offsets"]) == len(d["byte_offsets"])
    b = text.encode()
    assert d["byte_offsets"][0][0] == 0 and d["byte_offsets"][-1][1] == len(b)
    assert all(p[1] == q[0] for p, q in zip(d["byte_offsets"], d["byte_offsets"][1:], strict=False))
    assert d["offsets"][0][0] == 0 and d["offsets"][-1][1] == len(text)
    assert d["pieces"][:3] == ["H", "é", "llo"]
    assert sum(p.isdigit() for p in d["pieces"]) == 4  # SmolLM2 splits every digit on its own


@pytest.mark.slow
def test_logits_and_generate_json():
    d = json.loads(cli("logits", "--prompt", "The capital of France is", "--top", "5", "--top-k", "3",
                       "--json").stdout)
    assert d["kept"] == 3 and len(d["candidates"]) == 5
    assert d["candidates"][0]["token"] == " Paris"
    assert (d["kernels"], d["dtype"]) == ("exact", "float32")  # what computed the numbers
    assert sum(c["prob"] for c in d["candidates"]) == pytest.approx(1.0, abs=1e-4)
    r = cli("generate", "--chat", "--greedy", "--prompt", "What is a KV cache?", "--max-new-tokens", "12", "--json")
    g = json.loads(r.stdout)
    assert {"prompt_ids", "ids", "text", "ttft_s", "tpot_s", "tokens_per_s", "finish_reason", "kernels"} <= set(g)
    assert len(g["ids"]) == 12 and g["finish_reason"] == "length" and g["text"].strip()
    steps = g["step_seconds"]  # each decode step's time: the first token is the prefill's (TTFT)
    assert len(steps) == 11 and all(x > 0 for x in steps)
    assert g["tpot_s"] == pytest.approx(sum(steps) / 11, rel=1e-3)
    one = json.loads(cli("generate", "--chat", "--greedy", "--prompt", "What is a KV cache?", "--max-new-tokens",
                         "12", "--threads", "1", "--json").stdout)
    assert one["ids"] == g["ids"]  # the thread count changes the speed, not the greedy continuation


@pytest.mark.slow
def test_the_fast_kernel_mode_is_named_in_the_json_and_moves_the_numbers(monkeypatch):
    """Under --kernels fast the tied head's int8 form runs (forced here: the tuner may find it slower on some CPU;
    the prompt's own positions are a prefill, which never runs a form), so the numbers move; the output says which
    mode computed them. In exact mode the forcing finds no form to run: transformers' float32 funnel keeps 152."""
    args = ("logits", "--prompt", "The capital of France is", "--dtype", "float32", "--temperature", "1.3",
            "--top-p", "0.8", "--threads", "1", "--json")
    monkeypatch.setenv("INFERENCE_LAB_KERNEL", "int8")
    exact = json.loads(cli(*args, timeout=600).stdout)
    fast = json.loads(cli(*args, "--kernels", "fast", timeout=600).stdout)  # a first fast load measures its forms
    assert (exact["kernels"], fast["kernels"]) == ("exact", "fast")
    assert exact["candidates"][0]["token"] == fast["candidates"][0]["token"] == " Paris"
    assert exact["candidates"][0]["prob_raw"] != fast["candidates"][0]["prob_raw"]  # the int8 head ran in fast mode
    assert exact["kept"] == 152  # the issue's example, as transformers' warpers on its float32 logits
    r = cli(*args, "--kernels", "turbo")
    assert r.returncode == 2 and "--kernels" in r.stderr and "turbo" in r.stderr


@pytest.mark.slow
def test_logit_bias_removes_the_top_candidate():
    d = json.loads(cli("logits", "--prompt", "The capital of France is", "--top", "3", "--logit-bias", "7042=-100",
                       "--temperature", "1", "--json").stdout)
    paris = [c for c in d["candidates"] if c["token"] == " Paris"]
    assert paris and paris[0]["prob"] < 1e-20 and paris[0]["prob_raw"] > 0.5  # raw logits unchanged, sampling not


@pytest.mark.parametrize("args, needle", [
    (["generate", "--prompt", ""], "empty"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "--prompt", "hi", "--top-p", "2"], "--top-p"),
    (["info", "--model", "/no/such/model.gguf"], "not found"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "abc"], "--max-new-tokens"),
    (["logits", "--prompt", "hi", "--logit-bias", "7042"], "ID=BIAS"),
    (["generate", "--prompt", "hi", "--threads", "0"], "--threads"),
    (["generate", "--prompt", "hi", "--threads", "many"], "--threads"),
])
def test_errors_are_one_line_without_traceback(args, needle):
    r = cli(*args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_corrupt_model_is_one_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    r = cli("info", "--model", str(bad))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "broken.gguf" in r.stderr


@pytest.mark.slow
def test_prompt_longer_than_context_is_one_line(tmp_path):
    r = cli("generate", "--prompt", "x " * 9000)
    assert r.returncode == 1 and "context" in r.stderr and len(r.stderr.strip().splitlines()) == 1

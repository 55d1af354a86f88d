"""The CUDA path: the model, the app's engine server, the CLI's commands, the labs and the why-experiments on a GPU.

Run by hand on a machine with an NVIDIA GPU: `pytest -m cuda tests/engine/test_cuda.py` (pyproject's addopts leave
these tests out of `make test`: CI has no GPU). `INFERENCE_LAB_TEST_DEVICE=cpu` runs the same checks on the CPU,
which is how the checks themselves are checked where there is no GPU. The model is the tiny random checkpoint of
tests/tiny_model.py; its logits are held to that module's float64 reference, which shares no code with engine/.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from torch.testing import assert_close

from engine import protocol as P
from engine.events import AttentionCaptured, Failed, Finished, LensCaptured, ResidualNorms, TokenSampled
from engine.loaders import load
from engine.model.kv_cache import KVCache
from engine.model.seam import Reads
from engine.protocol import Capture, GenerateRequest, SamplingParams
from engine.run.session import Session
from tests.engine.test_cli import cli
from tests.engine.test_families import _sources
from tests.engine.test_families import full_logits as family_logits
from tests.engine.test_model import full_logits
from tests.engine.test_server import Client
from tests.tiny_families import FAMILIES, write_checkpoint
from tests.tiny_families import reference_logits as family_reference
from tests.tiny_model import CFG, reference_logits

DEVICE = os.environ.get("INFERENCE_LAB_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.cuda
IDS = [5, 77, 140, 3, 250, 99, 12, 200, 41, 7, 66]


def test_the_device_is_there():
    """A GPU run that found no GPU must fail here, not pass by running everything on the CPU."""
    if DEVICE == "cuda":
        assert torch.cuda.is_available(), "torch sees no CUDA GPU"


@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_float32_on_the_device_matches_the_reference(tiny_dir, kind):
    lm = load(tiny_dir.gguf if kind == "gguf" else tiny_dir.hf_dir, device=DEVICE, dtype="float32", use_cache=False)
    assert lm.device.type == DEVICE
    assert all(p.device.type == DEVICE for p in lm.model.parameters())
    ref = reference_logits(tiny_dir.hf_weights, IDS).float()
    assert_close(full_logits(lm, IDS).cpu(), ref, atol=2e-4, rtol=1e-4)


def test_attention_on_the_gpu_leaves_cudnn_out(tiny_dir):
    """cuDNN's attention builds a graph for every new key length, so a first generation paid one each step
    (BENCHMARKS.md, "The CUDA path"); loading on the GPU leaves it out of torch's choices."""
    load(tiny_dir.gguf, device=DEVICE, dtype="float32", use_cache=False)
    if DEVICE == "cuda":
        assert not torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"] if DEVICE == "cuda" else ["bfloat16"])  # float16: CUDA only
def test_half_precision_on_the_device_keeps_the_reference_top_token(tiny_dir, dtype):
    """Half precision is not float64: the logits stay close and the top token at every position stays the same."""
    lm = load(tiny_dir.gguf, device=DEVICE, dtype=dtype, use_cache=False)
    got = full_logits(lm, IDS).float().cpu()
    ref = reference_logits(tiny_dir.hf_weights, IDS).float()
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_cached_decode_on_the_device_equals_the_full_forward(tiny_dir):
    lm = load(tiny_dir.gguf, device=DEVICE, dtype="float32", use_cache=False)
    full = full_logits(lm, IDS)
    cache = KVCache(lm.cfg, 1, 64, torch.float32, device=lm.device)
    out = [lm.model(torch.tensor([IDS[:6]], device=lm.device), cache)[0]]
    for p in range(6, len(IDS)):
        out.append(lm.model(torch.tensor([[IDS[p]]], device=lm.device), cache)[0])
    assert_close(torch.stack([o[-1] if o.dim() > 1 else o for o in out]), full[5:], atol=1e-4, rtol=1e-4)


def test_the_apps_engine_generates_on_the_device_with_every_capture(tiny_dir):
    """The app's path: the engine server loads on the device and streams a run with attention, norms, the funnel,
    the logits and the lens captured, as the panels ask for them."""
    c = Client()
    try:
        c.send(P.Load(str(tiny_dir.gguf), DEVICE, "auto"))
        loaded = c.until(lambda m: isinstance(m, (P.Loaded, P.LoadFailed)), timeout=300)[-1]
        assert isinstance(loaded, P.Loaded), loaded
        assert loaded.info.device.startswith(DEVICE)
        capture = Capture(attention_layers=frozenset(range(CFG["n_layers"])), residual_norms=True, funnel_top=5,
                          logits=True, lens_top=3, prompt_scores=True)
        req = GenerateRequest("the cat sat", chat=False, max_new_tokens=12, params=SamplingParams.greedy_params(),
                              capture=capture, ignore_eos=True)
        c.send(P.Generate(req))
        run = c.until(lambda m: isinstance(m, (Finished, Failed)), timeout=300)
        assert isinstance(run[-1], Finished), run[-1]
        assert len(run[-1].ids) == 12
        tokens = [m for m in run if isinstance(m, TokenSampled)]
        assert len(tokens) == 12 and all(t.funnel is not None for t in tokens)
        attention = [m for m in run if isinstance(m, AttentionCaptured)]
        assert {a.layer for a in attention} == set(range(CFG["n_layers"]))
        assert any(isinstance(m, ResidualNorms) for m in run) and any(isinstance(m, LensCaptured) for m in run)
        assert not any(isinstance(m, Failed) for m in c.seen)
    finally:
        c.send(P.Quit())
        c.thread.join(30)


def _cli(tiny_dir, *args: str, device: str = DEVICE) -> subprocess.CompletedProcess:
    return cli(*args, "--model", str(tiny_dir.gguf), "--device", device, timeout=600)


COMMANDS = {
    "info": ["info", "--json"],
    "logits": ["logits", "--prompt", "the cat sat", "--json"],
    "generate": ["generate", "--prompt", "the cat sat", "--greedy", "--max-new-tokens", "8", "--ignore-eos", "--json"],
    "lens": ["lens", "--prompt", "the cat sat", "--json"],
    "bench-batch": ["bench-batch", "--batches", "1,2", "--prompt-tokens", "8", "--new-tokens", "4"],
    "speculate": ["speculate", "--prompt", "the cat sat", "--max-new-tokens", "8", "--json"],
    "schedule": ["schedule", "--requests", "4", "--prompt-len", "8", "--output-len", "4"],
    "ablate": ["ablate", "--prompt", "the cat sat on", "--head", "0:1", "--json"],
    "attribute": ["attribute", "--prompt", "the cat sat on", "--json"],
    "heads": ["heads", "--repeat", "6", "--json"],
    "patch": ["patch", "--clean", "the cat sat", "--corrupt", "the sat sat", "--answer", "at", "--wrong", " s",
              "--json"],
}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_engine_command_runs_on_the_device(tiny_dir, name):
    r = _cli(tiny_dir, *COMMANDS[name])
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    if "--json" in COMMANDS[name]:
        try:
            json.loads(r.stdout)
        except json.JSONDecodeError:  # a stream: one JSON object a line
            [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def test_the_cli_greedy_run_on_the_device_is_the_cpu_run(tiny_dir):
    """float32 on both: the same greedy tokens (the tiny model's top logits are far apart at these steps)."""
    args = ["generate", "--prompt", "the cat sat", "--greedy", "--max-new-tokens", "8", "--ignore-eos", "--json",
            "--dtype", "float32"]
    runs = [_cli(tiny_dir, *args, device=d) for d in (DEVICE, "cpu")]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    ids = [json.loads(r.stdout.strip().splitlines()[-1])["ids"] for r in runs]
    assert ids[0] == ids[1]


def test_the_roofline_measures_the_device(tmp_path):
    """The roofline's "this machine" point: the device's own bandwidth and matmul throughput, above what any CPU
    gives when it is a GPU (an H100/H200 reads memory at terabytes a second)."""
    from engine.costs.hardware import measure_this_machine

    hw = measure_this_machine(DEVICE, "bfloat16")
    flops = hw.peak_flops["bf16"]
    assert hw.measured and hw.bandwidth_bytes_per_s > 0 and flops > 0
    if DEVICE == "cuda":
        assert hw.bandwidth_bytes_per_s > 5e11 and flops > 5e13, hw


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    d = tmp_path_factory.mktemp("families")
    return {f: write_checkpoint(d, f) for f in FAMILIES}


@pytest.mark.parametrize(("family", "kind"), _sources({}))
def test_every_family_on_the_device_matches_transformers(families, family, kind):
    """Gemma 3's sliding windows and local/global layers, Qwen3's q/k norms, Phi-3's fused products, Mistral's
    window and Llama 3.1's RoPE scaling, on the device, against transformers' own model (float32, on the CPU); the
    captured (explicit) attention path too."""
    ck = families[family]
    lm = load(ck.hf_dir if kind == "hf" else ck.gguf, device=DEVICE, dtype="float32", use_cache=False)
    ids = [5, 77, 140, 3, 250, 99, 12, 200, 41, 7, 66, 13, 290, 31, 8]  # several sliding windows of 4
    ref = family_reference(ck.model, ids)
    assert_close(family_logits(lm.model, lm.cfg, ids).cpu(), ref, atol=1e-4, rtol=1e-4)
    probe = Reads(range(lm.cfg.n_layers))
    assert_close(family_logits(lm.model, lm.cfg, ids, probe).cpu(), ref, atol=1e-4, rtol=1e-4)


def test_a_long_run_on_the_device_keeps_its_memory_to_the_kv_cache(tmp_path):
    """Thousands of tokens with the app's captures on: the device's memory grows by the KV cache the run fills and
    not per step (captures go to the host). Gemma 3's shape: its local layers keep a window, not the whole run."""
    ck = write_checkpoint(tmp_path, "gemma3", max_position_embeddings=4096)
    lm = load(ck.gguf, device=DEVICE, dtype="float32", use_cache=False)
    s = Session(lm)
    capture = Capture(attention_layers=frozenset(range(lm.cfg.n_layers)), residual_norms=True, funnel_top=5,
                      lens_top=3)

    def run(n: int) -> tuple[int, Finished]:
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        fin = None
        for ev in s.generate("the cat sat", SamplingParams.greedy_params(), n, capture=capture, ignore_eos=True):
            if isinstance(ev, Finished):
                fin = ev
        peak = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0
        return peak, fin

    short, fin_short = run(200)
    long, fin_long = run(3000)
    assert len(fin_short.ids) == 200 and len(fin_long.ids) == 3000
    # the KV cache of 2,800 more positions on the global layers, at most, plus its growth in whole blocks
    cfg = lm.cfg
    per_position = 2 * cfg.n_kv_heads * cfg.head_dim * 4 * cfg.n_layers
    assert long - short <= 2 * 2800 * per_position + (8 << 20), (short, long)

"""engine.costs.estimate (capacity estimator and its CLI) and engine.costs.hardware (measuring this machine)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.costs import estimate as est
from engine.costs import hardware
from engine.costs.catalog import Hardware
from engine.formats.locate import cache_root

REPO = Path(__file__).resolve().parents[2]
REQUIRED_KEYS = {
    "model", "hardware", "dtype", "context", "batch", "n_params", "weights_bytes", "kv_bytes_per_token",
    "kv_bytes", "total_bytes", "memory_bytes", "fits", "max_batch_at_context", "max_context_at_batch",
    "arithmetic_intensity", "tpot_floor_s", "tokens_per_s_per_stream", "tokens_per_s_system",
    "ttft_estimate_s", "compute_bound_prefill", "memory_bound_decode", "ridge_point",
}
SEED_ARGS = ["estimate", "--preset", "llama-2-70b", "--hardware", "h100-sxm", "--dtype", "fp16",
             "--context", "4096", "--batch", "1", "--json"]


def test_seed_example_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert est.main(SEED_ARGS) == 0
    r = json.loads(capsys.readouterr().out)
    assert REQUIRED_KEYS <= r.keys()
    assert r["n_params"] == 68_976_648_192
    assert r["weights_bytes"] == 2 * 68_976_648_192  # ≈ 138 GB: "a 70B model is ~140 GB in FP16"
    assert r["kv_bytes"] == 4096 * 327_680
    assert 0.041 <= r["tpot_floor_s"] <= 0.043
    assert 23.5 < r["tokens_per_s_per_stream"] < 24.5
    assert r["tokens_per_s_system"] == r["tokens_per_s_per_stream"]
    assert not r["fits"]  # 139 GB on one 80 GB card: it needs two
    assert r["max_batch_at_context"] == 0 and r["max_context_at_batch"] == 0
    assert r["memory_bound_decode"] and r["compute_bound_prefill"]
    assert r["ridge_point"] == pytest.approx(989.5e12 / 3.35e12)
    assert 1.0 < r["arithmetic_intensity"] < 1.1


def test_fits_and_limits_by_hand() -> None:
    r = est.estimate("llama-3-8b", "h100-sxm", "bf16", context=8192, batch=1)
    # weights 8,030,261,248 · 2 = 16,060,522,496 B; KV per token 2·32·8·128·2 = 131,072 B;
    # one 8192-token sequence 1,073,741,824 B; free for KV (80e9 - weights) = 63,939,477,504 B → 59 sequences
    assert r["weights_bytes"] == 16_060_522_496
    assert r["kv_bytes"] == 1_073_741_824
    assert r["fits"]
    assert r["max_batch_at_context"] == 59
    assert r["max_context_at_batch"] == 8192  # memory alone would allow 487,819 tokens
    assert r["max_context_limited_by"] == "model"
    r = est.estimate("llama-3-8b", "h100-sxm", "bf16", context=8192, batch=64)
    assert not r["fits"]
    assert r["max_context_at_batch"] == 63_939_477_504 // (131_072 * 64) == 7622
    assert r["max_context_limited_by"] == "memory"


def test_batching_raises_system_throughput_more_than_it_slows_each_stream() -> None:
    one = est.estimate("llama-3-8b", "h100-sxm", "fp16", context=1024, batch=1, prompt_tokens=512)
    many = est.estimate("llama-3-8b", "h100-sxm", "fp16", context=1024, batch=32, prompt_tokens=512)
    assert many["arithmetic_intensity"] > 10 * one["arithmetic_intensity"]
    assert many["tokens_per_s_system"] > 10 * one["tokens_per_s_system"]
    assert many["tokens_per_s_per_stream"] > 0.5 * one["tokens_per_s_per_stream"]
    assert one["ttft_estimate_s"] == many["ttft_estimate_s"]  # TTFT is one prompt's prefill
    assert one["ttft_estimate_s"] == pytest.approx(one["prefill_flops"] / 989.5e12)  # compute-bound


def test_plain_table_has_units(capsys: pytest.CaptureFixture[str]) -> None:
    assert est.main(SEED_ARGS[:-1]) == 0
    out = capsys.readouterr().out
    for text in ("Llama-2-70B", "GB", "ms", "tok/s", "FLOP/byte", "TPOT floor", "TTFT", "NO"):
        assert text in out
    # The TPOT floor by hand: Llama-2-70B has 68,976,648,192 parameters (its model card); a decode step streams all
    # but the 32,000 × 8,192 embedding table it only looks one row up in, at 2 bytes each, reads the 4,095 cached
    # positions and writes one, each 2 · 80 layers · 8 KV heads · 128 · 2 B = 327,680 B; H100 SXM: 3.35 TB/s.
    weights = (68_976_648_192 - 32_000 * 8_192 + 8_192) * 2
    floor_ms = (weights + 4_096 * 327_680) / 3.35e12 * 1e3
    assert f"{floor_ms:.1f}" == "41.4" and f"{floor_ms:.1f}" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "gpt-5"], "valid: smollm2-135m"),
        (["--hardware", "tpu-v9"], "valid: h100-sxm"),
        (["--dtype", "fp5"], "valid: float32"),
        (["--context", "0"], "context"),
        (["--batch", "-3"], "batch"),
        (["--context", "128", "--prompt-tokens", "500"], "prompt tokens"),
    ],
)
def test_errors_print_one_line_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        est.main(["estimate", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_cli_as_a_process() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ok = subprocess.run([sys.executable, "-m", "engine.costs.estimate", *SEED_ARGS], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["hardware"] == "h100-sxm"
    bad = subprocess.run([sys.executable, "-m", "engine.costs.estimate", "estimate", "--preset", "nope"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().count("\n") == 0 and "valid:" in bad.stderr


def test_add_subcommand_sets_func() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    est.add_subcommand(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["estimate", "--preset", "mistral-7b", "--dtype", "int4", "--kv-dtype", "fp16"])
    assert args.func is est.run_estimate
    r = est.estimate(args.preset, args.hardware, args.dtype, args.context, args.batch, kv_dtype=args.kv_dtype)
    assert r["weights_bytes"] == 7_241_732_096 * 0.5
    assert r["kv_bytes_per_token"] == 131_072


# ---------------------------------------------------------------- measuring this machine


def _check(hw: Hardware) -> None:
    assert hw.name == "this-machine" and hw.measured
    for value in (hw.bandwidth_bytes_per_s, hw.memory_bytes, *hw.peak_flops.values()):
        assert math.isfinite(value) and value > 0
    assert 1e8 < hw.bandwidth_bytes_per_s < 1e14
    assert 1e8 < hw.peak_for("float32") < 1e16


def test_measure_this_machine_quickly() -> None:
    seen: list[tuple[float, str]] = []
    hw = hardware.measure_this_machine(progress=lambda f, m: seen.append((f, m)), quick=True)
    _check(hw)
    assert seen and all(0.0 <= f <= 1.0 for f, _ in seen) and seen[-1][0] == 1.0
    r = est.estimate("smollm2-135m", hw, "float32", context=256, batch=1)  # measured hardware works too
    assert r["tokens_per_s_per_stream"] > 0 and r["hardware"] == "this-machine"


def test_measurement_can_be_stopped() -> None:
    with pytest.raises(hardware.MeasurementCancelled):
        hardware.measure_this_machine(should_stop=lambda: True, quick=True)
    with pytest.raises(ValueError, match="valid"):
        hardware.measure_this_machine(dtype="int8", quick=True)


def test_cache_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert hardware.load_cached("cpu", "float32", cache_dir=tmp_path) is None
    hw = hardware.cached_this_machine("cpu", "float32", cache_dir=tmp_path, quick=True)
    _check(hw)
    assert (tmp_path / "hardware.json").is_file()

    def no_measuring(*a: object, **k: object) -> Hardware:
        raise AssertionError("should have come from the cache")

    monkeypatch.setattr(hardware, "measure_this_machine", no_measuring)
    assert hardware.cached_this_machine("cpu", "fp32", cache_dir=tmp_path) == hw  # fp32 is float32's key
    assert hardware.load_cached("cpu", "float32", cache_dir=tmp_path, max_age_s=-1) is None  # too old
    assert hardware.load_cached("cpu", "bf16", cache_dir=tmp_path) is None  # other dtype, other key


def test_cache_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERENCE_LAB_CACHE", str(tmp_path / "lab"))
    assert cache_root() == tmp_path / "lab"
    hardware.cached_this_machine("cpu", "float32", quick=True)
    assert (tmp_path / "lab" / "hardware.json").is_file()
    assert hardware.load_cached("cpu", "float32") is not None

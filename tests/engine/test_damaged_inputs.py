"""Damaged model files, as a new user's disk may present them, through `engine info` and `engine generate`.

Every case must end cleanly: a non-zero exit with exactly one line on stderr that names the problem, no traceback,
within seconds and under a 3 GB address-space limit (a flipped bit or a large but possible claim may instead leave a
model that loads: then it must run). The damage is made here, from the tiny test checkpoint: cut
files, flipped bits, header fields that claim absurd sizes, broken config.json / safetensors / tokenizer.json, and a
pickle renamed to model.safetensors. Two undamaged controls must still work, so the harness itself can fail.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WALL_LIMIT_S = 20.0  # generous for a busy 2-core machine; a tiny model loads in well under a second
MEMORY_LIMIT = 3 * 2**30

U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")


def _patch(data: bytes, offset: int, packed: bytes) -> bytes:
    return data[:offset] + packed + data[offset + len(packed):]


def _gguf_cases(good: Path, out: Path) -> dict[str, tuple[Path, str]]:
    """id -> (file, a word the error must contain). Offsets are located with the gguf package's reader."""
    import gguf

    data = good.read_bytes()
    r = gguf.GGUFReader(str(good))

    def value_offset(key: str) -> int:  # key length (u64), key bytes, value type (u32), value
        return r.fields[key].offset + 8 + len(key.encode()) + 4

    t0 = r.tensors[0].field
    name_len = len(r.tensors[0].name.encode())
    ndims_at = t0.offset + 8 + name_len
    dims_at = ndims_at + 4
    n_dims = int(t0.parts[2][0])
    type_at = dims_at + 8 * n_dims
    toff_at = type_at + 4
    tensor_info_start = t0.offset
    kv_mid = (r.fields["tokenizer.ggml.tokens"].offset + r.fields["tokenizer.ggml.merges"].offset) // 2

    variants: dict[str, tuple[bytes, str]] = {
        "empty": (b"", "empty"),
        "cut-in-magic": (data[:3], "GGUF"),
        "cut-in-counts": (data[:20], "ends"),
        "cut-in-metadata": (data[:kv_mid], "ends"),
        "cut-in-tensor-info": (data[: tensor_info_start + 20], "ends"),
        "cut-in-data": (data[: (r.data_offset + len(data)) // 2], "ends"),
        "cut-last-byte": (data[:-1], "ends"),
        "tensor-count-2^62": (_patch(data, 8, U64.pack(2**62)), "tensor"),
        "kv-count-2^62": (_patch(data, 16, U64.pack(2**62)), "metadata"),
        "key-length-2^60": (_patch(data, 24, U64.pack(2**60)), "ends"),
        "array-length-2^60": (_patch(data, value_offset("tokenizer.ggml.tokens") + 4, U64.pack(2**60)), "ends"),
        "n-dims-2^31": (_patch(data, ndims_at, U32.pack(2**31)), "dimensions"),
        "dim-2^40": (_patch(data, dims_at, U64.pack(2**40)), "ends"),
        "tensor-offset-past-end": (_patch(data, toff_at, U64.pack(len(data))), "ends"),
        "tensor-type-9999": (_patch(data, type_at, U32.pack(9999)), "type"),
        "head_count-0": (_patch(data, value_offset("llama.attention.head_count"), U32.pack(0)), "head"),
        "context_length-2^32-1": (
            _patch(data, value_offset("llama.context_length"), U32.pack(2**32 - 1)), "context"),
        # within the limits (a real model may claim 16M), so it must load and run in bounded memory
        "context_length-16M": (_patch(data, value_offset("llama.context_length"), U32.pack(16_000_000)), ""),
    }
    norm = next(t for t in r.tensors if t.name == "output_norm.weight")  # float32 values in the data
    variants["nan-weights"] = (_patch(data, norm.data_offset, struct.pack("<ff", math.nan, math.inf)), "NaN")
    rng = random.Random(12)
    for i in range(6):  # single bit flips in the header (metadata and tensor descriptions)
        pos = rng.randrange(r.data_offset)
        b = bytearray(data)
        b[pos] ^= 1 << rng.randrange(8)
        variants[f"bit-flip-{i}@{pos}"] = (bytes(b), "")  # a flip may also be harmless: then it must load
    cases = {}
    for name, (blob, word) in variants.items():
        p = out / f"gguf-{name.replace('^', '')}.gguf"
        p.write_bytes(blob)
        cases[f"gguf:{name}"] = (p, word)
    return cases


def _safetensors_header(tensors: dict[str, dict]) -> bytes:
    h = json.dumps(tensors).encode()
    return U64.pack(len(h)) + h


def _hf_cases(good: Path, out: Path) -> dict[str, tuple[Path, str]]:
    config = json.loads((good / "config.json").read_text())
    st = (good / "model.safetensors").read_bytes()

    def variant(name: str, files: dict[str, bytes]) -> Path:
        d = out / f"hf-{name}"
        shutil.copytree(good, d)
        for fname, blob in files.items():
            (d / fname).write_bytes(blob)
        return d

    def cfg(**changes) -> bytes:
        c = {k: v for k, v in config.items() if changes.get(k, 0) is not None}
        c.update({k: v for k, v in changes.items() if v is not None})
        return json.dumps(c).encode()

    no_layers = {k: v for k, v in config.items() if k != "num_hidden_layers"}
    pickled = out / "pickled.bin"
    torch.save({"model.embed_tokens.weight": torch.zeros(4, 4)}, pickled)
    header_len = U64.unpack(st[:8])[0]
    specs: dict[str, tuple[dict[str, bytes], str]] = {
        "config-a-list": ({"config.json": b"[1, 2, 3]"}, "config.json"),
        "config-not-json": ({"config.json": b"{\"model_type\": "}, "config.json"),
        "config-no-num_hidden_layers": ({"config.json": json.dumps(no_layers).encode()}, "num_hidden_layers"),
        "config-hidden_size-a-string": ({"config.json": cfg(hidden_size="64")}, "hidden_size"),
        "config-num_attention_heads-0": ({"config.json": cfg(num_attention_heads=0)}, "num_attention_heads"),
        "config-num_hidden_layers-1e9": ({"config.json": cfg(num_hidden_layers=10**9)}, "num_hidden_layers"),
        "safetensors-garbage": ({"model.safetensors": random.Random(3).randbytes(5000)}, "safetensors"),
        "safetensors-empty": ({"model.safetensors": b""}, "safetensors"),
        "safetensors-header-1e12": ({"model.safetensors": U64.pack(10**12) + st[8:]}, "header"),
        "safetensors-header-not-json": (
            {"model.safetensors": U64.pack(header_len) + b"\x00\xff" * (header_len // 2) + st[8 + header_len:]},
            "header"),
        "safetensors-tensor-1e12": ({"model.safetensors": _safetensors_header(
            {"model.norm.weight": {"dtype": "F32", "shape": [250_000_000_000], "data_offsets": [0, 10**12]}}
        ) + b"\x00" * 256}, "model.norm.weight"),
        "safetensors-cut-in-data": ({"model.safetensors": st[: 8 + header_len + (len(st) - header_len) // 2]},
                                    "ends"),
        "tokenizer-nonsense": ({"tokenizer.json": b"nonsense {{{"}, "tokenizer.json"),
        "tokenizer-not-a-tokenizer": ({"tokenizer.json": b"{\"hello\": [1, 2]}"}, "tokenizer"),
        "tokenizer_config-not-json": ({"tokenizer_config.json": b"{\"bos_token\": "}, "tokenizer_config.json"),
        "generation_config-a-list": ({"generation_config.json": b"[2]"}, "generation_config.json"),
        "pickle-renamed-safetensors": ({"model.safetensors": pickled.read_bytes()}, "pickle"),
    }
    return {f"hf:{name}": (variant(name, files), word) for name, (files, word) in specs.items()}


@pytest.fixture(scope="module")
def cases(tiny_dir, tmp_path_factory) -> dict[str, tuple[Path, str | None]]:
    """Every case: {id: (model path, a word its error must contain; None for an undamaged control)}."""
    out = tmp_path_factory.mktemp("damaged")
    cases = {"control:gguf": (tiny_dir.gguf, None), "control:hf": (tiny_dir.hf_dir, None)}
    cases |= _gguf_cases(tiny_dir.gguf, out)
    cases |= _hf_cases(tiny_dir.hf_dir, out)
    return cases


@pytest.fixture(scope="module")
def outcomes(cases, tmp_path_factory) -> dict[str, dict]:
    """`info` and `generate` on every case, each in its own forked process: {"<case id> <command>": outcome}."""
    out = tmp_path_factory.mktemp("runs")
    runs = []
    for cid, (path, _) in cases.items():
        common = ["--model", str(path), "--device", "cpu"]
        runs.append({"id": f"{cid} info", "argv": ["info", *common]})
        runs.append({"id": f"{cid} generate", "argv": [
            "generate", *common, "--prompt", "Hello", "--max-new-tokens", "2", "--greedy"]})
    (out / "runs.json").write_text(json.dumps(runs))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "tests.engine.damaged_runner", str(out / "runs.json"),
                    str(out / "results.json")], check=True, cwd=ROOT, env=env, timeout=900)
    results = json.loads((out / "results.json").read_text())
    for run_id, res in results.items():
        res["expect"] = cases[run_id.rsplit(" ", 1)[0]][1]
    return results


def _problems(res: dict) -> list[str]:
    """What is wrong with how a run ended (empty when it ended cleanly)."""
    err = res["stderr"]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    found = []
    if res["timed_out"] or res["wall_s"] > WALL_LIMIT_S:
        found.append(f"ran {res['wall_s']:.0f} s")
    if "Traceback" in err:
        found.append("traceback")
    if res["rc"] < 0:
        found.append(f"killed by signal {-res['rc']}")
    expect = res["expect"]
    if expect is None:  # a control: must work
        if res["rc"] != 0:
            found.append(f"the undamaged model failed: {err.strip()[-300:]}")
        return found
    if res["rc"] == 0 and expect == "":
        return found  # a flipped bit or a possible claim that leaves a loadable model
    if res["rc"] == 0:
        found.append("exit code 0 on a damaged model")
    if len(lines) != 1:
        found.append(f"{len(lines)} lines on stderr")
    elif not lines[0].startswith("error: "):
        found.append(f"not an error line: {lines[0][:200]!r}")
    elif expect.lower() not in lines[0].lower():
        found.append(f"does not name the problem ({expect!r}): {lines[0][:300]!r}")
    return found


def test_every_damaged_model_ends_in_one_clear_line(outcomes):
    bad = {run_id: p for run_id, res in outcomes.items() if (p := _problems(res))}
    n_cases = len(outcomes) // 2
    n_clean = n_cases - len({run_id.rsplit(" ", 1)[0] for run_id in bad})
    report = "\n".join(f"{k}: {'; '.join(v)}" for k, v in sorted(bad.items()))
    assert not bad, f"{n_clean} of {n_cases} cases end cleanly; the others:\n{report}"


def test_controls_and_harness_are_real(outcomes):
    """The undamaged models work through the same runner, and every damaged case was run twice."""
    assert outcomes["control:gguf generate"]["rc"] == 0 and outcomes["control:hf generate"]["rc"] == 0
    assert len(outcomes) >= 2 * 38
    peak = max(res["peak_rss_mb"] for res in outcomes.values())
    assert peak < MEMORY_LIMIT / 2**20


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


@pytest.mark.parametrize("case", ["hf:pickle-renamed-safetensors", "gguf:head_count-0"])
def test_through_a_real_python_m_engine(cases, case):
    """Two cases through a fresh `python -m engine` process, as a user runs it, to anchor the forking runner."""
    path, word = cases[case]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-m", "engine", "generate", "--model", str(path), "--device", "cpu", "--prompt", "Hi",
         "--max-new-tokens", "2"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, preexec_fn=_limit_memory,
    )
    res = {"rc": r.returncode, "stderr": r.stderr, "timed_out": False, "wall_s": 0.0, "expect": word}
    assert not _problems(res), (_problems(res), r.stderr[-500:])

"""`python -m benchmarks.recompute` runs end to end on the tiny model and refuses bad flags in one line."""

from __future__ import annotations

import json
import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.recompute", *args], capture_output=True, text=True,
                          timeout=300)


def test_it_times_each_layer_every_layer_and_the_lens(tiny_dir):
    out = run("--model", str(tiny_dir.gguf), "--tokens", "40", "--repeats", "2", "--threads", "1", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["positions"] == 40 and r["query_position"] == 39 and r["threads"] == 1
    assert set(r["median_ms"]) == {"layer 0", "layer 1", "all 2 layers", "all 2 layers + lens",
                                   "layer 0 after the last one", "the lens after the last layer"}
    assert all(v > 0 for v in r["median_ms"].values()) and len(r["loadavg_after"]) == 3


def test_bad_flags_are_one_line(tiny_dir):
    for args, code, words in ((("--tokens", "1"), 2, "--tokens"), (("--repeats", "x"), 2, "--repeats"),
                              (("--model", str(tiny_dir.gguf), "--tokens", "300"), 1, "context of 256")):
        out = run(*args)
        assert out.returncode == code and words in out.stderr and len(out.stderr.strip().splitlines()) == 1

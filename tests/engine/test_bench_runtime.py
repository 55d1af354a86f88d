"""`python -m benchmarks.runtime` runs the batching and scheduling labs on llama.cpp end to end (as it does on the
8B-shaped file, here on the default model), states each lab's memory before it runs, and refuses a bad --labs in one
line."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.requires import default_model, import_required


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.runtime", *args], capture_output=True, text=True,
                          timeout=600)


def test_the_batching_and_scheduling_labs_run_on_llama_cpp():
    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    default_model()
    out = run("--labs", "batching,schedule", "--model", "smollm2", "--batches", "1,2", "--prompt-tokens", "4",
              "--new-tokens", "3", "--requests", "3", "--max-batch", "2", "--threads", "1")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for b in (1, 2):  # stated before the run: weights + the KV cache of b streams of 7 positions, 256 cells each
        assert re.search(rf"batch {b}, stated before the run: memory on llama\.cpp: .*\({b} × 7 positions .*"
                         rf"{256 * b} cells", text), text
        assert re.search(rf"^llama\.cpp +{b} +\d+\.\d", text, re.M), text
    assert "2 policies × 2 requests: memory on llama.cpp" in text
    for policy in ("static", "continuous"):
        assert re.search(rf"^  {policy} +\d+\.\d\d", text, re.M), text
    assert "continuous / static: TTFT p50" in text and "peak RSS of this process" in text
    assert "speculative" not in text and "llama.cpp pass:" not in text  # only the labs asked for


def test_a_bad_labs_choice_is_one_line():
    out = run("--labs", "batching,nonsense")
    assert out.returncode == 2 and "nonsense" in out.stderr
    assert "passes, batching, plain, speculative, schedule" in out.stderr  # the choices, named
    assert out.stderr.strip().splitlines()[-1].startswith("python -m benchmarks.runtime: error:")

"""Nonsense a user can type into `python -m engine`: every command's numbers and names, each refused in one line on
stderr with exit status 2 (argparse's status for a bad command line), no traceback, in bounded time.

The commands run in this process through engine.__main__.main, in a thread with a hang guard; stderr is captured at
the file descriptor, so a native library writing there directly counts too. Values wrong by themselves are refused
by the parser before any model loads; values wrong only for the model (a step past its context, a token past its
vocabulary) are refused once the tiny test model is loaded, before any generation starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 60.0  # far beyond what a refusal takes; a command still running then has hung
URL = "http://127.0.0.1:9"  # nothing listens there; a refused command line never connects
HUGE = "1180591620717411303424"  # 2**70

# Values refused by the parser alone: no model is read. One row per (command, flag, kind of nonsense).
PARSE: list[tuple[str, ...]] = [
    ("frobnicate",),
    ("info", "--device", "tpu"),
    ("info", "--dtype", "float8"),
    ("info", "--backend", "vllm"),
    ("models", "--dtype", "int4"),
    ("kernels", "--dtype", "float8"),
    ("generate", "--prompt", "x", "--kernel", "bogus"),
    ("tokenize", "--text", "hi", "--timeout", "nan"),
    # logits: --top and the sampling flags every generating command shares
    ("logits", "--prompt", "x", "--top", "-4"),
    ("logits", "--prompt", "x", "--top", "0"),
    ("logits", "--prompt", "x", "--top", HUGE),
    ("logits", "--prompt", "x", "--top-k", "-1"),
    ("logits", "--prompt", "x", "--top-k", HUGE),
    ("logits", "--prompt", "x", "--temperature", "nan"),
    ("logits", "--prompt", "x", "--temperature", "inf"),
    ("logits", "--prompt", "x", "--temperature", "-1"),
    ("logits", "--prompt", "x", "--top-p", "0"),
    ("logits", "--prompt", "x", "--top-p", "nan"),
    ("logits", "--prompt", "x", "--top-p", "1.5"),
    ("logits", "--prompt", "x", "--min-p", "1"),
    ("logits", "--prompt", "x", "--min-p", "nan"),
    ("logits", "--prompt", "x", "--min-p", "-0.1"),
    ("logits", "--prompt", "x", "--repetition-penalty", "0"),
    ("logits", "--prompt", "x", "--repetition-penalty", "nan"),
    ("logits", "--prompt", "x", "--repetition-penalty", "inf"),
    ("logits", "--prompt", "x", "--logit-bias", "7042=nan"),
    ("logits", "--prompt", "x", "--logit-bias", "7042=-inf"),
    ("logits", "--prompt", "x", "--logit-bias", "7042=1e400"),
    ("logits", "--prompt", "x", "--logit-bias", "-1=5"),
    ("logits", "--prompt", "x", "--logit-bias", f"{HUGE}=1"),
    ("logits", "--prompt", "x", "--logit-bias", "7042"),
    ("logits", "--prompt", "x", "--seed", "-1"),
    ("logits", "--prompt", "x", "--threads", "0"),
    ("logits", "--prompt", "x", "--threads", "-2"),
    ("logits", "--prompt", "x", "--threads", "99999"),
    ("logits", "--prompt", "x", "--threads", "nan"),
    ("logits", "--prompt", "x", "--url", URL, "--temperature", "nan"),
    # generate
    ("generate", "--prompt", "x", "--seed", HUGE),
    ("generate", "--prompt", "x", "--max-new-tokens", "0"),
    ("generate", "--prompt", "x", "--max-new-tokens", "-5"),
    ("generate", "--prompt", "x", "--max-new-tokens", HUGE),
    ("generate", "--prompt", "x", "--regex", "[a-"),
    ("generate", "--prompt", "x", "--regex", "(a"),
    ("generate", "--prompt", "x", "--regex", "(?<=a)b"),
    ("generate", "--prompt", "x", "--regex", "a", "--json-schema", "s.json"),
    ("generate", "--prompt", "x", "--force", "zero:one"),
    ("generate", "--prompt", "x", "--force", "-1:5"),
    ("generate", "--prompt", "x", "--url", "not a url"),
    ("generate", "--prompt", "x", "--url", "http://127.0.0.1:99999"),
    ("tokenize", "--text", "x", "--url", "ftp://x"),
    ("serve-bench", "--url", "http://[::1"),
    ("generate", "--prompt", "x", "--url", URL, "--timeout", "0"),
    ("generate", "--prompt", "x", "--url", URL, "--timeout", "inf"),
    ("generate", "--prompt", "x", "--url", URL, "--timeout", "-3"),
    # lens
    ("lens", "--prompt", "x", "--step", "-1"),
    ("lens", "--prompt", "x", "--step", HUGE),
    ("lens", "--prompt", "x", "--top", "0"),
    ("lens", "--prompt", "x", "--url", URL),
    ("info", "--url", URL),
    # bench-batch
    ("bench-batch", "--batches", "0,1"),
    ("bench-batch", "--batches", ""),
    ("bench-batch", "--batches", "1,x"),
    ("bench-batch", "--batches", HUGE),
    ("bench-batch", "--prompt-tokens", "0"),
    ("bench-batch", "--new-tokens", "1"),
    ("bench-batch", "--threads", "0"),
    # estimate
    ("estimate", "--context", "-5"),
    ("estimate", "--batch", "0"),
    ("estimate", "--context", "9" * 400),
    ("estimate", "--batch", HUGE),
    ("estimate", "--prompt-tokens", "0"),
    ("estimate", "--dtype", "nan"),
    ("estimate", "--hardware", "bogus"),
    ("estimate", "--preset", "bogus"),
    # export-hf
    ("export-hf", "--out", "/nonexistent-inference-lab/sub/out"),
    ("export-hf", "--out", "/etc/hostname/out"),
    ("export-hf", "--out", ""),
    ("export-hf", "--out", "/etc/hostname"),
    # serve-bench
    ("serve-bench",),
    ("serve-bench", "--url", URL, "--concurrency", "0"),
    ("serve-bench", "--url", URL, "--concurrency", "100000"),
    ("serve-bench", "--url", URL, "--num-prompts", "0"),
    ("serve-bench", "--url", URL, "--num-prompts", HUGE),
    ("serve-bench", "--url", URL, "--max-new-tokens", "0"),
    ("serve-bench", "--url", URL, "--request-rate", "nan"),
    ("serve-bench", "--url", URL, "--request-rate", "0"),
    ("serve-bench", "--url", URL, "--burstiness", "0"),
    ("serve-bench", "--url", URL, "--burstiness", "inf"),
    ("serve-bench", "--url", URL, "--time-limit", "inf"),
    ("serve-bench", "--url", URL, "--time-limit", "0"),
    ("serve-bench", "--url", URL, "--slo-ttft-ms", "-1"),
    ("serve-bench", "--url", URL, "--slo-tpot-ms", "nan"),
    ("serve-bench", "--url", URL, "--seed", "-1"),
    ("serve-bench", "--url", URL, "--out", "/nonexistent-inference-lab/runs.json"),
    # speculate
    ("speculate", "--prompt", "x", "--backend", "llama.cpp", "--k", "17"),
    ("speculate", "--prompt", "x", "--url", URL),
    ("speculate", "--prompt", "x", "--k", "0"),
    ("speculate", "--prompt", "x", "--k", "17"),
    ("speculate", "--prompt", "x", "--k", HUGE),
    ("speculate", "--prompt", "x", "--source", "bogus"),
    ("speculate", "--prompt", "x", "--source", "early-exit:0"),
    ("speculate", "--prompt", "x", "--draft", "exit:x"),
    ("speculate", "--prompt", "x", "--ngram", "0"),
    ("speculate", "--prompt", "x", "--max-new-tokens", "0"),
    ("speculate", "--prompt", "x", "--seed", HUGE),
    # schedule
    ("schedule", "--rate", "nan"),
    ("schedule", "--rate", "0"),
    ("schedule", "--rate", "-1"),
    ("schedule", "--burstiness", "inf"),
    ("schedule", "--burstiness", "0"),
    ("schedule", "--requests", "0"),
    ("schedule", "--requests", HUGE),
    ("schedule", "--prompt-len", "0"),
    ("schedule", "--output-len", "-1"),
    ("schedule", "--range-ratio", "1"),
    ("schedule", "--range-ratio", "nan"),
    ("schedule", "--max-batch", "0"),
    ("schedule", "--max-batch", "100000"),
    ("schedule", "--page-size", "0"),
    ("schedule", "--page-size", "5000"),
    ("schedule", "--kv-budget-mib", "nan"),
    ("schedule", "--kv-budget-mib", "-1"),
    ("schedule", "--seed", "-1"),
    ("schedule", "--threads", "0"),
]

# Values wrong only for the model loaded (the tiny one: 256 positions, 300 tokens).
ON_THE_MODEL: list[tuple[str, ...]] = [
    ("lens", "--prompt", "hi", "--step", "99999"),
    ("lens", "--prompt", "hi", "--step", "254"),
    ("logits", "--prompt", "hi", "--logit-bias", "5000=1"),
    ("generate", "--prompt", "hi", "--logit-bias", "300=-5"),
    ("generate", "--prompt", "hi", "--force", "0:5000"),
    ("generate", "--prompt", "hi", "--force", "9:5", "--max-new-tokens", "4"),
    ("speculate", "--prompt", "hi", "--logit-bias", "300=1"),
]


def run(argv: list[str], capfd) -> tuple[int, str, float]:
    """(exit status, stderr, seconds) of `python -m engine ARGV`, run here with a hang guard."""
    result: list[object] = []

    def work() -> None:
        try:
            result.append(main(argv))
        except SystemExit as e:
            result.append(e.code)
        except BaseException as e:  # noqa: BLE001 — a traceback the user would see: reported below
            result.append(e)

    t0 = time.monotonic()
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    seconds = time.monotonic() - t0
    assert not thread.is_alive(), f"still running after {HANG_GUARD_S:.0f} s: {argv}"
    (code,) = result
    assert not isinstance(code, BaseException), f"{argv} raised {code!r}"
    return code, capfd.readouterr().err, seconds


def check_refused(code, err: str, argv) -> None:
    lines = err.strip().splitlines()
    assert code == 2, (argv, code, err)
    assert len(lines) == 1, (argv, err)
    assert "Traceback" not in err and lines[0].strip(), (argv, err)


@pytest.mark.parametrize("argv", PARSE, ids=" ".join)
def test_nonsense_is_refused_in_one_line(argv, capfd):
    code, err, _ = run(list(argv), capfd)
    check_refused(code, err, argv)


@pytest.mark.parametrize("argv", ON_THE_MODEL, ids=" ".join)
def test_values_the_model_cannot_take_are_refused_before_running(argv, tiny_dir, capfd):
    common = ["--model", str(tiny_dir.gguf), "--device", "cpu", "--dtype", "float32", "--threads", "1"]
    code, err, _ = run([*argv, *common], capfd)
    check_refused(code, err, argv)


def test_the_messages_say_what_is_wrong(tiny_dir, capfd):
    """The refusals a user meets first, worded so that the fix is plain."""
    code, err, _ = run(["generate", "--prompt", "x", "--seed", HUGE], capfd)
    assert "--seed" in err and "from 0 to" in err
    code, err, _ = run(["generate", "--prompt", "x", "--regex", "[a-"], capfd)
    assert "unclosed character class" in err and "'[a-'" in err
    code, err, _ = run(["export-hf", "--out", "/nonexistent-inference-lab/sub/out"], capfd)
    assert "'/nonexistent-inference-lab/sub' is no folder that exists" in err
    code, err, _ = run(["lens", "--prompt", "hi", "--step", "99999", "--model", str(tiny_dir.gguf), "--device",
                              "cpu", "--dtype", "float32", "--threads", "1"], capfd)
    assert code == 2 and "past this model's context" in err and "steps 0 to 253 of 256" in err


def test_the_last_step_the_context_holds_is_not_refused(tiny_dir, capfd):
    """The bound on --step is the context's, not a tighter one: step 253 after 2 prompt tokens fills position 255."""
    code, err, _ = run(["lens", "--prompt", "hi", "--step", "253", "--json", "--model", str(tiny_dir.gguf), "--device",
                        "cpu", "--dtype", "float32", "--threads", "1", "--temperature", "0"], capfd)
    assert code != 2 and "past this model's context" not in err, err  # 1: the random model may end its text first


def test_export_overwrite_replaces_only_an_earlier_export(tmp_path, capfd):
    """`--out ~ --overwrite` (a slip) must not delete a folder of the user's: only one holding an export."""
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    code, err, _ = run(["export-hf", "--out", str(tmp_path), "--overwrite"], capfd)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "no earlier export" in err, err
    assert mine.read_text() == "mine"


@pytest.mark.parametrize("argv", [
    ("generate", "--prompt", "x", "--seed", HUGE),
    ("generate", "--prompt", "x", "--regex", "[a-"),
    ("logits", "--prompt", "x", "--top", "-4"),
])
def test_a_real_python_m_engine_says_one_line(argv):
    """Through a fresh process as a user runs it: nothing else (a native library's log) reaches stderr."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "engine", *argv], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=120)
    check_refused(r.returncode, r.stderr, argv)

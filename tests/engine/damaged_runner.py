"""Run `python -m engine …` command lines in forked children of one interpreter, each with a memory limit.

Usage: python -m tests.engine.damaged_runner RUNS.json RESULTS.json
RUNS.json is a list of {"id": str, "argv": [str, …]}; RESULTS.json gets, per run, its exit code, stderr, wall time
and peak resident memory.

Why forks: on a busy 2-core machine a fresh `python -m engine` spends ~5 s importing torch, so ~80 runs would take
minutes. This runner imports the engine once and forks a child per run; the child does exactly what the
interpreter does for `python -m engine ARGV` (engine/__main__.py calls `sys.exit(main())`; an exception that
escapes is printed as a traceback with exit code 1). The parent never runs a torch operation, so no thread pool
exists at the fork. tests/engine/test_damaged_inputs.py also runs a few cases through a real `python -m engine`.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
import traceback
from pathlib import Path

MEMORY_LIMIT = 3 * 2**30  # bytes of address space per run (RLIMIT_AS)
TIMEOUT_S = 30.0


def _child(argv: list[str], out: Path, err: Path) -> None:
    from engine.__main__ import main

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 — what the interpreter does with an exception that escapes
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(rc or 0) & 0xFF)


def run(argv: list[str], workdir: Path, tag: str) -> dict:
    out, err = workdir / f"{tag}.out", workdir / f"{tag}.err"
    sys.stdout.flush()
    sys.stderr.flush()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            _child(argv, out, err)
        finally:
            os._exit(120)
    timed_out = False
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.perf_counter() - t0 > TIMEOUT_S:
            os.kill(pid, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
            timed_out = True
            break
        time.sleep(0.01)
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    return {
        "rc": rc, "wall_s": wall, "timed_out": timed_out, "peak_rss_mb": usage.ru_maxrss / 1024,
        "stderr": err.read_text(errors="replace") if err.exists() else "",
    }


def main() -> None:
    runs = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(sys.argv[2]).parent
    import engine.__main__  # noqa: F401 — imports paid once, before the forks
    import engine.loaders
    import engine.loaders.gguf
    import engine.loaders.hf
    import engine.run.session  # noqa: F401

    results = {r["id"]: run(r["argv"], workdir, f"run{i}") for i, r in enumerate(runs)}
    Path(sys.argv[2]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()

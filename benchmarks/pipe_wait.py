"""How long the engine waits to hand a step's events to the app when the app's GUI thread is busy (issue 26: the
app's TPOT grew faster with the context than the CLI's).

The engine sends each step's events through a pipe; the app's relay thread reads them, and needs the GIL for each
chunk it reads, which the GUI thread holds while it draws. A pipe holds 64 KiB on Linux unless widened, so a step
whose events are larger (a 30-layer model's attention row of one layer at 8,000 keys is 288 KB, and the logits
another 196 KB) cannot be written until the relay has read most of it: the engine's decode loop waits on the GUI.

`python -m benchmarks.pipe_wait [--steps N] [--kib K,K] [--busy-ms B] [--idle-ms I]` runs a stand-in of each side:
an engine process that computes for `--compute-ms` (sleeping, as torch's kernels leave the GIL free) and then sends
one message of K KiB, N times; and this process, whose relay thread receives while its main thread holds the GIL in
Python for B ms out of every B + I ms (a draw). It prints, for each size, the engine's mean wait per send with the
pipe as the system makes it and widened to its maximum (/proc/sys/fs/pipe-max-size), and their ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time

import numpy as np

from app.bridge import widen_pipe


def _engine(conn, steps: int, kib: int, compute_s: float, out) -> None:
    payload = {"weights": np.ones(kib * 256, dtype=np.float32)}  # kib KiB of float32
    waited = 0.0
    for _ in range(steps):
        time.sleep(compute_s)
        t0 = time.perf_counter()
        conn.send(payload)
        waited += time.perf_counter() - t0
    conn.send(None)
    out.put(waited / steps)


def measure(kib: int, steps: int, widen: bool, busy_s: float, idle_s: float, compute_s: float) -> float:
    """The engine stand-in's mean seconds per send."""
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    if widen:
        widen_pipe(recv)
    out = ctx.Queue()
    p = ctx.Process(target=_engine, args=(send, steps, kib, compute_s, out))
    p.start()
    send.close()
    done = threading.Event()

    def relay() -> None:
        while recv.recv() is not None:
            pass
        done.set()

    threading.Thread(target=relay, daemon=True).start()
    while not done.is_set():
        t0 = time.perf_counter()
        x = 0
        while time.perf_counter() - t0 < busy_s:  # a draw: Python holding the GIL
            x += 1
        time.sleep(idle_s)
    p.join()
    return out.get()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pipe_wait", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--kib", default="32,256,512")
    ap.add_argument("--busy-ms", type=float, default=20.0)
    ap.add_argument("--idle-ms", type=float, default=30.0)
    ap.add_argument("--compute-ms", type=float, default=50.0)
    a = ap.parse_args(argv)
    print(f"engine stand-in: {a.compute_ms:g} ms of compute then one send, {a.steps} times; GUI thread busy "
          f"{a.busy_ms:g} ms of every {a.busy_ms + a.idle_ms:g} ms; mean wait per send:")
    for kib in (int(k) for k in a.kib.split(",")):
        plain = measure(kib, a.steps, False, a.busy_ms / 1e3, a.idle_ms / 1e3, a.compute_ms / 1e3)
        wide = measure(kib, a.steps, True, a.busy_ms / 1e3, a.idle_ms / 1e3, a.compute_ms / 1e3)
        print(f"  {kib:5d} KiB: pipe as made {plain * 1e3:6.2f} ms, widened {wide * 1e3:6.2f} ms "
              f"({plain / max(wide, 1e-9):.1f} ×)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

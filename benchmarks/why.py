"""What the why-experiments cost on the default model: `python -m benchmarks.why [--threads N] [--repeats R]`, and
`python -m benchmarks.why --gui`: the app's GUI thread while the Why panel runs its default patching grid.

Prints the machine (CPU model, the kernel set ATen dispatches to, cores, load average), then the median seconds of
  - the head-role scan (engine.why.heads.head_roles: one prefill of 48 tokens with every layer's attention captured);
  - the layer × position patching grid (engine.why.patch.patch) on a 12-token prompt pair, the residual stream only,
    and with the layer × head grid as well; each with its number of forwards and seconds per forward;
  - the induction check (--ablate-top 3: three forwards of the 48-token sequence, with and without ablation).
SmolLM2 float32 on the torch engine (patching edits the forward pass, which only that engine allows).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

CLEAN = "The Eiffel Tower is a famous landmark in the city of"  # 12 tokens on SmolLM2, as is the corrupted one
CORRUPT = "The Colosseum is a famous landmark in the city of"
ANSWER, WRONG = " Paris", " Rome"


def machine() -> str:
    """CPU model, ATen's kernel set (its flags class: DEFAULT, AVX2, AVX512, …), cores and load."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}; ATen kernels {torch.backends.cpu.get_cpu_capability()}; {len(os.sched_getaffinity(0))} cores; "
            f"torch {torch.__version__}; {torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.1f}")


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of `repeats` calls, and the last call's result."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def gui() -> int:
    """The window as users run it (settings on, every panel laid out), the Why panel's default patching grid run in
    the engine process, and the GUI thread probed by a 10 ms timer: a stall is a gap between its ticks minus 10 ms."""
    import tempfile

    import numpy as np

    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    with tempfile.TemporaryDirectory(prefix="ilab-bench-why-") as settings_dir:
        os.environ["INFERENCE_LAB_SETTINGS"] = os.path.join(settings_dir, "inference-lab.ini")
        from PySide6 import QtCore

        from benchmarks.gui import TickProbe, open_window, show_every_panel

        app, win = open_window(None)
        if win is None:
            return 1
        show_every_panel(win)
        panel = win.panels["why"]
        panel.set_mode("patch")
        probe = TickProbe()
        loop, done = QtCore.QEventLoop(), []
        win.bridge.sig_why_done.connect(lambda ev: (done.append(ev), loop.quit()))
        probe.start()
        t0 = time.perf_counter()
        if not panel.run():
            return 1
        loop.exec()
        seconds = time.perf_counter() - t0
        probe.stop()
        stalls = probe.stalls()
        ev = done[0]
        print(machine(), flush=True)
        print(f"Why panel, patching (its default prompts), {'done' if ev.result else ev.failure or 'cancelled'} in "
              f"{seconds:.1f} s; GUI stall p99 {np.percentile(stalls, 99):.1f} ms, worst {stalls.max():.0f} ms "
              f"({len(probe.gaps)} ticks)", flush=True)
        win.close()
        app.processEvents()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.why")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the median is printed")
    p.add_argument("--gui", action="store_true", help="the app's GUI stalls while the Why panel patches")
    a = p.parse_args(argv)
    if a.gui:
        return gui()
    import torch

    from engine.loaders import load
    from engine.run.session import Session
    from engine.why.heads import confirm_induction, head_roles
    from engine.why.patch import patch

    torch.set_num_threads(a.threads)
    s = Session(load(None, device="cpu", dtype="float32"), threads=a.threads)
    cfg = s.cfg
    print(machine(), flush=True)
    print(f"SmolLM2-135M float32: {cfg.n_layers} layers, {cfg.n_heads} heads; medians of {a.repeats} runs",
          flush=True)
    s.warm_up()

    scan_s, roles = timed(lambda: head_roles(s, repeat=24, seed=0), a.repeats)
    print(f"head-role scan, {len(roles['tokens'])} tokens, every layer's attention: {scan_s:.2f} s", flush=True)
    check_s, ab = timed(lambda: confirm_induction(s, roles, 3), a.repeats)
    print(f"induction check (--ablate-top 3: 3 forwards of {len(roles['tokens'])} tokens): {check_s:.2f} s "
          f"(loss {ab['loss']:.3f} -> {ab['loss_ablated']:.3f} nats)", flush=True)
    for heads in (False, True):
        secs, out = timed(lambda h=heads: patch(s, CLEAN, CORRUPT, ANSWER, WRONG, heads=h), a.repeats)
        T = len(out["tokens"]["clean"])
        what = f"{cfg.n_layers + 1} × {T} residual grid" + (f" + {cfg.n_layers} × {cfg.n_heads} heads" if heads else "")
        print(f"patching, {what}: {secs:.2f} s, {out['forwards']} forwards, {secs / out['forwards'] * 1e3:.0f} ms each",
              flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Steering on llama.cpp, its control-vector adapter against the intervention seam, in one run:
`python -m benchmarks.steer_llamacpp [--model PATH] [--tokens 64] [--rounds 5] [--threads N] [--layers 6,9,12]`.

Issue 46 asks to steer on llama.cpp "through its control-vector adapter or the seam, whichever the measurement
favours". This prints the decode TPOT (the median decode step of LlamaCppSession.generate, greedy, a fixed number
of tokens) of the default model (SmolLM2-135M Q4_1) five ways:
  plain     no steering (the graph callback answers "no" to every node);
  seam      the session's graph callback adds v × scale into l_out-L of each steered layer
            (LlamaCppSession.intervened(…, adapter=False)), so the scheduler stops at those nodes and hands them to
            Python every step;
  adapter   engine.why.steer.steering, which on llama.cpp sets llama_set_adapter_cvec on the session's own context
            (engine.backends.llamacpp_seam.AdapterSteer): llama.cpp adds direction.L in the graph itself (build_cvec,
            just before l_out-L), no callback;
  seam-live, adapter-live   the same with the scale moved after every token (a slider dragged through the whole
            generation): Steering.set_scale writes the tensors the callback adds, while the adapter's buffer is set
            again before the next step, after which llama.cpp reserves its scheduler anew;
and the median CPU time of the calling thread per token (on a shared machine the wall time of a step includes the
time other processes held the cores; the CPU time does not. With --threads 1 ggml computes on the calling thread,
so it is the whole step's work; with more, the other threads' share is left out), with the ratios between them,
and whether the seam and the adapter generated the same tokens, at a fixed and at a moving scale (they add the
same vector at the same node, so they should). The vector is the engine's mean difference of a few contrast pairs
at --layers, built through the seam on the same session.

The rounds are interleaved (each round runs every configuration, in an order rotated by one each round) so slow
drifts of a shared machine fall on all of them; each configuration's figure is the median of its rounds' median
steps. The header names the CPU (model name, family/model), the cores this process may use, llama.cpp's threads and
the load average, which is printed again at the end.

Measured on an AMD EPYC (family 25, model 17: Zen 4), 2 cores, quiet, 3 layers, 64 tokens: with 2 threads plain
7.99 ms, seam 9.03 (× 1.13), adapter 8.05 (× 1.01), seam-live 8.94, adapter-live 10.82 (the scheduler's reserve
after each set costs ~3 ms); with 1 thread (3-configuration run) plain 13.54, seam 14.41 (× 1.06), adapter 13.39.
So the adapter favours a fixed scale, the seam a scale moved at every token; both give the same tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

PROMPT = "Write a short story about a lighthouse keeper."
PAIRS = (("I love this", "I hate this"), ("What a wonderful day", "What a terrible day"),
         ("This is great news", "This is awful news"))
CONFIGS = ("plain", "seam", "adapter", "seam-live", "adapter-live")


def machine() -> str:
    """CPU model name with its family/model numbers, cores this process may use, load average."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name", "unknown CPU")
    family, model = fields.get("cpu family"), fields.get("model")
    ident = f" (family {family}, model {model})" if family and model else ""
    return f"{name}{ident}; {len(os.sched_getaffinity(0))} cores; load average {os.getloadavg()[0]:.2f}"


@contextlib.contextmanager
def seam(session, vector, scale: float):
    """The vector added through the session's graph callback (the seam's Writes), not the adapter the engine picks for
    steering on llama.cpp; the KV cache forgotten on entry and exit, as engine.why.steer.steering does."""
    from engine.why.steer import Steering

    handle = Steering(vector, scale)
    session.forget_cache()
    try:
        with session.intervened(handle.edits(), adapter=False):
            yield handle
    finally:
        session.forget_cache()


def generate(session, tokens: int, knob=None, scale: float = 1.0) -> tuple[float, float, list[int]]:
    """A greedy generation of `tokens` tokens: its median decode step (wall seconds), the median CPU seconds of
    this thread between two tokens after the first (the decode step, and the loop around it), and the tokens. With
    a `knob` (a steering handle: engine.why.steer.Steering), the scale is moved after every token, to 1.1 × and
    0.9 × `scale` in turn."""
    from engine.events import Finished, TokenSampled
    from engine.protocol import SamplingParams

    ids, steps, cpu = [], None, []
    for e in session.generate(PROMPT, SamplingParams(temperature=0.0), tokens, ignore_eos=True):
        if isinstance(e, TokenSampled):
            ids.append(e.token_id)
            if knob is not None:
                knob.set_scale(scale * (1.1 if len(ids) % 2 else 0.9))
            cpu.append(time.thread_time())
        elif isinstance(e, Finished):
            steps = list(e.step_seconds)
    if not steps or len(cpu) < 3:
        raise RuntimeError("the generation ended without its step times")
    return statistics.median(steps), statistics.median(b - a for a, b in itertools.pairwise(cpu[1:])), ids


def run(a: argparse.Namespace) -> int:
    from engine.backends.llamacpp import LlamaCppSession
    from engine.why.steer import Pair, build, steering

    session = LlamaCppSession(a.model, threads=a.threads)
    try:
        vector = build(session, [Pair(p, n) for p, n in PAIRS], a.layers)
        ways: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
            "plain": contextlib.nullcontext,
            "seam": lambda: seam(session, vector, a.scale),
            "adapter": lambda: steering(session, vector, a.scale),  # what the engine does on llama.cpp
        }
        print(machine(), flush=True)
        print(f"{session.info.name} ({session.info.file_type}), llama.cpp {session.n_threads} threads; steered at "
              f"blocks {', '.join(map(str, vector.layers))} × {a.scale:g}; {a.tokens} tokens, {a.rounds} interleaved "
              f"rounds; decode TPOT = median step", flush=True)

        def once(name: str, tokens: int) -> tuple[float, float, list[int]]:
            with ways[name.removesuffix("-live")]() as knob:
                return generate(session, tokens, knob if name.endswith("-live") else None, a.scale)

        for name in CONFIGS:  # first-call costs (graph allocation and reservation, thread start) are not TPOT
            once(name, 4)
        tpot: dict[str, list[float]] = {c: [] for c in CONFIGS}
        cpu: dict[str, list[float]] = {c: [] for c in CONFIGS}
        out: dict[str, list[int]] = {}
        for r in range(a.rounds):
            k = r % len(CONFIGS)
            for name in CONFIGS[k:] + CONFIGS[:k]:
                step, cpu_step, ids = once(name, a.tokens)
                tpot[name].append(step)
                cpu[name].append(cpu_step)
                out.setdefault(name, ids)
        med = {c: statistics.median(v) for c, v in tpot.items()}
        med_cpu = {c: statistics.median(v) for c, v in cpu.items()}
        print(f"  {'config':<13} {'TPOT ms':>8} {'min ms':>7} {'max ms':>7} {'tok/s':>7} {'CPU ms/token':>13}")
        for c in CONFIGS:
            print(f"  {c:<13} {med[c] * 1e3:8.2f} {min(tpot[c]) * 1e3:7.2f} {max(tpot[c]) * 1e3:7.2f} "
                  f"{1 / med[c]:7.1f} {med_cpu[c] * 1e3:13.2f}")
        for x, y in (("seam", "plain"), ("adapter", "plain"), ("seam", "adapter"), ("seam-live", "adapter-live")):
            print(f"  {x + ' / ' + y:<27} TPOT {med[x] / med[y]:.3f}   CPU {med_cpu[x] / med_cpu[y]:.3f}")
        same = out["seam"] == out["adapter"] and out["seam-live"] == out["adapter-live"]
        print(f"  seam and adapter generated the same {a.tokens} tokens (fixed and moving scale): "
              f"{'yes' if same else 'no'}; steered {'differs from' if out['seam'] != out['plain'] else 'equals'} plain")
        print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        session.close()
    return 0


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes block indices such as 6,9,12, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model, SmolLM2 Q4_1)")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per run")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the configurations")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--layers", type=_layers, default=[6, 9, 12], help="blocks steered")
    p.add_argument("--scale", type=float, default=1.0, help="the multiplier of the mean-difference vector")


def add_subcommand(sub) -> None:
    """`python -m benchmarks steer-llamacpp`, for benchmarks/__main__.py's registry."""
    p = sub.add_parser("steer-llamacpp", help="decode TPOT on llama.cpp: unsteered, steered through the seam, "
                                              "steered through llama.cpp's control-vector adapter")
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.steer_llamacpp", description=__doc__.split("\n\n")[1])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""The labs on both runtimes, in one run: `python -m benchmarks.runtime [--model smollm2|1b|8b] [--batches 1,4,8]
[--labs passes,batching,plain,speculative,schedule]`.

For the model it prints
  - llama.cpp passes of 1 sequence × 1 token, 1 sequence × B tokens and B sequences × 1 token (B the largest batch);
  - the torch runtime's decode step (paged cache) over the model's contiguous-cache step (Session's path);
  - batched decode (engine.labs.batching.bench_batch) on the torch runtime (float32; left out for `1b`) and on the
    llama.cpp runtime: TPOT and system tokens/s at each batch, the llama.cpp / torch TPOT ratio and each runtime's
    system tokens/s at batch B over batch 1;
  - the batching lab's batch-1 TPOT on llama.cpp over a plain generation's (LlamaCppSession.generate) on the file;
  - speculative decoding on llama.cpp (prompt lookup, k = 4, greedy, 48 new tokens) against plain decoding of the
    same prompt in the same run: tokens per pass, the speedup, and whether the tokens are the same.
  - (`schedule`, not in the default set) the scheduling lab (engine.labs.scheduler.schedule) on llama.cpp: static
    and continuous batching of the same few requests, TTFT / TPOT / end-to-end p50, system tokens/s and the KV
    cache's peak bytes as pages against contiguous reservations.
Before each lab it prints the memory the lab states it will hold (engine.costs.memory.lab_memory, the line the app's
panels show), and at the end the process's peak RSS (llama.cpp maps the file, so its pages count once touched).
`1b` is benchmarks.llamacpp's 1B-scale Llama-shaped Q4_0 file of random weights, `8b` its file of Llama 3.1 8B's
shapes in Q4_K_M (about 4.2 GiB; both built once). On the 8B file the issue asks that the batching and scheduling
labs run on a 24 GB machine: `--model 8b --labs batching,schedule --batches 1,2,4 --prompt-tokens 8
--new-tokens 4 --requests 4 --max-batch 2`.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

CODE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n\n"
        "def div(a, b):")  # text that repeats itself, as issue 19's speculative figures used


def paged_over_contiguous(lm, steps: int = 12) -> tuple[float, float]:
    """Median decode step (s) of one sequence after a 32-token prompt: the torch runtime's paged cache, then the
    model's contiguous KVCache (Session's path); the two alternate, a step each."""
    import numpy as np
    import torch

    from engine.model.kv_cache import KVCache
    from engine.runtime import Row
    from engine.runtime.torch import TorchRuntime

    ids = list(range(100, 132))
    rt, cache = TorchRuntime(lm, 1, 64), KVCache(lm.cfg, 1, 64, lm.dtype)
    a = int(rt.forward([Row(0, ids)])[0].argmax())
    with torch.inference_mode():
        b = int(lm.model(torch.tensor([ids]), cache)[0].argmax())
    times = np.zeros((steps, 2))
    for i in range(steps):
        t0 = time.perf_counter()
        a = int(rt.forward([Row(0, [a])])[0].argmax())
        t1 = time.perf_counter()
        with torch.inference_mode():
            b = int(lm.model(torch.tensor([[b]]), cache)[0].argmax())
        times[i] = t1 - t0, time.perf_counter() - t1
    return tuple(np.median(times, axis=0))


def pass_shapes(lcpp, n: int = 8, repeats: int = 4) -> tuple[float, float, float]:
    """Median seconds of llama.cpp forward passes: 1 sequence × 1 token, 1 sequence × n tokens, n sequences × 1
    token (one llama_batch): whether a batch costs what its rows cost together, or less."""
    import numpy as np

    from engine.runtime import Row
    from engine.runtime.llamacpp import LlamaCppRuntime

    with LlamaCppRuntime(lcpp, n, 4 + (n + 1) * repeats) as rt:
        rt.forward([Row(i, [100 + i] * 4) for i in range(n)])
        shapes = ([Row(0, [300])], [Row(1, [400] * n)], [Row(j, [200]) for j in range(n)])
        times = np.zeros((repeats, 3))
        for i in range(repeats):
            for j, rows in enumerate(shapes):
                t0 = time.perf_counter()
                rt.forward(rows)
                times[i, j] = time.perf_counter() - t0
    return tuple(np.median(times, axis=0))


LABS = ("passes", "batching", "plain", "speculative", "schedule")
DEFAULT_LABS = "passes,batching,plain,speculative"


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def model_path(name: str) -> Path:
    """The GGUF for --model: the default model's, or benchmarks.llamacpp's random-weight file (built if absent)."""
    if name == "smollm2":
        from engine.formats.locate import default_model_path

        return default_model_path()
    from benchmarks.llamacpp import big_path, build_big

    quant = "Q4_K_M" if name == "8b" else "Q4_0"  # the 8B file is what LM Studio and Ollama offer
    path = big_path(quant, name)
    if not path.exists():
        t0 = time.perf_counter()
        build_big(path, quant, shape=name)
        print(f"built {path.name} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s")
    return path


def schedule_lab(lcpp, a: argparse.Namespace, limit: float) -> None:
    """Static against continuous batching of the same requests on llama.cpp (engine.labs.scheduler.schedule, as
    `python -m engine schedule` and the app's panel run it), with the memory the lab states beforehand."""
    from engine.costs.memory import lab_memory, size
    from engine.labs.scheduler import SchedConfig, SchedSummary, schedule

    cfg = SchedConfig(n_requests=a.requests, rate=a.rate, prompt_len=a.prompt_tokens, output_len=a.new_tokens,
                      range_ratio=a.range_ratio, max_batch=a.max_batch)
    mem = lab_memory(lcpp.info, lcpp.cfg, "llama.cpp", len(cfg.policies()) * cfg.max_batch, cfg.longest(),
                     pooled=True, page_size=cfg.page_size)
    lo, hi = cfg.length_range(cfg.prompt_len), cfg.length_range(cfg.output_len)
    print(f"scheduling lab: {cfg.n_requests} requests at {cfg.rate:g}/s, prompts {lo[0]}–{lo[1]}, outputs "
          f"{hi[0]}–{hi[1]} tokens, max batch {cfg.max_batch}; stated before the run: {len(cfg.policies())} "
          f"policies × {cfg.max_batch} requests: {mem.line()}")
    t0 = time.perf_counter()
    summaries = {ev.policy: ev for ev in schedule(lcpp, cfg, memory_limit_bytes=limit)
                 if isinstance(ev, SchedSummary)}
    print(f"  ({time.perf_counter() - t0:.0f} s for both policies, warm-up included)")
    print(f"  {'policy':<11}{'TTFT p50 s':>11}{'TPOT p50 s':>11}{'E2E p50 s':>10}{'tok/s system':>13}"
          f"{'decode batch':>13}{'KV paged peak':>14}{'contiguous':>12}")
    for p, sm in summaries.items():
        print(f"  {p:<11}{sm.ttft.p50:>11.2f}{sm.tpot.p50:>11.2f}{sm.e2e.p50:>10.2f}{sm.system_tokens_per_s:>13.2f}"
              f"{sm.mean_decode_batch:>13.2f}{size(sm.peak_paged_bytes):>14}{size(sm.peak_contiguous_bytes):>12}")
    if {"static", "continuous"} <= summaries.keys():
        st, co = summaries["static"], summaries["continuous"]
        print(f"  continuous / static: TTFT p50 {co.ttft.p50 / st.ttft.p50:.2f}, system tok/s "
              f"{co.system_tokens_per_s / st.system_tokens_per_s:.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.runtime")
    p.add_argument("--model", default="smollm2", choices=["smollm2", "1b", "8b"])
    p.add_argument("--labs", default=DEFAULT_LABS, help=f"comma-separated subset of {', '.join(LABS)}")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--prompt-tokens", type=int, default=32, help="the batching lab's prompt (the scheduling lab's "
                   "mean prompt)")
    p.add_argument("--new-tokens", type=int, default=16, help="the batching lab's (the scheduling lab's mean output)")
    p.add_argument("--requests", type=int, default=4, help="the scheduling lab's")
    p.add_argument("--rate", type=float, default=4.0, help="the scheduling lab's arrivals per second")
    p.add_argument("--range-ratio", type=float, default=0.5, help="the scheduling lab's spread of lengths")
    p.add_argument("--max-batch", type=int, default=2, help="the scheduling lab's")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    a = p.parse_args(argv)
    labs = [x for x in a.labs.split(",") if x]
    if not labs or any(x not in LABS for x in labs):
        p.error(f"--labs takes a comma-separated subset of {', '.join(LABS)}, got {a.labs!r}")
    import psutil
    import torch

    from engine.backends.llamacpp import LlamaCppSession
    from engine.costs.memory import LAB_MEMORY_SHARE, lab_memory, size
    from engine.labs import speculative as sp
    from engine.labs.batching import bench_batch
    from engine.loaders import load
    from engine.run.sampling import SamplingParams
    from engine.run.session import Session

    torch.set_num_threads(a.threads)
    path = model_path(a.model)
    batches = [int(b) for b in a.batches.split(",")]
    vm = psutil.virtual_memory()
    print(f"{path.name} ({path.stat().st_size / 2**30:.2f} GiB); {cpu_name()}, {os.cpu_count()} CPUs, "
          f"{vm.total / 2**30:.1f} GiB memory ({vm.available / 2**30:.1f} available); {a.threads} threads; "
          f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    t0 = time.perf_counter()
    lcpp = LlamaCppSession(path, threads=a.threads, n_ctx=512)
    if {"passes", "plain", "speculative"} & set(labs):  # the batching lab times decode after its prefill, and
        lcpp.warm_up()  # the scheduling lab warms each shape up itself: on the 8B file a warm-up costs minutes
    print(f"loaded in {time.perf_counter() - t0:.0f} s; RSS "
          f"{size(psutil.Process().memory_info().rss)}")
    limit = psutil.virtual_memory().available * LAB_MEMORY_SHARE  # the rule the app and the CLI apply
    n = max(batches)
    if "passes" in labs:
        one, seq_n, n_seq = pass_shapes(lcpp, n)
        print(f"llama.cpp pass: 1 × 1 token {one * 1e3:.0f} ms; 1 sequence × {n} tokens {seq_n * 1e3:.0f} ms "
              f"({seq_n / one:.2f} ×); {n} sequences × 1 token {n_seq * 1e3:.0f} ms ({n_seq / one:.2f} ×)")
    rows = {}
    if "batching" in labs:
        for b in batches:
            mem = lab_memory(lcpp.info, lcpp.cfg, "llama.cpp", b, a.prompt_tokens + a.new_tokens)
            print(f"batching lab, batch {b}, stated before the run: {mem.line()}")
        t0 = time.perf_counter()
        rows["llama.cpp"] = bench_batch(lcpp, batches, a.prompt_tokens, a.new_tokens, memory_limit_bytes=limit)
        print(f"batching lab on llama.cpp: prompt {a.prompt_tokens}, {a.new_tokens} new tokens "
              f"({a.new_tokens - 1} timed decode steps, median), {time.perf_counter() - t0:.0f} s")
        if a.model == "smollm2":
            lm = load(path, device="cpu", dtype="float32")
            paged, contiguous = paged_over_contiguous(lm)
            print(f"torch decode step, paged runtime / contiguous KVCache: {paged / contiguous:.2f} "
                  f"({paged * 1e3:.1f} / {contiguous * 1e3:.1f} ms)")
            rows["torch"] = bench_batch(Session(lm), batches, a.prompt_tokens, a.new_tokens)
        print(f"{'runtime':<10}{'batch':>6}{'TPOT ms':>9}{'tok/s system':>14}{'× batch 1':>11}")
        for name, rs in rows.items():
            for r in rs:
                print(f"{name:<10}{r.batch:>6}{r.tpot_s * 1e3:>9.1f}{r.tokens_per_s_system:>14.2f}"
                      f"{r.tokens_per_s_system / rs[0].tokens_per_s_system:>11.2f}")
        if "torch" in rows:
            print("llama.cpp TPOT / torch TPOT: " + ", ".join(
                f"batch {x.batch} {x.tpot_s / y.tpot_s:.2f}" for x, y in zip(rows["llama.cpp"], rows["torch"],
                                                                               strict=True)))
    greedy = SamplingParams.greedy_params()
    if "plain" in labs:
        lcpp.forget_cache()
        plain = list(lcpp.generate(CODE, greedy, a.new_tokens + 1, ignore_eos=True))[-1]
        line = f"plain generation on llama.cpp: TPOT {plain.tpot_s * 1e3:.1f} ms"
        if rows:
            line += f"; batching lab batch-1 TPOT / plain: {rows['llama.cpp'][0].tpot_s / plain.tpot_s:.2f}"
        print(line)
    if "speculative" in labs:
        fin = list(sp.speculate(lcpp, CODE, sp.SpecConfig(k=4, ignore_eos=True), greedy, 48))[-1]
        print(f"speculative (lookup, k = 4) on llama.cpp: {fin.tokens_per_pass:.2f} tokens per pass, "
              f"{fin.tokens_per_s:.1f} tok/s against plain {fin.baseline_tokens_per_s:.1f}: speedup "
              f"{fin.speedup:.2f}×; same tokens as plain greedy: {fin.matches_baseline}")
    if "schedule" in labs:
        schedule_lab(lcpp, a, limit)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(f"peak RSS of this process {size(peak)} (the file {size(path.stat().st_size)}); load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    lcpp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

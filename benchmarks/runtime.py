"""The labs on both runtimes, in one run: `python -m benchmarks.runtime [--model smollm2|1b] [--batches 1,4,8]`.

For the model it prints
  - llama.cpp passes of 1 sequence × 1 token, 1 sequence × B tokens and B sequences × 1 token (B the largest batch);
  - the torch runtime's decode step (paged cache) over the model's contiguous-cache step (Session's path);
  - batched decode (engine.labs.batching.bench_batch) on the torch runtime (float32; left out for `1b`) and on the
    llama.cpp runtime: TPOT and system tokens/s at each batch, the llama.cpp / torch TPOT ratio and each runtime's
    system tokens/s at batch B over batch 1;
  - the batching lab's batch-1 TPOT on llama.cpp over a plain generation's (LlamaCppSession.generate) on the file;
  - speculative decoding on llama.cpp (prompt lookup, k = 4, greedy, 48 new tokens) against plain decoding of the
    same prompt in the same run: tokens per pass, the speedup, and whether the tokens are the same.
`1b` is benchmarks.llamacpp's 1B-scale Llama-shaped Q4_0 file of random weights (built once).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

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
        b = int(lm.model(torch.tensor([ids]), 0, cache)[0].argmax())
    times = np.zeros((steps, 2))
    for i in range(steps):
        t0 = time.perf_counter()
        a = int(rt.forward([Row(0, [a])])[0].argmax())
        t1 = time.perf_counter()
        with torch.inference_mode():
            b = int(lm.model(torch.tensor([[b]]), 32 + i, cache)[0].argmax())
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.runtime")
    p.add_argument("--model", default="smollm2", choices=["smollm2", "1b"])
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    a = p.parse_args(argv)
    import torch

    from engine.backends.llamacpp import LlamaCppSession
    from engine.formats.locate import default_model_path
    from engine.labs import speculative as sp
    from engine.labs.batching import bench_batch
    from engine.loaders import load
    from engine.run.sampling import SamplingParams

    torch.set_num_threads(a.threads)
    if a.model == "1b":
        from benchmarks.llamacpp import big_path, build_big

        path = big_path("Q4_0")
        if not path.exists():
            build_big(path, "Q4_0")
    else:
        path = default_model_path()
    batches = [int(b) for b in a.batches.split(",")]
    print(f"{path.name}; {a.threads} threads; load average {os.getloadavg()[0]:.1f}")
    lcpp = LlamaCppSession(path, threads=a.threads, n_ctx=512)
    lcpp.warm_up()
    one, seq_n, n_seq = pass_shapes(lcpp, max(batches))
    n = max(batches)
    print(f"llama.cpp pass: 1 × 1 token {one * 1e3:.0f} ms; 1 sequence × {n} tokens {seq_n * 1e3:.0f} ms "
          f"({seq_n / one:.2f} ×); {n} sequences × 1 token {n_seq * 1e3:.0f} ms ({n_seq / one:.2f} ×)")
    rows = {"llama.cpp": bench_batch(lcpp, batches, 32, a.new_tokens)}
    if a.model != "1b":
        lm = load(path, device="cpu", dtype="float32")
        paged, contiguous = paged_over_contiguous(lm)
        print(f"torch decode step, paged runtime / contiguous KVCache: {paged / contiguous:.2f} "
              f"({paged * 1e3:.1f} / {contiguous * 1e3:.1f} ms)")
        rows["torch"] = bench_batch(lm, batches, 32, a.new_tokens)
    print(f"{'runtime':<10}{'batch':>6}{'TPOT ms':>9}{'tok/s system':>14}{'× batch 1':>11}")
    for name, rs in rows.items():
        for r in rs:
            print(f"{name:<10}{r.batch:>6}{r.tpot_s * 1e3:>9.1f}{r.tokens_per_s_system:>14.1f}"
                  f"{r.tokens_per_s_system / rs[0].tokens_per_s_system:>11.2f}")
    if "torch" in rows:
        print("llama.cpp TPOT / torch TPOT: " + ", ".join(
            f"batch {x.batch} {x.tpot_s / y.tpot_s:.2f}" for x, y in zip(rows["llama.cpp"], rows["torch"],
                                                                           strict=True)))
    greedy = SamplingParams.greedy_params()
    lcpp.forget_cache()
    plain = list(lcpp.generate(CODE, greedy, a.new_tokens + 1, ignore_eos=True))[-1]
    print(f"batching lab batch-1 TPOT / plain generation TPOT on llama.cpp: "
          f"{rows['llama.cpp'][0].tpot_s / plain.tpot_s:.2f} ({plain.tpot_s * 1e3:.1f} ms plain)")
    fin = list(sp.speculate(lcpp, CODE, sp.SpecConfig(k=4, ignore_eos=True), greedy, 48))[-1]
    print(f"speculative (lookup, k = 4) on llama.cpp: {fin.tokens_per_pass:.2f} tokens per pass, "
          f"{fin.tokens_per_s:.1f} tok/s against plain {fin.baseline_tokens_per_s:.1f}: speedup {fin.speedup:.2f}×; "
          f"same tokens as plain greedy: {fin.matches_baseline}")
    print(f"load average {os.getloadavg()[0]:.1f}")
    lcpp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

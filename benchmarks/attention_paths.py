"""One decode query's attention over 30 layers of a SmolLM2-shaped cache (3 KV heads, 3 queries each, head size 64)
at several key counts, each way the engine can run it (engine.model.attention_choice), against the way the engine
chose by measuring this machine: `python -m benchmarks.attention_paths [--dtype bfloat16|float32] [--threads N]`.

Prints one JSON line per key count: the best of 5 runs of every way (ms per step of 30 layers), the way the engine
runs there with and without a panel capturing the layer, and each choice's time ÷ the fastest way's (and the fastest
that forms the weights) in the same run. The key counts sit between the measured ones, so the rule that picks the
nearest measured count is tested too. Also `bf16` (bf16 products over all keys, which the engine never runs: its
repeated runs here reuse one oneDNN kernel, which a growing context does not). Random values; the times are
wall-clock, so run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.model import attention_choice
from engine.model.kernels import this_machine
from engine.model.threads import decode_thread_counts
from engine.model.transformer import decode_ways, explicit_attention

G, KV, HD, LAYERS, CAPACITY, CONTEXT = 3, 3, 64, 30, 8448, 8192


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=None, help="default: torch's")
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    ways = decode_ways(dtype)
    with torch.inference_mode():
        attention_choice.tune(ways, (KV, G, HD), dtype, CONTEXT, LAYERS, decode_thread_counts())  # (cached)
    if a.threads:
        torch.set_num_threads(a.threads)
    if dtype != torch.float32:
        ways["bf16"] = lambda q, k, v, g, scale, mask: explicit_attention(q, k, v, g, scale, mask)
    m = this_machine()
    print(json.dumps({"cpu": m.cpu, "cores": m.cores, "torch": m.torch, "capability": m.capability,
                      "dtype": a.dtype, "threads": torch.get_num_threads()}), flush=True)
    torch.manual_seed(0)
    scale = HD ** -0.5
    with torch.inference_mode():
        for keys in (768, 1500, 3072, 6000, 8000):
            # each layer's cache at its full capacity, its first `keys` rows read as views, as the engine reads them
            ks = [torch.randn(1, KV, CAPACITY, HD).to(dtype) for _ in range(LAYERS)]
            vs = [torch.randn(1, KV, CAPACITY, HD).to(dtype) for _ in range(LAYERS)]
            q = torch.randn(1, G * KV, 1, HD).to(dtype)
            times: dict[str, list[float]] = {name: [] for name in ways}
            for r in range(5):  # rounds in rotated order: a burst of load hits every way alike
                names = list(ways)
                for name in names[r % len(names):] + names[: r % len(names)]:
                    t0 = time.perf_counter()
                    for k, v in zip(ks, vs, strict=True):
                        ways[name](q, k[:, :, :keys], v[:, :, :keys], G, scale, None)
                    times[name].append(time.perf_counter() - t0)
            best = {name: min(t) * 1e3 for name, t in times.items()}
            runnable = {n: t for n, t in best.items() if n != "bf16"}
            with_weights = {n: t for n, t in runnable.items() if n != "sdpa"}
            chosen = attention_choice.choice(dtype, (KV, G, HD), keys, weights=False)
            chosen_w = attention_choice.choice(dtype, (KV, G, HD), keys, weights=True)
            print(json.dumps({
                "keys": keys, "ms_per_step": {n: round(t, 2) for n, t in sorted(best.items(), key=lambda x: x[1])},
                "chosen": chosen, "chosen_vs_fastest": round(best[chosen] / min(runnable.values()), 3),
                "chosen_with_weights": chosen_w,
                "with_weights_vs_fastest": round(best[chosen_w] / min(with_weights.values()), 3)}), flush=True)
            del ks, vs
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

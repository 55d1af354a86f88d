"""One bf16 decode query's attention over 30 layers of a SmolLM2-shaped cache (3 KV heads, 3 queries each, head
size 64) at several key counts, each way the engine can run it: `python -m benchmarks.attention_paths`. Prints, per
key count, the best of 5 runs of: float32 products on upcast copies (`upcast`, the engine's path up to
transformer.UPCAST_MAX_KEYS), bf16 products over whole blocks of keys and float32 over the rest (`blocked`, past
it), and bf16 products over all keys (`bf16`; its repeated runs reuse one oneDNN kernel, which a growing context
does not). Random values; the times are wall-clock, so run it on a quiet machine.
"""

from __future__ import annotations

import json
import time

import torch

from engine.model.transformer import explicit_attention, key_blocked_attention

G, KV, HD, LAYERS, CAPACITY = 3, 3, 64, 30, 8192


def main() -> None:
    torch.manual_seed(0)
    scale = HD ** -0.5
    for keys in (2000, 3072, 4000, 6000, 8000):
        # each layer's cache at its full capacity, its first `keys` rows read as views, as the engine reads them
        ks = [torch.randn(1, KV, CAPACITY, HD).bfloat16() for _ in range(LAYERS)]
        vs = [torch.randn(1, KV, CAPACITY, HD).bfloat16() for _ in range(LAYERS)]
        q = torch.randn(1, G * KV, 1, HD).bfloat16()
        ways = {"upcast": lambda k, v, q=q: explicit_attention(q.float(), k.float(), v.float(), G, scale, None),
                "blocked": lambda k, v, q=q: key_blocked_attention(q, k, v, G, scale, None),
                "bf16": lambda k, v, q=q: explicit_attention(q, k, v, G, scale, None)}
        best = {}
        for name, way in ways.items():
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for k, v in zip(ks, vs, strict=True):
                    way(k[:, :, :keys], v[:, :, :keys])
                times.append(time.perf_counter() - t0)
            best[name] = round(min(times) * 1e3, 2)
        print(json.dumps({"keys": keys, "threads": torch.get_num_threads(), "ms_per_step": best}), flush=True)


if __name__ == "__main__":
    main()

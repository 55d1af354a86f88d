"""The decode step's matrix–vector products alone: `python -m benchmarks bench-gemv` times every way this engine (or
torch) can multiply one row by the default model's weights, at one thread and at all, and prints GB/s of weights.

The chain is one decode step's projections (wqkv, wo, w_gate_up, w_down × layers, then the LM head) with random
weights of the real shapes, distinct per layer so they stream from memory as in decode (540 MB in float32, more
than any cache). Each product is timed alone, several times; the chain's time is the sum of each product's fastest
run, which keeps a shared machine's interruptions out of the figure (and so is a lower bound, stated as such).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def variants(cfg) -> dict:
    import torch
    import torch.nn.functional as F

    from engine.model.transformer import linear, pack_for_decode

    g = torch.Generator().manual_seed(0)
    shapes = [(cfg.q_dim + 2 * cfg.kv_dim, cfg.d_model), (cfg.d_model, cfg.q_dim),
              (2 * cfg.ffn_dim, cfg.d_model), (cfg.d_model, cfg.ffn_dim)] * cfg.n_layers
    shapes.append((cfg.vocab_size, cfg.d_model))
    w32 = [torch.randn(o, i, generator=g) / i**0.5 for o, i in shapes]
    w16 = [w.bfloat16() for w in w32]
    packed = [pack_for_decode(w) for w in w16]

    def int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # per-output-row symmetric scales
        s = w.abs().amax(1).clamp_min(1e-8) / 127
        return (w / s[:, None]).round().clamp(-127, 127).to(torch.int8), s.bfloat16()

    q8 = [int8(w) for w in w32]
    x32 = {i: torch.randn(1, i, generator=g) for _, i in set(shapes)}
    x16 = {i: x.bfloat16() for i, x in x32.items()}
    out = {
        "float32 F.linear (MKL sgemv)": (4, lambda k: F.linear(x32[w32[k].shape[1]], w32[k])),
        "float32 engine linear (row-block split)": (4, lambda k: linear(x32[w32[k].shape[1]], w32[k])),
        "bfloat16 F.linear": (2, lambda k: F.linear(x16[w16[k].shape[1]], w16[k])),
    }
    if packed[0] is not None:
        out["bfloat16 engine linear (oneDNN, packed)"] = (
            2, lambda k: linear(x16[w16[k].shape[1]], w16[k], packed=packed[k]))
    if hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        out["int8 weights, bf16 activations (_weight_int8pack_mm)"] = (
            1, lambda k: torch._weight_int8pack_mm(x16[w16[k].shape[1]], q8[k][0], q8[k][1]))
    return {"shapes": shapes, "weights": sum(o * i for o, i in shapes), "variants": out}


def run(threads: list[int], repeats: int) -> dict:
    import torch

    from engine.loaders import load

    v = variants(load(None, device="cpu", dtype="float32").cfg)  # the default model's shapes
    n_w, res = v["weights"], {}
    with torch.inference_mode():
        for n in threads:
            torch.set_num_threads(n)
            for name, (bytes_per_weight, f) in v["variants"].items():
                best = [float("inf")] * len(v["shapes"])
                for _ in range(repeats):
                    for k in range(len(best)):
                        t = time.perf_counter()
                        f(k)
                        best[k] = min(best[k], time.perf_counter() - t)
                chain = sum(best)
                res[f"{n} thread(s): {name}"] = {"threads": n, "variant": name, "chain_s": chain,
                                                  "weight_bytes": n_w * bytes_per_weight,
                                                  "gb_per_s": n_w * bytes_per_weight / chain / 1e9}
    return res


def cmd_bench_gemv(a: argparse.Namespace) -> int:
    from benchmarks.bench import BusyMeter
    from engine.run.threads import available_cores

    threads = sorted({1, available_cores()})
    busy = BusyMeter()
    res = run(threads, 3 if a.smoke else a.repeats)
    others = busy.cores_used()
    if a.json:
        print(json.dumps({"results": res, "other_processes_cores": others}, indent=2))
        return 0
    base = {n: res.get(f"{n} thread(s): float32 engine linear (row-block split)") for n in threads}
    print(f"{'decode matrix–vector chain':<62}{'time':>10}{'GB/s':>8}{'vs fp32 linear':>16}")
    for name, r in res.items():
        ref = base[r["threads"]]
        print(f"{name:<62}{r['chain_s'] * 1e3:>8.2f}ms{r['gb_per_s']:>8.1f}{r['chain_s'] / ref['chain_s']:>15.2f}×")
    print(f"other processes used {others:.2f} cores during the run (sum of per-product minima: a lower bound)",
          file=sys.stderr)
    return 0


def add_subcommand(sub) -> None:
    p = sub.add_parser("bench-gemv", help="time the decode step's matrix–vector products every way, 1 and all threads")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_gemv)

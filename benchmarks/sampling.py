"""One token's sampling on the vocabularies of the two models: `python -m benchmarks bench-sampling`.

For SmolLM2's 49,152 and Gemma 3's 262,144 tokens it times, on random logits at the machine's thread count, the
draw itself (torch.multinomial against engine.run.sampling.draw, which inverts the cumulative distribution) and a
whole step's sampling as the engine runs it (`choose`: penalties, temperature, top-k, top-p, the draw; and `sample`
with the funnel the app shows, condensed to 20 candidates). Each figure is the median of --repeats timings of a
loop of calls, and the ratios come from the same run.
"""

from __future__ import annotations

import json
import statistics
import time

VOCABS = {"SmolLM2 (49,152)": 49_152, "Gemma 3 (262,144)": 262_144}


def _median_ms(fn, calls: int, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(times)


def cmd_bench_sampling(args) -> int:
    import torch

    from engine.run.sampling import SamplingParams, choose, draw, make_generator, sample
    from engine.run.session import condense_funnel

    class _Pieces:  # condense_funnel names its candidates; the names do not matter here
        def piece(self, i: int) -> str:
            return str(i)

    params = {"greedy": SamplingParams.greedy_params(),
              "T 0.7, top-k 50, top-p 0.9": SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
              "T 1.0 (every token kept)": SamplingParams(temperature=1.0)}
    rows = []
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    for vname, v in VOCABS.items():
        logits = torch.randn(v, generator=torch.Generator().manual_seed(0)) * 3
        p = torch.softmax(logits, -1)
        g = make_generator(0)
        ctx = torch.arange(16)
        multinomial = _median_ms(lambda: int(torch.multinomial(p, 1, generator=g)),  # noqa: B023 — run at once
                                 args.calls, args.repeats)
        ours = _median_ms(lambda: draw(p, g), args.calls, args.repeats)  # noqa: B023
        print(f"\n{vname}: one draw from a full distribution: torch.multinomial {multinomial:.3f} ms, draw "
              f"{ours:.3f} ms ({multinomial / ours:.1f} ×)")
        rows.append({"vocab": v, "multinomial_ms": multinomial, "draw_ms": ours})
        for pname, sp in params.items():
            ch = _median_ms(lambda: choose(logits, sp, g, ctx), args.calls, args.repeats)  # noqa: B023

            def with_funnel() -> None:
                token, stages = sample(logits, sp, g, ctx)  # noqa: B023
                condense_funnel(stages, sp, 20, _Pieces(), token)  # noqa: B023

            fu = _median_ms(with_funnel, args.calls, args.repeats)
            print(f"  {pname:<28} choose {ch:7.3f} ms   sample + funnel {fu:7.3f} ms")
            rows.append({"vocab": v, "params": pname, "choose_ms": ch, "sample_funnel_ms": fu})
    if args.json:
        print(json.dumps(rows))
    return 0


def add_subcommand(sub) -> None:
    p = sub.add_parser("bench-sampling", help="time one token's sampling on SmolLM2's and Gemma 3's vocabularies")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_sampling)

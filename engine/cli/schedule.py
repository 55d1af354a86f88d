"""`python -m engine schedule`: the scheduling lab on the command line, a table per policy (or JSON).

Kept apart from engine.labs.scheduler so that building the CLI's parser does not import torch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict

from engine.labs.schedule_events import (
    MAX_BATCH,
    MAX_REQUESTS,
    POLICIES,
    SchedConfig,
    SchedPlan,
    SchedRequestDone,
    SchedSummary,
)


def _table(plan: SchedPlan, summaries: list[SchedSummary]) -> str:
    c = plan.config
    mib = 2**20
    p_lo, p_hi = c.length_range(c.prompt_len)
    o_lo, o_hi = c.length_range(c.output_len)
    rate = "all at t=0" if math.isinf(c.rate) else f"{c.rate:g}/s, burstiness {c.burstiness:g}"
    lines = [
        f"{c.n_requests} requests ({rate}), prompt {p_lo}–{p_hi} and output {o_lo}–{o_hi} tokens, max batch "
        f"{c.max_batch}, {plan.dtype} on {plan.device}",
        f"prefill: {plan.prefill_mode}",
        f"KV: {plan.kv_bytes_per_position:,.0f} B per position, pages of {plan.page_size}; contiguous reserves "
        f"{plan.reserve_len} positions per request",
        "",
        f"{'':<28}" + "".join(f"{s.policy:>14}" for s in summaries),
    ]

    def row(label: str, values: list[str]) -> None:
        lines.append(f"{label:<28}" + "".join(f"{v:>14}" for v in values))

    for name, unit, scale in (("ttft", "ms", 1e3), ("tpot", "ms", 1e3), ("e2e", "s", 1.0)):
        for p in ("p50", "p90", "p99"):
            row(f"{name.upper()} {p} ({unit})", [f"{getattr(getattr(s, name), p) * scale:.1f}" for s in summaries])
    row("system tokens/s", [f"{s.system_tokens_per_s:.1f}" for s in summaries])
    row("per-stream tokens/s (1/TPOT)", [f"{s.stream_tokens_per_s:.1f}" for s in summaries])
    row("duration (s)", [f"{s.duration_s:.2f}" for s in summaries])
    row("prefill / decode steps", [f"{s.prefill_steps} / {s.decode_steps}" for s in summaries])
    row("mean decode batch", [f"{s.mean_decode_batch:.2f}" for s in summaries])
    row("peak KV used (MiB)", [f"{s.peak_used_bytes / mib:.2f}" for s in summaries])
    row("peak KV paged (MiB)", [f"{s.peak_paged_bytes / mib:.2f}" for s in summaries])
    row("peak KV contiguous (MiB)", [f"{s.peak_contiguous_bytes / mib:.2f}" for s in summaries])
    if summaries:
        b = summaries[0].kv_budget_bytes
        row(f"fit in {b / mib:.1f} MiB: paged", [f"{s.fits_paged}" for s in summaries])
        row(f"fit in {b / mib:.1f} MiB: contiguous", [f"{s.fits_contiguous}" for s in summaries])
    return "\n".join(lines)


def _cmd(a: argparse.Namespace) -> int:
    import psutil

    from engine.backends import lab_model_from_args
    from engine.cliargs import one_line, stamped
    from engine.labs.scheduler import schedule

    cfg = SchedConfig(policy=a.policy, n_requests=a.requests, rate=a.rate, burstiness=a.burstiness,
                      prompt_len=a.prompt_len, output_len=a.output_len, range_ratio=a.range_ratio,
                      max_batch=a.max_batch, page_size=a.page_size, seed=a.seed,
                      kv_budget_bytes=a.kv_budget_mib * 2**20 if a.kv_budget_mib else None)
    with one_line(usage=(ValueError,)):
        cfg.validate()
    lm = lab_model_from_args(a)
    plan, summaries, done = None, [], []
    with one_line(usage=(ValueError,)):
        for ev in schedule(lm, cfg, memory_limit_bytes=psutil.virtual_memory().available * 0.5):
            if isinstance(ev, SchedPlan):
                plan = ev
            elif isinstance(ev, SchedSummary):
                summaries.append(ev)
                if not a.json:
                    print(f"  {ev.policy}: done in {ev.busy_s:.1f} s of steps", file=sys.stderr)
            elif isinstance(ev, SchedRequestDone):
                done.append(ev)
    summaries.sort(key=lambda s: POLICIES.index(s.policy))  # they end in either order; columns keep one
    if a.json:
        print(json.dumps(stamped(_document(plan, summaries, done), lm.info), indent=2, default=str))
    else:
        print(f"{lm.info.name}: " + _table(plan, summaries))
    return 0


def _request(d: SchedRequestDone) -> dict:
    out = {k: v for k, v in asdict(d).items() if k != "tokens"}
    out["e2el_s"] = d.e2e_s  # `vllm bench serve`'s name for end-to-end latency
    return out


def _policy(s: SchedSummary, done: list[SchedRequestDone]) -> dict:
    """One policy's run under the names other tools read: its requests, system tokens/s and the KV figures."""
    return {"requests": [_request(d) for d in done if d.policy == s.policy],
            "system_tokens_per_s": s.system_tokens_per_s,
            "kv": {"paged_peak_bytes": s.peak_paged_bytes, "contiguous_reserved_bytes": s.peak_contiguous_bytes,
                   "used_peak_bytes": s.peak_used_bytes, "budget_bytes": s.kv_budget_bytes,
                   "fits_paged": s.fits_paged, "fits_contiguous": s.fits_contiguous}}


def _document(plan: SchedPlan | None, summaries: list[SchedSummary], done: list[SchedRequestDone]) -> dict:
    """The --json document: the plan, each policy's summary and figures, and every finished request; with one
    policy its figures also stand at the top level (`requests`, `system_tokens_per_s`, `kv`)."""
    doc = {"plan": asdict(plan) if plan is not None else None, "summaries": [asdict(s) for s in summaries],
           "policies": {s.policy: _policy(s, done) for s in summaries},
           "requests": [_request(d) for d in done]}
    if len(summaries) == 1:
        doc.update(doc["policies"][summaries[0].policy])
    return doc


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Add `schedule` to the engine's CLI."""
    from engine.cliargs import MAX_SEED, add_local_model_args, float_in, int_in, threads

    d = SchedConfig()
    q = sub.add_parser("schedule", help="static vs continuous batching and a paged KV cache, on the loaded model")
    add_local_model_args(q)
    q.add_argument("--policy", default=d.policy, choices=["static", "continuous", "both"])
    q.add_argument("--rate", type=float_in(0, lo_open=True, inf=True), default=d.rate,
                   help="requests per second (inf: all at once)")
    q.add_argument("--burstiness", type=float_in(0, lo_open=True), default=d.burstiness,
                   help="gamma shape of arrival gaps; 1 = Poisson")
    q.add_argument("--requests", "--num-requests", dest="requests", type=int_in(1, MAX_REQUESTS),
                   default=d.n_requests, help="requests in the run")
    q.add_argument("--prompt-len", type=int_in(1), default=d.prompt_len, help="mean prompt tokens")
    q.add_argument("--output-len", type=int_in(1), default=d.output_len, help="mean output tokens")
    q.add_argument("--range-ratio", type=float_in(0, 1, hi_open=True), default=d.range_ratio,
                   help="lengths uniform in [L·(1-r), L·(1+r)] (as vllm bench serve's --random-range-ratio)")
    q.add_argument("--max-batch", type=int_in(1, MAX_BATCH), default=d.max_batch)
    q.add_argument("--page-size", type=int_in(1), default=d.page_size, help="positions per KV page")
    q.add_argument("--kv-budget-mib", type=float_in(0, lo_open=True), default=None,
                   help="KV memory for 'how many requests fit' (default: the contiguous reservation of max batch)")
    q.add_argument("--seed", type=int_in(0, MAX_SEED), default=d.seed)
    q.add_argument("--threads", type=threads, default="auto", help="auto (torch's count) or a fixed count")
    q.set_defaults(func=_cmd)

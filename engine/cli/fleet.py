"""`fleet` (one look at a router's replicas) and `fleet-bench` (routing policies compared on a fleet started here).

    python -m engine fleet --router http://127.0.0.1:30000          # the replicas from the router's own listing
    python -m engine fleet --config fleet.toml                     # or from a config
    python -m engine fleet-bench --policies round_robin,cache_aware --num-prompts 64 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from engine.cliargs import float_in, int_in, output_file
from engine.remote.fleet import POLICIES, Fleet, FleetError, load_config
from engine.text import clean_text

MAX_PROMPTS = 1024
MAX_CONCURRENCY = 64


def _fail(e: Exception | str, status: int = 1) -> SystemExit:
    print(f"error: {clean_text(str(e), 600)}", file=sys.stderr)
    return SystemExit(status)


def cmd_fleet(a: argparse.Namespace) -> int:
    try:
        fleet = Fleet.from_config(load_config(a.config)) if a.config else Fleet.from_router(a.router)
        figs = fleet.scrape()
    except FleetError as e:
        raise _fail(e) from None
    doc = {"router": fleet.router, "replicas": [f.to_dict() for f in figs]}
    if a.json:
        print(json.dumps(doc))
        return 0
    for f in figs:
        if f.error:
            print(f"{f.name:12s} {f.url}: {f.error}")
            continue
        hit = f"{f.prefix_hit_rate:.0%}" if f.prefix_hit_rate is not None else "-"
        kv = f"{f.kv_usage:.1%}" if f.kv_usage is not None else "-"
        print(f"{f.name:12s} {f.url}: waiting {f.waiting:g}, running {f.running:g}, KV {kv}, prefix hits {hit}, "
              f"{f.requests_done or 0:g} requests done")
    return 0


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names or len(names) > len(POLICIES):
        raise argparse.ArgumentTypeError(f"policies are a comma-separated list of {', '.join(POLICIES)}")
    return names


def cmd_fleet_bench(a: argparse.Namespace) -> int:
    from engine.remote.fleet import compare_policies, router_python
    from engine.remote.launch import vllm_python

    if vllm_python() is None or router_python() is None:
        raise _fail("fleet-bench starts vLLM and vllm-router from .venv-servers/vllm: run `make servers` first")
    with tempfile.TemporaryDirectory(prefix="fleet-") as tmp:
        hf = Path(a.hf_dir) if a.hf_dir else None
        if hf is None:
            from engine.cli.export_hf import export

            hf = export(None, Path(tmp) / "hf")  # the default model, as the vLLM tests serve it
        logs = Path(a.log_dir) if a.log_dir else Path(tmp)
        try:
            doc = compare_policies(hf, logs, a.policies, replicas=a.replicas, num_prompts=a.num_prompts,
                                   max_new_tokens=a.max_new_tokens, concurrency=a.concurrency,
                                   time_limit_s=a.time_limit)
        except (RuntimeError, FleetError) as e:
            raise _fail(e) from None
    if not a.requests:
        for run in doc["runs"]:
            run.pop("requests")
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=2), encoding="utf-8")
    if a.json:
        print(json.dumps(doc))
    else:
        for run in doc["runs"]:
            aff = run["prefix_affinity"]
            print(f"{run['policy']:12s} {run['completed']}/{run['num_prompts']} ok, TTFT p50 "
                  f"{run['ttft_p50_ms']:.1f} ms, attributed {run['attributed']} {run['served']}, replicas counted "
                  f"{run['replica_counted']}, same replica per prefix {aff:.0%}, prefix-cache hits "
                  f"{run['prefix_hit_rate']:.0%}" if aff is not None and run["prefix_hit_rate"] is not None else
                  f"{run['policy']}: {run}")
    return 0


def add_subcommands(sub) -> None:
    q = sub.add_parser("fleet", help="a router's replicas: queue, running, KV use, prefix-cache hits (one scrape)")
    g = q.add_mutually_exclusive_group(required=True)
    g.add_argument("--router", help="the router's URL; its replicas come from its /list_workers")
    g.add_argument("--config", help="a fleet config (JSON or TOML: router, replicas)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_fleet)

    q = sub.add_parser("fleet-bench", help="routing policies compared: vLLM replicas and vllm-router started on "
                                           "loopback, shared-prefix prompts, each request attributed to a replica")
    q.add_argument("--policies", type=_policies, default=["round_robin", "cache_aware"])
    q.add_argument("--replicas", type=int_in(2, 4), default=2)
    q.add_argument("--num-prompts", type=int_in(1, MAX_PROMPTS), default=64)
    q.add_argument("--max-new-tokens", type=int_in(1, 256), default=4)
    q.add_argument("--concurrency", type=int_in(1, MAX_CONCURRENCY), default=4)
    q.add_argument("--time-limit", type=float_in(0, 3600, lo_open=True), default=240.0,
                   help="seconds per policy, at most")
    q.add_argument("--hf-dir", default=None, help="a Hugging Face directory (default: the default model, exported)")
    q.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    q.add_argument("--requests", action="store_true", help="each request's replica and TTFT in the JSON too")
    q.add_argument("--out", type=output_file, default=None)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_fleet_bench)

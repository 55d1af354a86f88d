"""`--url` versions of tokenize / logits / generate, and `serve-bench`, with the same JSON keys as the local ones.

An API key is not sent unencrypted (http://) to another machine unless `--allow-insecure-key` says so: a command
line has no one to ask, and the key may come from the environment (OPENAI_API_KEY) without the user thinking of it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import TYPE_CHECKING

from engine.cliargs import (
    MAX_SEED,
    CliError,
    UsageError,
    add_url_args,
    float_in,
    int_in,
    int_list,
    one_line,
    output_file,
    sampling_params,
    stamped,
)
from engine.remote.client import RemoteError

if TYPE_CHECKING:  # the backend imports torch (via engine.run.sampling); argument parsing must not
    from engine.remote.backend import RemoteBackend


def _finite(x):
    """`x` for json.dumps(allow_nan=False): non-finite floats (a server's NaN or -inf log-probability) become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def _print_json(obj, **kw) -> None:
    """A --json document of a server's run: its kernels are the server's own ("kernels": "server")."""
    print(json.dumps(_finite(stamped(obj, None)), allow_nan=False, **kw))


_UNPRINTABLE = dict.fromkeys(i for i in (*range(32), 127, *range(0x80, 0xA0)) if chr(i) not in "\n\t")


def _printable(text: str) -> str:
    """Generated text for a terminal: control characters (escape sequences' ESC among them) left out."""
    return text.translate(_UNPRINTABLE)


def _backend(a: argparse.Namespace) -> RemoteBackend:
    from engine.remote.backend import RemoteBackend

    key = os.environ.get(a.api_key_env) if a.api_key_env else None
    with one_line(RemoteError):
        b = RemoteBackend(a.url, api_key=key, timeout=getattr(a, "timeout", 60.0))
        warning = b.client.insecure_key_warning()
        if warning and not getattr(a, "allow_insecure_key", False):
            raise CliError(f"not connecting: {warning}; pass --allow-insecure-key to send it anyway")
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        b.probe()
    return b


def cmd_tokenize(a: argparse.Namespace) -> int:
    b = _backend(a)
    with one_line(RemoteError):
        t = b.tokenize(a.text, a.chat)
    if a.json:
        _print_json({
            "ids": t.ids.tolist(), "pieces": list(t.pieces), "offsets": t.offsets.tolist(),
            "byte_offsets": t.byte_offsets.tolist(), "unrepresentable": [],
            "server": b.info.to_dict(),
        }, ensure_ascii=False)
    else:
        for i, (tid, piece, (s, e)) in enumerate(zip(t.ids.tolist(), t.pieces, t.offsets.tolist(), strict=True)):
            print(f"{i:5d} {tid:7d}  [{s:4d},{e:4d})  {piece!r}")
        print(f"{len(t.ids)} tokens by {b.info.kind} ({b.info.model})")
    return 0


def cmd_logits(a: argparse.Namespace) -> int:
    params = sampling_params(a)
    b = _backend(a)
    with one_line(RemoteError, ValueError):
        gen = b.generate(a.prompt, params, max_new_tokens=1, chat=a.chat, top_logprobs=a.top)
        prompt_ids: list[int] = []
        tok = None
        for ev in gen:
            if type(ev).__name__ == "RemoteTokenSampled" and tok is None:
                tok = ev
            elif type(ev).__name__ == "Failed":
                raise RemoteError(ev.message)
            elif type(ev).__name__ == "Finished":
                prompt_ids = ev.prompt_ids.tolist()
    if tok is None or tok.funnel is None:
        raise CliError(f"the {b.info.kind} server returned no log-probabilities")
    f = tok.funnel
    cands = [
        {"id": int(f.ids[i]) if f.ids[i] >= 0 else None, "token": f.pieces[i], "logit": None,
         "logprob": float(f.logits[i]) if f.logits[i] > -1e9 else None, "prob_raw": float(f.p_raw[i]),
         "prob": None}
        for i in range(len(f.ids))
    ]
    if a.json:
        _print_json({"prompt_ids": prompt_ids, "candidates": cands, "kept": None, "source": f.source,
                     "server": b.info.to_dict()}, ensure_ascii=False)
    else:
        print(f"{len(prompt_ids)} prompt tokens; top {len(cands)} candidates from {b.info.kind} ({f.source})")
        print(f"{'id':>7} {'token':<20} {'logprob':>9} {'p raw':>8}")
        for c in cands:
            lp = f"{c['logprob']:9.3f}" if c["logprob"] is not None else f"{'-inf':>9}"
            print(f"{c['id'] if c['id'] is not None else '?':>7} {c['token']!r:<20} {lp} {c['prob_raw']:8.4f}")
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from engine.events import Failed, Finished

    params = sampling_params(a)
    b = _backend(a)
    with one_line(ValueError):
        gen = b.generate(a.prompt, params, a.max_new_tokens, chat=a.chat, top_logprobs=getattr(a, "top", 5),
                         ignore_eos=a.ignore_eos)
    logprobs: list[float | None] = []
    for ev in gen:
        if type(ev).__name__ == "RemoteTokenSampled":
            logprobs.append(ev.logprob)
            if not a.json:
                print(_printable(ev.text), end="", flush=True)
        elif isinstance(ev, Failed):
            if not a.json:
                print(file=sys.stderr)
            raise CliError(ev.message)
        elif isinstance(ev, Finished):
            if a.json:
                _print_json({
                    "prompt_ids": ev.prompt_ids.tolist(), "ids": ev.ids.tolist(), "text": ev.text,
                    "ttft_s": ev.ttft_s, "tpot_s": ev.tpot_s, "tokens_per_s": ev.tokens_per_s,
                    "total_s": ev.total_s, "finish_reason": ev.reason, "logprobs": logprobs,
                    "itl_s": ev.step_seconds.tolist(), "usage": gen.usage,
                    "server": b.info.to_dict(),
                }, ensure_ascii=False)
            else:
                print()
                print(f"[{len(ev.ids)} tokens from {b.info.kind}, {ev.reason}; TTFT {ev.ttft_s * 1e3:.1f} ms, "
                      f"TPOT {ev.tpot_s * 1e3:.1f} ms ({ev.tokens_per_s:.1f} tok/s)]", file=sys.stderr)
    return 0


def cmd_serve_bench(a: argparse.Namespace) -> int:
    from engine.remote import loadlab as bench

    if not a.url:
        raise UsageError("serve-bench needs --url (an OpenAI-compatible server, e.g. http://127.0.0.1:8000)")
    slo = {k: v for k, v in (("ttft", a.slo_ttft_ms), ("tpot", a.slo_tpot_ms), ("e2el", a.slo_e2el_ms)) if v}
    b = _backend(a)
    rate = a.request_rate if a.request_rate is not None else math.inf
    runs = []
    requests: list = []
    receiver = None
    if a.spans_port is not None:
        from engine.remote.otlp import OTLPError, receiver_on

        with one_line(OTLPError):
            receiver = receiver_on(a.spans_port)
        print(f"receiving the server's spans at {receiver.endpoint}", file=sys.stderr)
    for c in a.concurrency:
        kept: list = []
        r = bench.run_once(b, c, a.num_prompts, a.max_new_tokens, request_rate=rate, burstiness=a.burstiness,
                           seed=a.seed, time_limit_s=a.time_limit, slo_ms=slo or None, on_request=kept.append,
                           spans=receiver, on_spans=lambda rs, kept=kept: kept.__setitem__(slice(None), rs))
        requests += kept
        d = r.to_dict()
        d["request_rate"] = None if math.isinf(rate) else rate
        runs.append(d)
        if not a.json:
            print(f"concurrency {c:3d}: {r.completed}/{r.completed + r.failed} ok in {r.duration_s:.2f} s; "
                  f"{r.output_throughput:7.1f} tok/s system, {r.per_stream_tokens_per_s:6.1f} tok/s per stream; "
                  f"TTFT {r.mean_ttft_ms:.0f} ms (p99 {r.p99_ttft_ms:.0f}), TPOT {r.mean_tpot_ms:.1f} ms, "
                  f"ITL p99 {r.p99_itl_ms:.1f} ms")
        if r.completed == 0:
            msg = r.errors[0] if r.errors else "no request completed"
            raise CliError(f"serve-bench at concurrency {c}: {msg}")
    out = {"server": b.info.to_dict(), "max_new_tokens": a.max_new_tokens, "num_prompts": a.num_prompts,
           "runs": runs}
    if receiver is not None and receiver.problems():
        print("span receiver: " + "; ".join(receiver.problems()), file=sys.stderr)
    if a.requests_out:
        from engine.remote import timeline

        low = a.requests_out.lower()
        with one_line(OSError), open(a.requests_out, "w", encoding="utf-8") as f:
            if low.endswith(".csv"):
                f.write(timeline.to_csv(requests))
            else:
                doc = timeline.perfetto(requests) if low.endswith((".perfetto.json", ".trace.json")) \
                    else timeline.to_json(requests)
                f.write(json.dumps(_finite(doc), allow_nan=False))
    if a.out:
        with one_line(OSError), open(a.out, "w", encoding="utf-8") as f:
            f.write(bench.to_csv(runs) if a.out.endswith(".csv")
                    else json.dumps(_finite(out), indent=2, allow_nan=False))
    if a.json:
        _print_json(out)
    return 0


MAX_CONCURRENCY = 1024
MAX_PROMPTS = 100_000  # each level draws its arrival times up front
MAX_TIME_LIMIT_S = 86_400.0


def add_subcommand(sub) -> None:
    q = sub.add_parser("serve-bench", help="bounded load benchmark against a server (vllm bench serve's figures)")
    add_url_args(q)
    # each level runs its requests on as many threads as its concurrency
    q.add_argument("--concurrency", type=int_list(1, MAX_CONCURRENCY), default=[1, 2, 4],
                   help="levels to sweep, e.g. 1,2,4,8")
    q.add_argument("--num-prompts", type=int_in(1, MAX_PROMPTS), default=8, help="requests per level")
    q.add_argument("--max-new-tokens", type=int_in(1), default=32)
    q.add_argument("--request-rate", type=float_in(0, lo_open=True, inf=True), default=None,
                   help="requests/s (default: all at once)")
    q.add_argument("--burstiness", type=float_in(0, lo_open=True), default=1.0,
                   help="gamma shape of the arrivals (1 = Poisson)")
    q.add_argument("--seed", type=int_in(0, MAX_SEED), default=0)
    q.add_argument("--time-limit", type=float_in(0, MAX_TIME_LIMIT_S, lo_open=True), default=120.0,
                   help="seconds per level, at most")
    for name in ("ttft", "tpot", "e2el"):
        q.add_argument(f"--slo-{name}-ms", type=float_in(0, lo_open=True), default=None)
    q.add_argument("--out", type=output_file, default=None, help="also write the results (.json or .csv)")
    q.add_argument("--requests-out", type=output_file, default=None,
                   help="write each request's timeline: .csv (one row each), .json (every chunk) or .perfetto.json "
                        "(a trace ui.perfetto.dev opens)")
    q.add_argument("--spans-port", type=int_in(1, 65535), default=None,
                   help="receive the server's OpenTelemetry spans (OTLP/HTTP protobuf) on 127.0.0.1:PORT; start "
                        "vLLM with --otlp-traces-endpoint http://127.0.0.1:PORT/v1/traces")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_serve_bench)

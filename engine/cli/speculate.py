"""`python -m engine speculate`: speculative decoding on the local model, pass by pass, with the measured speedup.

    python -m engine speculate --prompt "…" [--k 4] [--source lookup|early-exit[:J]|draft-model] [--greedy]
        [--max-new-tokens N] [--json] [--sweep]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import numpy as np


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Add `speculate` to the engine CLI's subparsers (it sets func=cmd_speculate)."""
    from engine.cliargs import add_model_args, add_sampling_args, add_threads_arg, int_in

    q = sub.add_parser("speculate", help="speculative decoding: draft k tokens, verify them in one pass",
                       description="Draft k tokens cheaply, verify them in one forward pass of the model over k + 1 "
                       "positions, keep the accepted ones; then decode the same prompt plainly and compare.")
    add_model_args(q)
    add_sampling_args(q)
    q.add_argument("--prompt", required=True)
    q.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template first")
    q.add_argument("--k", type=int_in(1), default=4, help="tokens drafted per full pass (1–16)")
    q.add_argument("--source", type=_source, default="lookup", metavar="SOURCE",
                   help="lookup (n-grams of the context), early-exit[:J] (the model's first J layers; default half) "
                        "or draft-model (needs --draft-model)")
    q.add_argument("--draft", type=lambda text: _source(_draft_source(text)), default=None, metavar="DRAFT",
                   help="the same choice in short: ngram (lookup), exit:J (early exit after layer J) or model")
    q.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="a smaller model with the same vocabulary (file, directory or known name)")
    q.add_argument("--ngram", type=int_in(1), default=3, help="lookup: the longest suffix n-gram matched")
    q.add_argument("--max-new-tokens", type=int_in(1), default=64)
    q.add_argument("--ignore-eos", action="store_true")
    q.add_argument("--no-baseline", action="store_true", help="skip plain decoding (no speedup is measured)")
    q.add_argument("--sweep", action="store_true", help="run k = 1…8 against one plain-decoding baseline")
    add_threads_arg(q)
    q.set_defaults(func=cmd_speculate, local_only="needs the model's forward pass, which a server does not expose")


def _source(text: str) -> str:
    """--source (and --draft, in its long form): a draft source's name, checked as it is parsed."""
    from engine.labs.speculative import parse_source  # torch: only when speculate's own arguments are parsed

    try:
        parse_source(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def cmd_speculate(a: argparse.Namespace) -> int:
    from engine.backend import Unsupported
    from engine.backends import session_from_args
    from engine.cliargs import CliError, UsageError, check_bias, one_line, sampling_params, stamped
    from engine.events import Failed
    from engine.labs import speculative as sp
    from engine.loaders import ModelLoadError

    params = sampling_params(a)
    source, layer = sp.parse_source(a.source if a.draft is None else _draft_source(a.draft))
    if (source == "draft-model") != (a.draft_model is not None):
        raise CliError("--draft-model goes with --source draft-model, and that source needs it")
    if a.k > sp.MAX_K:  # before the model loads: nothing about it changes this
        raise UsageError(f"--k takes 1 to {sp.MAX_K} tokens drafted per pass, got {a.k}")
    s = session_from_args(a)
    check_bias(params, s.cfg.vocab_size)
    draft = None
    if a.draft_model is not None:
        with one_line(ModelLoadError):
            draft = s.sibling(a.draft_model)  # the same runtime and settings, another file
    with one_line(ValueError, usage=(Unsupported,)):  # Unsupported: early-exit drafting on llama.cpp
        cfg = sp.SpecConfig(k=a.k, source=source, exit_layer=layer, ngram_max=a.ngram, draft=draft,
                            baseline=not a.no_baseline, ignore_eos=a.ignore_eos)
        prompt = s.prompt_text(a.prompt, a.chat)
        s.warm_up()  # first-call costs (thread pools, kernel choice) would land on whichever run goes first
        if a.sweep:
            events = sp.sweep(s, prompt, cfg, params, a.max_new_tokens)
        else:
            events = sp.speculate(s, prompt, cfg, params, a.max_new_tokens)
    doc: dict = {"steps": [], "sweep": []}
    for ev in events:
        if isinstance(ev, Failed):
            raise CliError(ev.message)
        _print(ev, doc, a.json, s.tokenizer)
    if a.json:
        doc["machine"] = _machine(s)
        if not a.sweep:
            del doc["sweep"]
            _summary_on_top(doc)
        else:
            del doc["steps"]
        print(json.dumps(stamped(doc, s.info), ensure_ascii=False))
    return 0


def _draft_source(text: str) -> str:
    """--draft's short names (ngram, exit:J, model) as --source's (lookup, early-exit:J, draft-model)."""
    name, sep, layer = text.partition(":")
    long = {"ngram": "lookup", "exit": "early-exit", "model": "draft-model"}.get(name, name)
    return long + sep + layer


def _machine(s) -> dict:
    """The CPU's name and whether it has native bf16 dot products (avx512_bf16) or only avx2."""
    from engine.backends.isa import cpu_flags
    from engine.model.threads import cpu_model

    flags = cpu_flags()
    simd = "avx512_bf16" if "avx512_bf16" in flags else "avx2" if "avx2" in flags else "neither"
    return {"cpu": cpu_model(), "simd": simd, "device": s.info.device, "dtype": s.dtype_name,
            "threads": s.threads.describe() if s.threads is not None else None}


def _summary_on_top(doc: dict) -> None:
    """The figures other tools read, at the top level: ids, acceptance_rate, tokens_per_pass, tpot_s (speculative),
    plain_tpot_s (plain decoding of the same prompt in the same run) and their ratio, speedup."""
    s = doc.get("summary")
    if s is None:
        return
    doc.update(ids=s["ids"], acceptance_rate=s["acceptance_rate"], tokens_per_pass=s["tokens_per_pass"],
               tpot_s=1 / s["tokens_per_s"] if s["tokens_per_s"] > 0 else None,
               plain_tpot_s=doc.get("baseline", {}).get("tpot_s"), speedup=s["speedup"])


def _pct(x: float) -> str:
    return "  -" if np.isnan(x) else f"{100 * x:3.0f}%"


def _print(ev, doc: dict, as_json: bool, tok) -> None:
    from engine.labs import speculative as sp

    if isinstance(ev, sp.SpecStarted):
        config = {k: v for k, v in asdict(ev).items() if k != "prompt_ids"}  # the prompt by its length
        doc["config"] = {**config, "prompt_tokens": len(ev.prompt_ids)}
        if not as_json:
            mode = "greedy" if ev.greedy else "sampling"
            print(f"{ev.model} ({ev.dtype}); {len(ev.prompt_ids)} prompt tokens; k = {ev.k}, {ev.source_label}; {mode}")
    elif isinstance(ev, sp.SpecPrefilled):
        doc["prefill"] = {"n_tokens": ev.n_tokens, "seconds": ev.seconds, "token": ev.token_id}
        if not as_json:
            print(f"prefill  {ev.n_tokens} tokens in {ev.seconds * 1e3:.1f} ms → {ev.piece!r}")
    elif isinstance(ev, sp.SpecStep):
        doc["steps"].append({
            "step": ev.step, "position": ev.position, "drafted": ev.drafted.tolist(), "accepted": ev.n_accepted,
            "token": ev.token_id, "emitted": ev.emitted.tolist(), "text": ev.text, "draft_s": ev.draft_s,
            "verify_s": ev.verify_s, "seconds": ev.seconds, "verify_flops": ev.verify_cost.flops,
            "verify_bytes": ev.verify_cost.bytes, "decode_flops": ev.decode_cost.flops,
            "decode_bytes": ev.decode_cost.bytes,
        })
        if not as_json:
            marks = " ".join(f"{p!r}{'✓' if i < ev.n_accepted else '✗' if i == ev.n_accepted else '·'}"
                             for i, p in enumerate(ev.drafted_pieces)) or "(no draft)"
            print(f"pass {ev.step:3d} @{ev.position:<5d} {marks}  + {ev.piece!r}  → {ev.tokens_gained} tokens; "
                  f"draft {ev.draft_s * 1e3:.1f} ms, verify {ev.verify_s * 1e3:.1f} ms")
    elif isinstance(ev, sp.SpecBaseline):
        doc["baseline"] = {"tokens": len(ev.ids), "tokens_per_s": ev.tokens_per_s, "tpot_s": ev.tpot_s,
                           "reason": ev.reason, "ids": ev.ids.tolist()}
        if not as_json:
            print(f"plain decoding: {len(ev.ids)} tokens, TPOT {ev.tpot_s * 1e3:.1f} ms ({ev.tokens_per_s:.1f} tok/s)")
    elif isinstance(ev, sp.SpecFinished):
        by_pos = ev.acceptance_by_position
        doc["summary"] = {
            "reason": ev.reason, "text": ev.text, "ids": ev.ids.tolist(), "n_tokens": len(ev.ids),
            "n_passes": ev.n_passes, "tokens_per_pass": ev.tokens_per_pass, "acceptance_rate": ev.acceptance_rate,
            "acceptance_by_position": [None if np.isnan(x) else float(x) for x in by_pos],
            "drafted_by_position": ev.drafted_by_position.tolist(),
            "accepted_by_position": ev.accepted_by_position.tolist(), "ttft_s": ev.ttft_s,
            "decode_s": ev.decode_s, "draft_s": ev.draft_s, "verify_s": ev.verify_s,
            "tokens_per_s": ev.tokens_per_s, "baseline_tokens_per_s": ev.baseline_tokens_per_s,
            "speedup": ev.speedup, "matches_baseline": ev.matches_baseline,
            "first_difference": (None if "baseline" not in doc
                                 else sp.first_difference(ev.ids.tolist(), doc["baseline"]["ids"])),
            "differs": ev.differs.to_dict() if ev.differs is not None else None,
        }
        if not as_json:
            print(f"\n{ev.text}\n")
            print(f"{len(ev.ids)} tokens ({ev.reason}) in 1 prefill + {ev.n_passes} full passes: "
                  f"{ev.tokens_per_pass:.2f} tokens per pass; acceptance {100 * ev.acceptance_rate:.0f}% "
                  f"(by position: {' '.join(_pct(x) for x in by_pos)})")
            print(f"time in passes {ev.decode_s:.3f} s: drafting {ev.draft_s:.3f} s, verifying {ev.verify_s:.3f} s")
            line = f"speculative {ev.tokens_per_s:.1f} tok/s"
            if ev.baseline_tokens_per_s > 0:
                line += f", plain {ev.baseline_tokens_per_s:.1f} tok/s: speedup {ev.speedup:.2f}×"
            if ev.matches_baseline:
                line += "; the same tokens as plain greedy decoding"
            elif ev.differs is not None:
                line += f"; plain greedy decoding {ev.differs.sentence()}"
            print(line)
    elif isinstance(ev, sp.SweepStarted):
        doc["config"] = {**asdict(ev), "ks": list(ev.ks)}
        if not as_json:
            print(f"sweep k = {ev.ks[0]}…{ev.ks[-1]}, {ev.source_label}, {ev.max_new_tokens} new tokens")
    elif isinstance(ev, sp.SweepPoint):
        doc["sweep"].append({  # every field, the arrays and the divergence as JSON
            **asdict(ev), "differs": ev.differs.to_dict() if ev.differs is not None else None,
            "acceptance_by_position": [None if np.isnan(x) else float(x) for x in ev.acceptance_by_position],
        })
        if not as_json:
            if ev.k == 1 or len(doc["sweep"]) == 1:
                print(f"{'k':>3} {'accept':>7} {'tok/pass':>9} {'tok/s':>8} {'plain':>8} {'speedup':>8}")
            print(f"{ev.k:3d} {100 * ev.acceptance_rate:6.0f}% {ev.tokens_per_pass:9.2f} {ev.tokens_per_s:8.1f} "
                  f"{ev.baseline_tokens_per_s:8.1f} {ev.speedup:7.2f}×")

"""The command line over the same event stream the app uses: `python -m engine {info,tokenize,logits,generate,…}`.

Bad input prints one line to stderr, without a traceback: a flag's value that cannot be right (refused by the
parser's types in engine.cliargs) or that does not fit the loaded model exits with 2, a missing or damaged model or
a prompt too long for it with 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence

from engine.backends import lab_model_from_args, session_from_args
from engine.cliargs import (
    CliError,
    Parser,
    UsageError,
    add_local_model_args,
    add_model_args,
    add_sampling_args,
    add_threads_arg,
    check_bias,
    int_in,
    int_list,
    one_line,
    regex,
    sampling_params,
    stamped,
    threads,
)
from engine.remote.client import clean_text
from engine.run import kernels_cli
from engine.why.steer import steer_arg


def cmd_info(a: argparse.Namespace) -> int:
    from dataclasses import asdict

    from engine.loaders import ModelLoadError, load

    with one_line(ModelLoadError):
        info = load(a.model, device=a.device, dtype=a.dtype, kernels=a.kernels).info
    d = asdict(info)
    if a.json:
        print(json.dumps(d, indent=2))
    else:
        width = max(map(len, d))
        for k, v in d.items():
            print(f"{k:<{width}}  {v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{k:<{width}}  {v}")
    return 0


def cmd_tokenize(a: argparse.Namespace) -> int:
    from engine.formats.locate import ModelLoadError  # no torch: starts in a fraction of a second
    from engine.tokenizer.load import load_tokenizer

    with one_line(ModelLoadError):
        tok = load_tokenizer(a.model)  # the tokenizer only: no weights are read
    with one_line(ValueError):  # a base model without a chat template
        text = tok.chat_prompt(a.text) if a.chat else a.text
    t = tok.encode(text)
    if t.unrepresentable:
        bad = ", ".join(f"0x{b:02X} at byte {o}" for o, b in t.unrepresentable)
        print(f"warning: the vocabulary has no token for {len(t.unrepresentable)} byte(s): {bad}", file=sys.stderr)
    if a.json:
        print(json.dumps({
            "ids": t.ids, "pieces": t.pieces, "offsets": [list(o) for o in t.offsets],
            "byte_offsets": [list(o) for o in t.byte_offsets],
            "unrepresentable": [list(u) for u in t.unrepresentable],
        }, ensure_ascii=False))
    else:
        for i, (tid, piece, (s, e)) in enumerate(zip(t.ids, t.pieces, t.offsets, strict=True)):
            print(f"{i:5d} {tid:7d}  [{s:4d},{e:4d})  {piece!r}")
        print(f"{len(t.ids)} tokens, {len(text)} characters")
    return 0


def cmd_logits(a: argparse.Namespace) -> int:
    import torch

    from engine.run.sampling import funnel

    params = sampling_params(a)
    s = session_from_args(a)
    check_bias(params, s.cfg.vocab_size)
    with one_line(ValueError):
        t = s.tokenize(a.prompt, a.chat)
        logits, _, _ = s.next_token_logits(t.ids)
    st = funnel(logits, params, torch.tensor(t.ids))
    top = torch.topk(st.logits, min(a.top, st.logits.shape[-1])).indices.tolist()
    cands = [
        {"id": i, "token": s.tokenizer.piece(i), "logit": float(st.logits[i]), "prob_raw": float(st.p_raw[i]),
         "prob": float(st.p_final[i])}
        for i in top
    ]
    if a.json:
        print(json.dumps(stamped({"prompt_ids": t.ids, "candidates": cands, "kept": st.kept_final}, s.info),
                         ensure_ascii=False))
    else:
        vocab = st.logits.shape[-1]
        print(f"{len(t.ids)} prompt tokens; {st.kept_final} of {vocab} tokens survive the sampling stages")
        print(f"{'id':>7} {'token':<20} {'logit':>9} {'p raw':>8} {'p':>8}")
        for c in cands:
            print(f"{c['id']:7d} {c['token']!r:<20} {c['logit']:9.3f} {c['prob_raw']:8.4f} {c['prob']:8.4f}")
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from engine.run.branching import check_forced, parse_force

    params = sampling_params(a)
    with one_line(usage=(ValueError,)):
        forced = parse_force(a.force)
    schema = None
    if a.regex is not None and a.json_schema is not None:
        raise UsageError("give --regex or --json-schema, not both")
    if a.json_schema is not None:
        try:
            with open(a.json_schema, encoding="utf-8") as fh:
                schema = fh.read()
        except OSError as e:
            raise CliError(f"cannot read the JSON schema {a.json_schema}: {e.strerror or e}") from None
    s = session_from_args(a)
    check_bias(params, s.cfg.vocab_size)
    with one_line(usage=(ValueError,)):
        check_forced(forced, s.cfg.vocab_size, a.max_new_tokens)
    with one_line(ValueError):
        constraint = None
        if a.regex is not None or schema is not None:
            from engine.run.constrain import Constraint

            eos = [*s.tokenizer.eos_ids, *sorted(set(s.stop_ids) - set(s.tokenizer.eos_ids))]
            constraint = Constraint.build(s.tokenizer, s.cfg.vocab_size, eos, regex=a.regex, json_schema=schema)
        gen = s.generate(a.prompt, params, a.max_new_tokens, chat=a.chat, ignore_eos=a.ignore_eos, forced=forced,
                         constraint=constraint)
        steer = contextlib.nullcontext()
        if a.steer is not None:
            from engine.why.steer import load_for, steering

            steer = steering(s, load_for(s, a.steer[0]), a.steer[1])
    with steer as handle:
        steered = None if handle is None else {"vector": os.path.basename(a.steer[0]), "layers": handle.layers,
                                                 "scale": a.steer[1]}
        return _print_run(a, s, gen, steered)


def _print_run(a: argparse.Namespace, s: object, gen, steered: dict | None = None) -> int:
    """Print a run's text as it comes, then its figures (JSON with --json); a steered run says its vector, layers
    and scale in both."""
    from engine.events import Failed, Finished, TokenSampled

    done_forced: list[list[int]] = []
    recorder = None
    if a.trace:
        from engine.run.trace import TraceRecorder, check_writable

        with one_line(OSError):
            check_writable(a.trace)
        recorder = TraceRecorder()
    for ev in gen:
        if recorder is not None:
            recorder.add(ev)
        if isinstance(ev, TokenSampled):
            if ev.forced:
                done_forced.append([ev.step, ev.token_id])
            if not a.json:
                print(ev.text, end="", flush=True)
        elif isinstance(ev, Failed):
            raise CliError(ev.message)
        elif isinstance(ev, Finished):
            if recorder is not None:
                with one_line(OSError):
                    recorder.write(a.trace)
            if a.json:
                print(json.dumps(stamped({
                    "prompt_ids": ev.prompt_ids.tolist(), "ids": ev.ids.tolist(), "text": ev.text,
                    "ttft_s": ev.ttft_s, "tpot_s": ev.tpot_s, "tokens_per_s": ev.tokens_per_s,
                    "total_s": ev.total_s, "finish_reason": ev.reason, "forced": done_forced,
                    "step_seconds": [round(float(x), 6) for x in ev.step_seconds],
                    **({} if steered is None else {"steered": steered}),
                }, s.info), ensure_ascii=False))
            else:
                print()
                print(
                    f"[{len(ev.ids)} tokens, {ev.reason}; TTFT {ev.ttft_s * 1e3:.1f} ms, "
                    f"TPOT {ev.tpot_s * 1e3:.1f} ms ({ev.tokens_per_s:.1f} tok/s)]", file=sys.stderr,
                )
                if steered is not None:
                    print(f"[steered by {steered['vector']} at layers {steered['layers']} × {steered['scale']:+g}]",
                          file=sys.stderr)
    return 0


def cmd_lens(a: argparse.Namespace) -> int:
    from engine.events import Failed, LensCaptured, TokenSampled
    from engine.run.lens import lens_rows
    from engine.run.session import Capture

    params = sampling_params(a)
    s = session_from_args(a)
    check_bias(params, s.cfg.vocab_size)
    fitted = _tuned_lens(a, s) if a.tuned else None
    with one_line(ValueError):
        n_prompt = len(s.tokenize(a.prompt, a.chat).ids)
        room = s.cfg.context_length - n_prompt - 1  # the decode step whose token takes the context's last position
        if a.step > room:
            raise UsageError(f"--step {a.step} is past this model's context: {n_prompt} prompt tokens leave room for "
                             f"steps 0 to {max(room, 0)} of {s.cfg.context_length} positions")
        gen = s.generate(a.prompt, params, a.step + 1, Capture(lens_top=min(a.top, s.cfg.vocab_size)), chat=a.chat)
    lens: LensCaptured | None = None
    chosen: TokenSampled | None = None
    last = -1
    for ev in gen:
        if isinstance(ev, LensCaptured) and ev.step == a.step:
            lens = ev
        elif isinstance(ev, TokenSampled):
            last = ev.step
            if ev.step == a.step:
                chosen = ev
        elif isinstance(ev, Failed):
            raise CliError(ev.message)
    if lens is None or chosen is None:
        raise CliError(f"the generation ended at step {last} (end of text) before step {a.step}")
    rows = lens_rows(lens)
    if a.json:
        out = {"prompt_ids": gen.prompt.ids, "step": a.step, "position": lens.position,
               "sampled": {"id": chosen.token_id, "token": chosen.piece}, "layers": rows}
        if fitted is not None:
            from engine.why.tuned_lens import summary

            out["tuned_lens"] = summary(fitted)
        print(json.dumps(stamped(out, s.info), ensure_ascii=False))
    else:
        shown = lens.tuned if lens.tuned is not None else lens
        print(f"step {a.step} (position {lens.position}); the model chose {chosen.piece!r} ({chosen.token_id})"
              + ("; the tuned lens's top tokens, each lens's KL to the output" if lens.tuned is not None else ""))
        kl = f"{'KL logit':>9} {'KL tuned':>9}" if lens.tuned is not None else f"{'KL bits':>8}"
        print(f"{'layer':<10} {'H bits':>7} {kl}  top tokens")
        for r, t in zip(rows, lens_rows(shown), strict=True):
            tops = "  ".join(f"{x['token']!r} {x['prob']:.3f}" for x in t["top"])
            kls = (f"{r['kl_bits']:9.3f} {t['kl_bits']:9.3f}" if lens.tuned is not None else f"{r['kl_bits']:8.3f}")
            print(f"{r['name']:<10} {t['entropy_bits']:7.2f} {kls}  {tops}")
    return 0


def _tuned_lens(a: argparse.Namespace, s):
    """The loaded model's tuned lens, put in use: the one saved for its file, else (or with --refit) fitted now on
    --corpus (Python's help text by default) and saved; progress on stderr."""
    from engine.backend import Unsupported
    from engine.why import tuned_lens as tl

    tokens = tl.DEFAULT_TOKENS if a.fit_tokens is None else a.fit_tokens
    steps = tl.DEFAULT_STEPS if a.fit_steps is None else a.fit_steps
    with one_line(ValueError, Unsupported):
        fitted = None if a.refit or a.corpus else tl.load_for(s)
        if fitted is None:
            print(f"fitting a tuned lens for {s.info.name} ({tokens:,} tokens, {steps} KL steps)…", file=sys.stderr)
            last = [-1]

            def progress(f: float, message: str) -> None:
                if int(f * 10) != last[0]:
                    last[0] = int(f * 10)
                    print(f"  {f:4.0%} {message}", file=sys.stderr)

            fitted = tl.fit(s, a.corpus, tokens=tokens, steps=steps, progress=progress)
            print(f"saved to {tl.save(fitted, tl.saved_path(s))}", file=sys.stderr)
        tl.use(s, fitted)
    return fitted


def cmd_models(a: argparse.Namespace) -> int:
    from engine.formats.discover import discover, memory_available

    memory = memory_available()
    entries = discover(memory=memory)
    if a.json:
        print(json.dumps({"memory_available": memory, "models": [e.to_json() for e in entries]}, indent=2))
        return 0
    print(f"{len(entries)} models; {memory / 2**30:.1f} GiB of memory available now")
    for e in entries:
        params = f"{e.n_params / 1e6:,.0f}M" if e.n_params else "?"
        quant = ",".join(sorted(e.quant_types)) or "-"
        fits = "fits" if e.fits.get(a.dtype) else "too big" if e.fits else "?"
        arch = e.architecture or (e.error and "unreadable") or "?"
        print(f"{e.source:<11} {e.name:<48} {arch:<10} {params:>8} {e.file_bytes / 2**20:>9,.0f} MiB  {quant:<24} "
              f"{a.dtype}: {fits}")
    return 0


def cmd_bench_batch(a: argparse.Namespace) -> int:
    import psutil

    from engine.labs.batching import bench_batch

    batches = a.batches
    lm = lab_model_from_args(a)
    if a.prompt_tokens + a.new_tokens > lm.cfg.context_length:
        raise UsageError(f"--prompt-tokens {a.prompt_tokens} and --new-tokens {a.new_tokens} make "
                         f"{a.prompt_tokens + a.new_tokens} positions, past this model's context of "
                         f"{lm.cfg.context_length}")
    memory = psutil.virtual_memory().available * 0.5
    rows = bench_batch(lm, batches, a.prompt_tokens, a.new_tokens,
                       progress=None if a.json else lambda f, m: print(f"  {m}", file=sys.stderr),
                       memory_limit_bytes=memory)
    if len(rows) < len(batches):  # bench_batch stops at the first batch whose KV cache does not fit
        skipped = batches[len(rows)]
        message = (f"batch {skipped} needs more KV cache than half the memory available now "
                   f"({memory / 2**30:.1f} GiB)")
        if not rows:
            raise UsageError(message)
        print(f"warning: {message}: stopped before it", file=sys.stderr)
    if a.json:
        print(json.dumps([stamped(r.to_dict(), lm.info) for r in rows], indent=2))
        return 0
    print(f"{'batch':>5}{'TPOT':>11}{'tok/s/stream':>14}{'tok/s system':>14}{'FLOP/B':>8}{'GFLOP/s':>9}{'GB/s':>7}")
    for r in rows:
        print(f"{r.batch:>5}{r.tpot_s * 1e3:>8.1f} ms{r.tokens_per_s_per_stream:>14.1f}{r.tokens_per_s_system:>14.1f}"
              f"{r.intensity:>8.1f}{r.achieved_flops / 1e9:>9.1f}{r.achieved_bandwidth / 1e9:>7.1f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m engine", description="Inference Lab's engine on the command line.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    q = sub.add_parser("info", help="facts about the model")
    add_model_args(q)
    q.set_defaults(func=cmd_info, local_only="reads the model file itself, which a server does not report")

    q = sub.add_parser("models", help="the models on this machine (headers only), as the model picker lists them")
    q.add_argument("--json", action="store_true", help="print JSON instead of text")
    q.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the dtype whose memory need the text listing checks (JSON gives all)")
    q.set_defaults(func=cmd_models)

    q = sub.add_parser("tokenize", help="ids, pieces and spans of a text")
    add_model_args(q)
    q.add_argument("--text", required=True)
    q.add_argument("--chat", action="store_true", help="wrap the text in the chat template first")
    q.set_defaults(func=cmd_tokenize)

    q = sub.add_parser("logits", help="next-token candidates for a prompt")
    add_model_args(q)
    add_sampling_args(q)
    q.add_argument("--prompt", required=True)
    q.add_argument("--chat", action="store_true")
    q.add_argument("--top", type=int_in(1), default=10)
    add_threads_arg(q)
    q.set_defaults(func=cmd_logits)

    q = sub.add_parser("generate", help="generate text, streaming it")
    add_model_args(q)
    add_sampling_args(q)
    q.add_argument("--prompt", required=True)
    q.add_argument("--chat", action="store_true")
    q.add_argument("--max-new-tokens", type=int_in(1), default=128)
    q.add_argument("--ignore-eos", action="store_true")
    q.add_argument("--force", action="append", default=[], metavar="STEP:TOKEN_ID",
                   help="put TOKEN_ID at generation step STEP instead of sampling (repeatable; step 0 = first token)")
    q.add_argument("--regex", type=regex, default=None, metavar="R",
                   help="the output must match this regular expression (constrained decoding, llguidance)")
    q.add_argument("--json-schema", default=None, metavar="FILE",
                   help="the output must be JSON valid under the schema in FILE")
    q.add_argument("--trace", metavar="FILE.json", default=None,
                   help="write a Perfetto / Chrome trace: one slice per prefill and decode step")
    q.add_argument("--steer", type=steer_arg, default=None, metavar="FILE:SCALE",
                   help="add a steering vector (a llama.cpp control vector, `engine steer --out`) × SCALE to the "
                        "residual stream of its layers at every position")
    add_threads_arg(q)
    kernels_cli.add_kernel_arg(q)
    q.set_defaults(func=cmd_generate)

    q = sub.add_parser("lens", help="logit lens: the next-token guess after every layer")
    add_model_args(q)
    add_sampling_args(q)
    q.add_argument("--prompt", required=True)
    q.add_argument("--chat", action="store_true")
    q.add_argument("--step", type=int_in(0), default=0,
                   help="0 = the prefill's prediction; K = the K-th decode step of a generation with these settings")
    q.add_argument("--top", type=int_in(1), default=5)
    q.add_argument("--tuned", action="store_true",
                   help="also read every layer through the tuned lens saved for this model file (fitted first, and "
                        "saved in the engine's cache, when there is none): its top tokens, and both lenses' KL to the "
                        "output")
    q.add_argument("--corpus", default=None, metavar="FILE",
                   help="with --tuned: fit on this UTF-8 text (default: Python's help text) even if a lens is saved")
    q.add_argument("--refit", action="store_true", help="with --tuned: fit again even if a lens is saved")
    q.add_argument("--fit-tokens", type=int_in(256), default=None,
                   help="with --tuned: training tokens of a fit (default: engine.why.tuned_lens.DEFAULT_TOKENS)")
    q.add_argument("--fit-steps", type=int_in(0), default=None,
                   help="with --tuned: KL steps after the least-squares start (default: DEFAULT_STEPS there)")
    add_threads_arg(q)
    q.set_defaults(func=cmd_lens, local_only="needs every layer's residual stream, which a server does not report")

    q = sub.add_parser("bench-batch", help="measure batched decode: TPOT and tokens/s per stream and system")
    add_local_model_args(q)
    q.add_argument("--batches", type=int_list(1, 1024), default=[1, 2, 4, 8, 16, 32],
                   help="batch sizes, e.g. 1,2,4,8,16,32")
    q.add_argument("--prompt-tokens", type=int_in(1), default=32)
    q.add_argument("--new-tokens", type=int_in(2), default=16, help="at least 2: one decode step to time")
    q.add_argument("--threads", type=threads, default="auto", help="auto (torch's count) or a fixed count")
    q.set_defaults(func=cmd_bench_batch)

    from engine.cli import export_hf, fleet, schedule, speculate
    from engine.costs import estimate
    from engine.remote import cli as remote_cli
    from engine.why import cli as why_cli

    for commands in (estimate, export_hf, remote_cli, speculate, schedule, kernels_cli):
        commands.add_subcommand(sub)
    why_cli.add_subcommands(sub)
    fleet.add_subcommands(sub)
    return p


# The commands that also run on a server (--url); those that set `local_only` say in one line why they cannot.
ON_SERVER = {"tokenize": "cmd_tokenize", "logits": "cmd_logits", "generate": "cmd_generate"}


def resolve(args: argparse.Namespace):
    """The function that runs `args`: the local command, or its server version when --url is given (once, here)."""
    if getattr(args, "local_only", None) and getattr(args, "url", None):
        raise UsageError(f"`{args.command}` {args.local_only}: drop --url to run it on the local model")
    if args.command in ON_SERVER and getattr(args, "url", None):
        from engine.remote import cli

        return getattr(cli, ON_SERVER[args.command])
    return args.func


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with kernels_cli.forcing(getattr(args, "kernel", None)):
            return int(resolve(args)(args) or 0)
    except CliError as e:
        print(f"error: {clean_text(str(e), 600)}", file=sys.stderr)  # one line, whatever a library's text holds
        return 2 if isinstance(e, UsageError) else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

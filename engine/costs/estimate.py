"""Capacity estimator: will a model fit on a chip, and how fast can it prefill and decode there?

Memory: weights (parameters × bytes per value) plus the KV cache (context × batch × KV bytes per token) must
fit in the chip's memory; activations and framework overhead are left out, so treat "fits" as an upper
bound. Speed: each step is timed with the roofline of engine.costs.formulas, max(FLOPs / peak, bytes / bandwidth).
Decode: one step yields one token for each of the `batch` sequences, so per-stream speed is 1 / step time
and the system's is batch / step time; the TPOT floor is the memory side alone (bytes per step / bandwidth).
TTFT: the prefill of one prompt of `prompt_tokens` tokens with the chip to itself (no queueing, no
batching). All sizes are decimal (1 GB = 10⁹ bytes), as in vendors' datasheets.

CLI: `python -m engine estimate --preset llama-2-70b --hardware h100-sxm --dtype fp16 --context 4096`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from engine.costs import formulas as costs
from engine.costs.catalog import Hardware, UnknownNameError, canonical_dtype, hardware_preset, model_preset
from engine.model import dtypes
from engine.model.config import ModelConfig

THIS_MACHINE = "this-machine"
DTYPE_CHOICES = dtypes.ACCEPTED


def _resolve_hardware(hardware: Hardware | str, dtype: str) -> Hardware:
    if not isinstance(hardware, str):
        return hardware
    if hardware.strip().lower() == THIS_MACHINE:
        from engine.costs.hardware import cached_this_machine  # imports torch; only needed for this choice

        measurable = canonical_dtype(dtype) in dtypes.MEASURABLE
        return cached_this_machine("cpu", dtype if measurable else "float32")
    try:
        return hardware_preset(hardware)
    except UnknownNameError as e:
        raise UnknownNameError(f"{e}, {THIS_MACHINE}") from None


def estimate(
    cfg: ModelConfig | str,
    hardware: Hardware | str,
    dtype: str,
    context: int,
    batch: int,
    prompt_tokens: int | None = None,
    *,
    kv_dtype: str | None = None,
) -> dict[str, Any]:
    """Memory footprint and roofline speeds of `cfg` on `hardware` (bytes, seconds, tokens/s)."""
    cfg = model_preset(cfg) if isinstance(cfg, str) else cfg
    hw = _resolve_hardware(hardware, dtype)
    kv_dtype = kv_dtype or dtype
    costs.bytes_per_value(dtype)
    costs.bytes_per_value(kv_dtype)
    for name, value in (("context", context), ("batch", batch)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    prompt = context if prompt_tokens is None else prompt_tokens
    if int(prompt) != prompt or not 1 <= prompt <= context:
        raise ValueError(f"prompt tokens must be between 1 and the context ({context}), got {prompt!r}")

    peak = hw.peak_for(dtype)
    bw = hw.bandwidth_bytes_per_s
    weights = costs.weight_bytes(cfg, dtype)
    kv_token = costs.kv_bytes_per_token(cfg, kv_dtype)
    kv_total = kv_token * context * batch
    free_for_kv = max(0.0, hw.memory_bytes - weights)
    max_batch = int(free_for_kv // (kv_token * context))
    max_context_memory = int(free_for_kv // (kv_token * batch))
    max_context = min(max_context_memory, cfg.context_length)

    decode = costs.decode_cost(cfg, context, batch=batch, weight_dtype=dtype, kv_dtype=kv_dtype)
    decode_s = costs.step_time_estimate_s(decode, peak, bw)
    prefill = costs.prefill_cost(cfg, prompt, weight_dtype=dtype, kv_dtype=kv_dtype)
    ridge = costs.ridge_point(peak, bw)
    return {
        "model": cfg.name,
        "hardware": hw.name,
        "hardware_label": hw.label,
        "dtype": canonical_dtype(dtype),
        "kv_dtype": canonical_dtype(kv_dtype),
        "context": int(context),
        "batch": int(batch),
        "prompt_tokens": int(prompt),
        "model_context_length": cfg.context_length,
        "context_exceeds_model": context > cfg.context_length,
        "n_params": costs.n_params(cfg),
        "weights_bytes": weights,
        "kv_bytes_per_token": kv_token,
        "kv_bytes": kv_total,
        "total_bytes": weights + kv_total,
        "memory_bytes": hw.memory_bytes,
        "fits": weights + kv_total <= hw.memory_bytes,
        "max_batch_at_context": max_batch,
        "max_context_at_batch": max_context,
        "max_context_limited_by": "model" if max_context_memory >= cfg.context_length else "memory",
        "peak_flops": peak,
        "bandwidth_bytes_per_s": bw,
        "ridge_point": ridge,
        "decode_flops": decode.flops,
        "decode_bytes": decode.bytes,
        "arithmetic_intensity": decode.intensity,
        "tpot_floor_s": decode.bytes / bw,
        "tpot_estimate_s": decode_s,
        "tokens_per_s_per_stream": 1.0 / decode_s,
        "tokens_per_s_system": batch / decode_s,
        "prefill_flops": prefill.flops,
        "prefill_bytes": prefill.bytes,
        "prefill_intensity": prefill.intensity,
        "ttft_estimate_s": costs.step_time_estimate_s(prefill, peak, bw),
        "compute_bound_prefill": prefill.intensity >= ridge,
        "memory_bound_decode": decode.intensity < ridge,
        "hardware_source": hw.source,
        "hardware_measured": hw.measured,
    }


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def _ms(x: float) -> str:
    return f"{x * 1e3:,.2f} ms"


def format_table(r: dict[str, Any]) -> str:
    """The estimate as an aligned, human-readable table with units."""
    bound = "memory-bound" if r["memory_bound_decode"] else "compute-bound"
    pbound = "compute-bound" if r["compute_bound_prefill"] else "memory-bound"
    limit = " (model's limit)" if r["max_context_limited_by"] == "model" else ""
    rows = [
        ("parameters", f"{r['n_params'] / 1e9:,.3f} B"),
        ("weights", _gb(r["weights_bytes"])),
        ("KV cache per token", f"{r['kv_bytes_per_token'] / 1e3:,.1f} KB"),
        (f"KV cache ({r['context']:,} × {r['batch']})", _gb(r["kv_bytes"])),
        ("weights + KV cache", _gb(r["total_bytes"])),
        ("memory", _gb(r["memory_bytes"])),
        ("fits", "yes" if r["fits"] else "NO"),
        (f"max batch at context {r['context']:,}", f"{r['max_batch_at_context']:,}"),
        (f"max context at batch {r['batch']}", f"{r['max_context_at_batch']:,}{limit}"),
        ("peak compute", f"{r['peak_flops'] / 1e12:,.1f} TFLOP/s"),
        ("memory bandwidth", f"{r['bandwidth_bytes_per_s'] / 1e9:,.0f} GB/s"),
        ("ridge point", f"{r['ridge_point']:,.1f} FLOP/byte"),
        ("decode intensity", f"{r['arithmetic_intensity']:,.2f} FLOP/byte ({bound})"),
        ("decode bytes per step", _gb(r["decode_bytes"])),
        ("TPOT floor (bytes / bandwidth)", _ms(r["tpot_floor_s"])),
        ("TPOT estimate (roofline)", _ms(r["tpot_estimate_s"])),
        ("tokens/s per stream", f"{r['tokens_per_s_per_stream']:,.1f} tok/s"),
        ("tokens/s system", f"{r['tokens_per_s_system']:,.1f} tok/s"),
        (
            f"prefill intensity ({r['prompt_tokens']:,} tokens)",
            f"{r['prefill_intensity']:,.0f} FLOP/byte ({pbound})",
        ),
        ("TTFT estimate (prefill)", _ms(r["ttft_estimate_s"])),
    ]
    width = max(len(k) for k, _ in rows)
    vwidth = max(len(v.split(" ", 1)[0]) for _, v in rows)
    head = f"{r['model']} on {r['hardware_label']}: weights {r['dtype']}, KV {r['kv_dtype']}"
    lines = [head, "-" * len(head)]
    for k, v in rows:
        number, _, unit = v.partition(" ")
        lines.append(f"{k:<{width}}  {number:>{vwidth}} {unit}".rstrip())
    if r["context_exceeds_model"]:
        limit = r["model_context_length"]
        lines.append(f"note: context {r['context']:,} is past the model's {limit:,} positions")
    lines.append(f"source: {r['hardware_source']}")
    return "\n".join(lines)


def run_estimate(args: argparse.Namespace) -> int:
    """Run the `estimate` subcommand: print a table (or JSON); an error prints one line and exits 2."""
    try:
        result = estimate(
            args.preset, args.hardware, args.dtype, args.context, args.batch, args.prompt_tokens,
            kv_dtype=args.kv_dtype,
        )
    except (KeyError, ValueError) as e:  # UnknownNameError is both
        print(f"estimate: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Add `estimate` to a CLI's subparsers; it sets func=run_estimate."""
    from engine.cliargs import int_in  # counts past 2**31 overflowed the float arithmetic into a traceback

    p = subparsers.add_parser(
        "estimate",
        help="memory and roofline speed of a catalogue model on a catalogue chip",
        description="Estimate memory use, TTFT, TPOT and tokens/s of a model on a chip (roofline model).",
    )
    p.add_argument("--preset", default="smollm2-135m", help="catalogue model, e.g. llama-2-70b")
    p.add_argument("--hardware", default="h100-sxm", help=f"catalogue chip, e.g. h100-sxm, or {THIS_MACHINE}")
    p.add_argument("--dtype", default="fp16", help=f"weight and KV dtype: {', '.join(DTYPE_CHOICES)}")
    p.add_argument("--kv-dtype", default=None, help="KV cache dtype when it differs from --dtype")
    p.add_argument("--context", type=int_in(1), default=4096, help="tokens held per sequence")
    p.add_argument("--batch", type=int_in(1), default=1, help="sequences decoded together")
    p.add_argument("--prompt-tokens", type=int_in(1), default=None, help="prompt length for TTFT (default: context)")
    p.add_argument("--json", action="store_true", help="print every number as JSON")
    p.set_defaults(func=run_estimate)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point with just the `estimate` subcommand."""
    from engine.cliargs import Parser  # one line per error, as `python -m engine` prints it

    parser = Parser(prog="engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_subcommand(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

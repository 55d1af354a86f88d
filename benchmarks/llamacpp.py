"""The llama.cpp backend against this engine's own Session and plain llama-cpp-python, in one run:
`python -m benchmarks.llamacpp [--models smollm2,1b] [--tokens 32] [--repeats 2]`.

For each model it prints the decode TPOT (median step), TTFT and peak RSS of
  session      this engine's Session, float32 (every GGUF weight dequantized);
  lcpp-none    engine.backends.llamacpp with nothing captured (the callback answers "no" to every node);
  lcpp-all     the same with Capture.everything: attention of every layer, residual norms, funnel, raw logits;
  lcpp-lens    lcpp-all plus a logit lens (L + 2 LM heads per step, float32 norm and head read from the file);
  Llama        plain llama_cpp.Llama (greedy, its own sampler), the speed floor of the same library;
with the ratios between them, the CPU's flags and the thread count.

Each configuration runs in a fresh process (peak RSS is that process's own), and the repeats are interleaved
(A, B, C, …, then A, B, C, …) so slow drifts of a shared machine fall on all of them; the machine's load average is
printed before and after. Every llama.cpp context holds the same --n-ctx positions.

Models: `smollm2` is the default model's Q4_1 GGUF; `1b` is a 1B-scale Llama-shaped GGUF of random weights (16
layers, d_model 2048, FFN 8192, 32 query / 8 KV heads, vocabulary 49,152 with SmolLM2's tokenizer metadata copied
so the tokenizer works), quantized to Q4_0 (or --quant Q8_0), built once under ~/.cache/inference-lab/bench. The
Session's first load of it converts the weights into the engine's cache; that happens in a separate process first,
so the measured loads read the cache as the app would.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

PROMPT = "Explain what a KV cache is in two sentences."
CONFIGS = ("session", "lcpp-none", "lcpp-all", "lcpp-lens", "Llama")
BIG = dict(n_layers=16, d_model=2048, ffn=8192, n_heads=32, n_kv_heads=8, context=8192, rope_base=100000.0)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    have = set(flags.split(":", 1)[1].split())
    if "avx512_bf16" in have:
        return "avx512_bf16 (native bf16 dot products)"
    return ", ".join(f for f in ("avx512f", "avx2", "fma") if f in have) or "no AVX2"


# ---- the 1B-scale file ------------------------------------------------------------------------------------------
def build_big(path: Path, quant: str = "Q4_0", seed: int = 0) -> Path:
    """A Llama-shaped GGUF of random weights with SmolLM2's tokenizer; written to a temporary name, then renamed."""
    import gguf

    from engine.formats.locate import default_model_path

    qtype = gguf.GGMLQuantizationType[quant]
    src = gguf.GGUFReader(str(default_model_path()))
    c = BIG
    hd = c["d_model"] // c["n_heads"]
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(path.stem)
    w.add_block_count(c["n_layers"])
    w.add_context_length(c["context"])
    w.add_embedding_length(c["d_model"])
    w.add_feed_forward_length(c["ffn"])
    w.add_head_count(c["n_heads"])
    w.add_head_count_kv(c["n_kv_heads"])
    w.add_rope_freq_base(c["rope_base"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{quant}"])
    vocab = 0
    for key, field in src.fields.items():  # SmolLM2's tokenizer, chat template and special ids, as they are
        if not key.startswith("tokenizer."):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub)
        if key == "tokenizer.ggml.tokens":
            vocab = len(field.data)
    w.add_vocab_size(vocab)
    rng = np.random.default_rng(seed)

    def add(name: str, rows: int, cols: int, scale: float = 0.02) -> None:
        a = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(scale)
        q = gguf.quants.quantize(a, qtype)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    add("token_embd.weight", vocab, c["d_model"], 1.0)  # tied: also the output matrix
    w.add_tensor("output_norm.weight", np.ones(c["d_model"], dtype=np.float32))
    d, kv = c["d_model"], c["n_kv_heads"] * hd
    for i in range(c["n_layers"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(d, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(d, dtype=np.float32))
        add(p + "attn_q.weight", d, d)
        add(p + "attn_k.weight", kv, d)
        add(p + "attn_v.weight", kv, d)
        add(p + "attn_output.weight", d, d)
        add(p + "ffn_gate.weight", c["ffn"], d)
        add(p + "ffn_up.weight", c["ffn"], d)
        add(p + "ffn_down.weight", d, c["ffn"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)
    return path


def big_path(quant: str) -> Path:
    from engine.formats.locate import cache_root

    return cache_root() / "bench" / f"llama-1b-random.{quant}.gguf"


# ---- one configuration, in this process --------------------------------------------------------------------------
def run_one(config: str, model: str, tokens: int, n_ctx: int, threads: int) -> dict:
    from engine.formats.locate import load_tokenizer

    tok = load_tokenizer(model)
    try:
        ids = tok.encode(tok.chat_prompt(PROMPT)).ids
    except ValueError:
        ids = tok.encode(PROMPT).ids
    t0 = time.perf_counter()
    if config == "Llama":
        from llama_cpp import Llama

        llm = Llama(model_path=model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
        load_s, rss_loaded = time.perf_counter() - t0, _rss()

        def generate(n: int) -> tuple[float, list[float]]:
            llm.reset()  # no prefix reuse: every configuration prefills the whole prompt
            stamps = [time.perf_counter()]
            for i, _ in enumerate(llm.generate(ids, top_k=1, temp=0.0, reset=True)):
                stamps.append(time.perf_counter())
                if i + 1 >= n:
                    break
            gaps = np.diff(stamps)
            return float(gaps[0]), list(gaps[1:])
    else:
        from engine.events import Finished
        from engine.protocol import Capture, SamplingParams

        if config == "session":
            from engine.loaders import load
            from engine.run.session import Session

            session = Session(load(model, device="cpu", dtype="float32"), threads=threads)
        else:
            from engine.backends.llamacpp import LlamaCppSession

            session = LlamaCppSession(model, threads=threads, n_ctx=n_ctx)
        load_s, rss_loaded = time.perf_counter() - t0, _rss()
        n_layers = session.cfg.n_layers
        capture = {"session": Capture(), "lcpp-none": Capture(), "lcpp-all": Capture.everything(n_layers),
                   "lcpp-lens": replace(Capture.everything(n_layers), lens_top=5)}[config]

        def generate(n: int) -> tuple[float, list[float]]:
            session.forget_cache()
            fin = [e for e in session.generate(ids, SamplingParams.greedy_params(), n, capture, ignore_eos=True)
                   if isinstance(e, Finished)]
            if not fin:
                raise RuntimeError(f"{config}: the generation failed")
            return fin[0].ttft_s, list(fin[0].step_seconds)

    generate(4)  # first-call costs (graph allocation, thread start, kernel choice) are not what TPOT measures
    ttft, steps = generate(tokens)
    return {"config": config, "tpot_s": float(np.median(steps)), "ttft_s": ttft, "load_s": load_s,
            "rss_loaded": rss_loaded, "peak_rss": _peak_rss()}


def _worker(config: str, model: str, tokens: int, n_ctx: int, threads: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.llamacpp", "--worker", config, "--model-path", model,
           "--tokens", str(tokens), "--n-ctx", str(n_ctx), "--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{config} on {Path(model).name} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gb(n: float) -> str:
    return f"{n / 2**30:.2f} GB"


def bench_model(name: str, model: str, args: argparse.Namespace, threads: int) -> None:
    # the Session's weight cache is written once, outside the measured processes
    subprocess.run([sys.executable, "-c", f"from engine.loaders import load; load({model!r}, device='cpu', "
                    "dtype='float32')"], check=True, timeout=3600)
    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    for _ in range(args.repeats):
        for c in args.configs:
            runs[c].append(_worker(c, model, args.tokens, args.n_ctx, threads))
    size = Path(model).stat().st_size
    print(f"\n{name}: {Path(model).name} ({_gb(size)}), {args.tokens} new tokens, n_ctx {args.n_ctx}, "
          f"median of {args.repeats} interleaved runs")
    print(f"  {'config':<10} {'TPOT ms':>9} {'tok/s':>7} {'TTFT ms':>9} {'load s':>7} {'RSS loaded':>11} "
          f"{'peak RSS':>10} {'peak/file':>9}")
    med: dict[str, dict] = {}
    for c, rs in runs.items():
        m = {k: float(np.median([r[k] for r in rs])) for k in ("tpot_s", "ttft_s", "load_s", "rss_loaded")}
        m["peak_rss"] = max(r["peak_rss"] for r in rs)
        med[c] = m
        print(f"  {c:<10} {m['tpot_s'] * 1e3:9.1f} {1 / m['tpot_s']:7.1f} {m['ttft_s'] * 1e3:9.1f} "
              f"{m['load_s']:7.2f} {_gb(m['rss_loaded']):>11} {_gb(m['peak_rss']):>10} {m['peak_rss'] / size:9.2f}")

    def ratio(a: str, b: str, what: str, label: str) -> None:
        if a in med and b in med:
            print(f"  {label:<52} {med[a][what] / med[b][what]:6.2f}×")

    print("  ratios:")
    ratio("session", "lcpp-none", "tpot_s", "TPOT session / lcpp-none (speed-up of the backend)")
    ratio("lcpp-none", "Llama", "tpot_s", "TPOT lcpp-none / Llama (cost of the engine's loop)")
    ratio("lcpp-all", "lcpp-none", "tpot_s", "TPOT lcpp-all / lcpp-none (cost of every capture)")
    ratio("lcpp-lens", "lcpp-none", "tpot_s", "TPOT lcpp-lens / lcpp-none (captures and the lens)")
    ratio("session", "lcpp-none", "peak_rss", "peak RSS session / lcpp-none")
    ratio("lcpp-none", "Llama", "peak_rss", "peak RSS lcpp-none / Llama")
    ratio("lcpp-all", "lcpp-none", "peak_rss", "peak RSS lcpp-all / lcpp-none")
    ratio("lcpp-lens", "lcpp-none", "peak_rss", "peak RSS lcpp-lens / lcpp-none")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llamacpp", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2,1b", help="comma-separated: smollm2, 1b, or GGUF paths")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--threads", default="auto")
    p.add_argument("--quant", default="Q4_0", choices=("Q4_0", "Q8_0"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model-path", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from engine.run.threads import available_cores

    threads = available_cores() if args.threads == "auto" else int(args.threads)
    if args.worker:
        print(json.dumps(run_one(args.worker, args.model_path, args.tokens, args.n_ctx, threads)))
        return 0
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration {unknown[0]!r} (choose from {', '.join(CONFIGS)})")
    import llama_cpp

    print(f"CPU: {cpu_flags()}; {threads} threads (of {os.cpu_count()} CPUs); llama-cpp-python "
          f"{llama_cpp.__version__}; load average before: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for m in [m for m in args.models.split(",") if m]:
        if m == "smollm2":
            from engine.formats.locate import default_model_path

            bench_model("SmolLM2-135M", str(default_model_path()), args, threads)
        elif m == "1b":
            path = big_path(args.quant)
            if not path.is_file():
                t0 = time.perf_counter()
                build_big(path, args.quant)
                print(f"built {path} in {time.perf_counter() - t0:.0f} s")
            bench_model(f"1B-scale Llama ({args.quant}, random weights)", str(path), args, threads)
        else:
            bench_model(Path(m).name, m, args, threads)
    print(f"\nload average after: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

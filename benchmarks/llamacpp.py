"""The llama.cpp backend against this engine's own Session and plain llama-cpp-python, in one run:
`python -m benchmarks.llamacpp [--models smollm2,1b,8b] [--tokens 32] [--repeats 2]`.

For each model it prints the decode TPOT (median step), the time per token end to end (the wall time from the
first token to the last as the caller receives them, over the tokens between: the work outside the steps, such
as the lens, included), TTFT and peak RSS of
  session      this engine's Session, float32 (every GGUF weight dequantized);
  lcpp-none    engine.backends.llamacpp with nothing captured (the callback answers "no" to every node);
  lcpp-all     the same with Capture.everything: attention of every layer, residual norms, funnel, raw logits;
  lcpp-lens    lcpp-all plus a logit lens (L + 2 LM heads per step; norm and float16 head read from the file);
  Llama        plain llama_cpp.Llama (greedy, its own sampler), the speed floor of the same library;
with the ratios between them, the CPU's flags and the thread count.

Each configuration runs in a fresh process (peak RSS is that process's own), and the repeats are interleaved
(A, B, C, …, then A, B, C, …) so slow drifts of a shared machine fall on all of them; the machine's load average is
printed before and after. Every llama.cpp context holds the same --n-ctx positions.

Models: `smollm2` is the default model's Q4_1 GGUF; `1b` is a 1B-scale Llama-shaped GGUF of random weights (16
layers, d_model 2048, FFN 8192, 32 query / 8 KV heads, vocabulary 49,152 with SmolLM2's tokenizer metadata copied
so the tokenizer works), quantized to Q4_0 (or --quant Q8_0 or Q4_K_M), built once under
~/.cache/inference-lab/bench. `8b` has Llama 3.1 8B's shapes (32 layers, d_model 4096, FFN 14,336, 32 query / 8 KV
heads, a separate output matrix) with the same 49,152-token vocabulary (Llama 3.1's is 128,256), Q4_K_M (random
valid Q4_K and Q6_K blocks written directly): about 4.4 GB. The Session is left out on it (its float32 weights need
32 GB). The Session's first load of a file converts the weights into the engine's cache; that happens in a
separate process first, so the measured loads read the cache as the app would.

The header says which instruction sets llama.cpp and torch use. To stand in for a CPU with only AVX2 on one with
AVX-512, build llama-cpp-python without AVX-512 into a folder of its own and run the benchmark with torch held to its
AVX2 kernels (the memory system stays this machine's):
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF" \
    pip install --no-binary llama-cpp-python --no-deps --target /tmp/lcpp-avx2 llama-cpp-python==0.3.36
  PYTHONPATH=/tmp/lcpp-avx2 ATEN_CPU_CAPABILITY=avx2 python -m benchmarks.llamacpp --models 1b
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
SHAPES = {  # Llama-shaped random-weight files; the vocabulary is SmolLM2's (49,152), whose tokenizer they carry
    "1b": dict(n_layers=16, d_model=2048, ffn=8192, n_heads=32, n_kv_heads=8, context=8192, rope_base=100000.0),
    # Llama 3.1 8B's shapes (its 128,256-token vocabulary excepted)
    "8b": dict(n_layers=32, d_model=4096, ffn=14336, n_heads=32, n_kv_heads=8, context=8192, rope_base=500000.0),
}


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


# ---- the 1B- and 8B-scale files -------------------------------------------------------------------------------
def _blocks_q4_k(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """Random but valid Q4_K blocks (ggml's block_q4_K: d, dmin as float16, 12 bytes of packed 6-bit sub-block
    scales and mins, 128 bytes of 4-bit values), (n_blocks, 144) uint8, values of about `std` around zero.

    A value is d·sc·q − dmin·m for q in 0…15; with dmin = 8·d and m = round(15·sc / 16) each sub-block is centred
    (−dmin·m ≈ −d·sc·7.5), so the weights have no common offset that would grow through the layers.
    """
    sc = rng.integers(16, 64, size=(n_blocks, 8), dtype=np.uint8)
    m = np.rint(sc * (15 / 16)).astype(np.uint8)
    scales = np.empty((n_blocks, 12), dtype=np.uint8)  # the inverse of ggml's get_scale_min_k4
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    d = np.float16(std / (39.5 * 4.6))  # mean scale × the spread of a uniform 0…15 value
    head = np.array([d, np.float16(8 * d)], dtype=np.float16).view(np.uint8)
    out = np.empty((n_blocks, 144), dtype=np.uint8)
    out[:, 0:4] = head
    out[:, 4:16] = scales
    out[:, 16:] = rng.integers(0, 256, size=(n_blocks, 128), dtype=np.uint8)
    return out


def _blocks_q6_k(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """Random valid Q6_K blocks (block_q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, d as
    float16), (n_blocks, 210) uint8: a value is d·sc·(q − 32), centred by construction."""
    out = np.empty((n_blocks, 210), dtype=np.uint8)
    out[:, :192] = rng.integers(0, 256, size=(n_blocks, 192), dtype=np.uint8)
    out[:, 192:208] = rng.integers(1, 9, size=(n_blocks, 16), dtype=np.uint8)  # positive int8 scales
    out[:, 208:210] = np.array([np.float16(std / (4.5 * 18.5))], dtype=np.float16).view(np.uint8)
    return out


def build_big(path: Path, quant: str = "Q4_0", seed: int = 0, shape: str = "1b") -> Path:
    """A Llama-shaped GGUF of random weights with SmolLM2's tokenizer; written to a temporary name, then renamed.

    Q4_0 and Q8_0 are quantized by the gguf package from random float32 weights. Q4_K_M (which the gguf package
    cannot quantize) is written as random valid blocks directly, with llama.cpp's Q4_K_M recipe: Q4_K everywhere
    but Q6_K for the output matrix and for attn_v and ffn_down in the first and last eighth of the layers and every
    third layer between. The file is written one tensor at a time, so building it needs little memory.
    """
    import gguf

    from engine.formats.locate import default_model_path

    k_quants = quant == "Q4_K_M"
    src = gguf.GGUFReader(str(default_model_path()))
    c = SHAPES[shape]
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

    n = c["n_layers"]
    more_bits = {i for i in range(n) if i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2}  # llama.cpp's rule
    d, kv = c["d_model"], c["n_kv_heads"] * hd
    plan: list[tuple[str, tuple[int, ...], str, float]] = []  # (name, (rows, cols) or (n,), type, std)
    plan.append(("token_embd.weight", (vocab, d), "Q4_K" if k_quants else quant, 1.0))
    if k_quants:  # a separate output matrix, as Llama 3.1 8B has; the 1B file ties it to the embedding
        plan.append(("output.weight", (vocab, d), "Q6_K", 0.02))
    plan.append(("output_norm.weight", (d,), "F32", 1.0))
    for i in range(n):
        p = f"blk.{i}."
        big = "Q6_K" if k_quants and i in more_bits else ("Q4_K" if k_quants else quant)
        small = "Q4_K" if k_quants else quant
        plan += [(p + "attn_norm.weight", (d,), "F32", 1.0), (p + "ffn_norm.weight", (d,), "F32", 1.0),
                 (p + "attn_q.weight", (d, d), small, 0.02), (p + "attn_k.weight", (kv, d), small, 0.02),
                 (p + "attn_v.weight", (kv, d), big, 0.02), (p + "attn_output.weight", (d, d), small, 0.02),
                 (p + "ffn_gate.weight", (c["ffn"], d), small, 0.02), (p + "ffn_up.weight", (c["ffn"], d), small, 0.02),
                 (p + "ffn_down.weight", (d, c["ffn"]), big, 0.02)]

    def values(shape_: tuple[int, ...], qname: str, std: float) -> np.ndarray:
        if qname == "F32":
            return np.ones(shape_, dtype=np.float32)
        rows, cols = shape_
        if qname in ("Q4_K", "Q6_K"):
            blocks = (_blocks_q4_k if qname == "Q4_K" else _blocks_q6_k)(rng, rows * cols // 256, std)
            return blocks.reshape(rows, -1)
        a = rng.standard_normal(shape_, dtype=np.float32) * np.float32(std)
        return gguf.quants.quantize(a, gguf.GGMLQuantizationType[qname])

    for name, shape_, qname, _ in plan:
        qtype = gguf.GGMLQuantizationType[qname]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape_)) // block * size
        if qname == "F32":
            w.add_tensor_info(name, shape_, np.dtype(np.float32), nbytes)
        else:
            w.add_tensor_info(name, (*shape_[:-1], shape_[-1] // block * size), np.dtype(np.uint8), nbytes, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, shape_, qname, std in plan:  # one tensor in memory at a time
        w.write_tensor_data(values(shape_, qname, std))
    w.close()
    tmp.rename(path)
    return path


def big_path(quant: str, shape: str = "1b") -> Path:
    from engine.formats.locate import cache_root

    return cache_root() / "bench" / f"llama-{shape}-random.{quant}.gguf"


# ---- one configuration, in this process --------------------------------------------------------------------------
def run_one(config: str, model: str, tokens: int, n_ctx: int, threads: int) -> dict:
    from engine.tokenizer.load import load_tokenizer

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

        def generate(n: int) -> tuple[float, list[float], float]:
            llm.reset()  # no prefix reuse: every configuration prefills the whole prompt
            stamps = [time.perf_counter()]
            for i, _ in enumerate(llm.generate(ids, top_k=1, temp=0.0, reset=True)):
                stamps.append(time.perf_counter())
                if i + 1 >= n:
                    break
            gaps = np.diff(stamps)
            return float(gaps[0]), list(gaps[1:]), (stamps[-1] - stamps[1]) / (len(stamps) - 2)
    else:
        from engine.events import Finished, TokenSampled
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

        def generate(n: int) -> tuple[float, list[float], float]:
            session.forget_cache()
            fin, stamps = None, []
            for e in session.generate(ids, SamplingParams.greedy_params(), n, capture, ignore_eos=True):
                if isinstance(e, TokenSampled):  # as the app sees a token: after the step and its captures' events
                    stamps.append(time.perf_counter())
                elif isinstance(e, Finished):
                    fin = e
            if fin is None or len(stamps) < 2:
                raise RuntimeError(f"{config}: the generation failed")
            return fin.ttft_s, list(fin.step_seconds), (stamps[-1] - stamps[0]) / (len(stamps) - 1)

    generate(4)  # first-call costs (graph allocation, thread start, kernel choice) are not what TPOT measures
    ttft, steps, e2e = generate(tokens)
    return {"config": config, "tpot_s": float(np.median(steps)), "e2e_s": e2e, "ttft_s": ttft, "load_s": load_s,
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
    configs = list(args.configs)
    if name.startswith("8B") and "session" in configs:  # float32 weights: 32 GB, more than these machines have
        configs.remove("session")
        print("\n(the session configuration is left out on the 8B file: its float32 weights need 32 GB)")
    if "session" in configs:  # the Session's weight cache is written once, outside the measured processes
        subprocess.run([sys.executable, "-c", f"from engine.loaders import load; load({model!r}, device='cpu', "
                        "dtype='float32')"], check=True, timeout=3600)
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for _ in range(args.repeats):
        for c in configs:
            runs[c].append(_worker(c, model, args.tokens, args.n_ctx, threads))
    size = Path(model).stat().st_size
    print(f"\n{name}: {Path(model).name} ({_gb(size)}), {args.tokens} new tokens, n_ctx {args.n_ctx}, "
          f"median of {args.repeats} interleaved runs")
    print(f"  {'config':<10} {'TPOT ms':>9} {'e2e ms':>8} {'tok/s':>7} {'TTFT ms':>9} {'load s':>7} "
          f"{'RSS loaded':>11} {'peak RSS':>10} {'peak/file':>9}")
    med: dict[str, dict] = {}
    for c, rs in runs.items():
        m = {k: float(np.median([r[k] for r in rs])) for k in ("tpot_s", "e2e_s", "ttft_s", "load_s", "rss_loaded")}
        m["peak_rss"] = max(r["peak_rss"] for r in rs)
        med[c] = m
        print(f"  {c:<10} {m['tpot_s'] * 1e3:9.1f} {m['e2e_s'] * 1e3:8.1f} {1 / m['tpot_s']:7.1f} "
              f"{m['ttft_s'] * 1e3:9.1f} {m['load_s']:7.2f} {_gb(m['rss_loaded']):>11} {_gb(m['peak_rss']):>10} "
              f"{m['peak_rss'] / size:9.2f}")

    def ratio(a: str, b: str, what: str, label: str) -> None:
        if a in med and b in med:
            print(f"  {label:<52} {med[a][what] / med[b][what]:6.2f}×")

    print("  ratios:")
    ratio("session", "lcpp-none", "tpot_s", "TPOT session / lcpp-none (speed-up of the backend)")
    ratio("lcpp-none", "Llama", "tpot_s", "TPOT lcpp-none / Llama (cost of the engine's loop)")
    ratio("lcpp-all", "lcpp-none", "tpot_s", "TPOT lcpp-all / lcpp-none (cost of every capture)")
    ratio("lcpp-lens", "lcpp-none", "tpot_s", "TPOT lcpp-lens / lcpp-none (captures and the lens)")
    ratio("lcpp-none", "Llama", "e2e_s", "end to end lcpp-none / Llama (wall time per token)")
    ratio("lcpp-all", "Llama", "e2e_s", "end to end lcpp-all / Llama (every capture but the lens)")
    ratio("lcpp-lens", "Llama", "e2e_s", "end to end lcpp-lens / Llama (every capture and the lens)")
    ratio("session", "lcpp-none", "peak_rss", "peak RSS session / lcpp-none")
    ratio("lcpp-none", "Llama", "peak_rss", "peak RSS lcpp-none / Llama")
    ratio("lcpp-all", "lcpp-none", "peak_rss", "peak RSS lcpp-all / lcpp-none")
    ratio("lcpp-lens", "lcpp-none", "peak_rss", "peak RSS lcpp-lens / lcpp-none")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llamacpp", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2,1b", help="comma-separated: smollm2, 1b, 8b, or GGUF paths")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--threads", default="auto")
    p.add_argument("--quant", default="Q4_0", choices=("Q4_0", "Q8_0", "Q4_K_M"), help="the 1B file's (8B: Q4_K_M)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model-path", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from engine.model.threads import available_cores

    threads = available_cores() if args.threads == "auto" else int(args.threads)
    if args.worker:
        print(json.dumps(run_one(args.worker, args.model_path, args.tokens, args.n_ctx, threads)))
        return 0
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration {unknown[0]!r} (choose from {', '.join(CONFIGS)})")
    import llama_cpp
    import torch

    from engine.backends.llamacpp import _llama

    built = _llama().llama_print_system_info().decode().strip()  # the instruction sets llama.cpp was built with
    print(f"CPU: {cpu_flags()}; {threads} threads (of {os.cpu_count()} CPUs); llama-cpp-python "
          f"{llama_cpp.__version__}; load average before: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"llama.cpp uses: {built}\ntorch uses: {torch.backends.cpu.get_cpu_capability()}")
    for m in [m for m in args.models.split(",") if m]:
        if m == "smollm2":
            from engine.formats.locate import default_model_path

            bench_model("SmolLM2-135M", str(default_model_path()), args, threads)
        elif m in SHAPES:
            quant = "Q4_K_M" if m == "8b" else args.quant  # the 8B file is what LM Studio and Ollama offer
            path = big_path(quant, m)
            if not path.is_file():
                t0 = time.perf_counter()
                build_big(path, quant, shape=m)
                print(f"built {path} ({_gb(path.stat().st_size)}) in {time.perf_counter() - t0:.0f} s")
            bench_model(f"{m.upper()}-scale Llama ({quant}, random weights)", str(path), args, threads)
        else:
            bench_model(Path(m).name, m, args, threads)
    print(f"\nload average after: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

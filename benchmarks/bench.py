"""Benchmarks as scripts that print ratios: `python -m benchmarks bench` (and `bench-one`, one configuration).

Each configuration runs in its own subprocess (`bench-one`), so load time and peak RSS are those of a fresh
process. The parent measures the machine (memory bandwidth, matmul FLOP/s), watches how busy the machine is
(CPU used by other processes during the run) and prints every figure next to its target as a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from engine.cliargs import threads as threads_arg  # bounded: a count past 4 per CPU is refused in one line

PROMPT = "Explain what a KV cache is in two sentences."


# ---- one configuration, in this process --------------------------------------------------------------------------
def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _stats(seconds: list[float]) -> dict:
    a = np.asarray(seconds)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90))}


def prompt_ids(tok) -> tuple[list[int], bool]:
    """PROMPT's ids with the model's chat template, or as plain text for a base model (Gemma 3 270M has none)."""
    try:
        return tok.encode(tok.chat_prompt(PROMPT)).ids, True
    except ValueError:
        return tok.encode(PROMPT).ids, False


def run_ours(dtype: str, capture: str, new_tokens: int, repeats: int, generations: int, threads: int | str,
             model: str | None = None, kernels: str = "exact") -> dict:
    import torch

    from engine.events import Finished
    from engine.loaders import load
    from engine.run.sampling import SamplingParams
    from engine.run.session import Capture, Session

    t0 = time.perf_counter()
    lm = load(model, device="cpu", dtype=dtype, kernels=kernels)
    session = Session(lm, threads=threads)
    load_s = time.perf_counter() - t0
    cap = Capture.everything(lm.cfg.n_layers) if capture == "all" else Capture()
    greedy = SamplingParams.greedy_params()
    chat = prompt_ids(lm.tokenizer)[1]
    for _ in session.generate("Hello", greedy, 4, cap, chat=chat, ignore_eos=True):  # warm-up: first-call costs
        pass
    runs = []
    for _ in range(repeats):
        session.forget_cache()  # every TTFT is a full prefill, no prefix reuse
        fin = [e for e in session.generate(PROMPT, greedy, new_tokens, cap, chat=chat, ignore_eos=True)][-1]
        assert isinstance(fin, Finished), fin
        runs.append(fin)
    best = min(runs, key=lambda f: f.tpot_s)
    ended_at = session.threads.current if session.threads else torch.get_num_threads()
    rss_series = []
    for _ in range(generations):  # memory must not grow over many generations
        for _ in session.generate(PROMPT, greedy, 16, cap, chat=chat, ignore_eos=True):
            pass
        rss_series.append(_current_rss())
    return {
        "impl": "ours", "model": lm.info.name, "dtype": dtype, "kernels": lm.info.kernels, "capture": capture,
        "threads": str(threads), "ids": [int(t) for t in best.ids],
        "threads_at_end": ended_at,
        "load_s": load_s, "from_cache": lm.info.from_cache, "prompt_tokens": int(len(best.prompt_ids)),
        "ttft_s": float(min(f.ttft_s for f in runs)), "tpot_s": _stats(list(best.step_seconds)),
        "tokens_per_s": best.tokens_per_s, "peak_rss_bytes": _rss_peak_bytes(),
        "rss_over_generations": rss_series, "text": best.text[:80], "tokenizer": tokenizer_timings(lm.tokenizer),
    }


def tokenizer_timings(tok, repeats: int = 15) -> dict:
    """Median seconds to encode a mixed ~2,000-token text and to load the tokenizer back from its cache.

    (Measured here, in the benchmark; unit tests assert no speed, which a busy machine would make flaky.)
    """
    import statistics
    import tempfile
    from pathlib import Path

    from engine.tokenizer import Tokenizer

    words = ["the", "quick", "brown", "fox", "2024", "über", "😀", "\n", "世界", "x=1;", "  ", "<|im_end|>"]
    text = " ".join(words[(k * 7) % len(words)] for k in range(3000))
    while len(tok.encode(text).ids) > 2000:
        text = text[: int(len(text) * 0.95)]
    encode = []
    for _ in range(repeats):
        t = time.perf_counter()
        tok.encode(text)
        encode.append(time.perf_counter() - t)
    with tempfile.TemporaryDirectory() as d:
        tok.save(Path(d))
        load = []
        for _ in range(3):
            t = time.perf_counter()
            Tokenizer.load(Path(d))
            load.append(time.perf_counter() - t)
    return {"encode_tokens": len(tok.encode(text).ids), "encode_s": statistics.median(encode),
            "load_s": statistics.median(load)}


def gemma3_tokenizer_timings() -> dict | None:
    """tokenizer_timings of Gemma 3 270M's 262,144-token SentencePiece vocabulary, when it is installed (the
    speed a unit test used to assert; a test checks only that its tokenizations are right)."""
    from engine.formats.locate import gemma3_path
    from engine.tokenizer.load import load_tokenizer

    path = gemma3_path(assemble=False)
    return None if path is None else tokenizer_timings(load_tokenizer(path))


def _current_rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def run_hf(dtype: str, new_tokens: int, repeats: int, model: str | None = None) -> dict:
    """Hugging Face transformers on the same GGUF weights (dequantized by transformers itself), same prompt ids, same
    threads, a plain cached loop."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.formats.locate import resolve_model_path
    from engine.tokenizer import Tokenizer

    path = resolve_model_path(model)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=getattr(torch, dtype), attn_implementation="sdpa"
    ).eval()
    load_s = time.perf_counter() - t0
    tok = Tokenizer.from_gguf(str(path))
    ids = torch.tensor([prompt_ids(tok)[0]])

    def once(n: int) -> tuple[float, list[float], list[int]]:
        with torch.inference_mode():
            t = time.perf_counter()
            out = model(ids, use_cache=True, logits_to_keep=1)  # the last position's logits only, as ours
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            ttft = time.perf_counter() - t
            past, steps, ids_out = out.past_key_values, [], [int(nxt)]
            for _ in range(n - 1):
                t = time.perf_counter()
                out = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                steps.append(time.perf_counter() - t)
                ids_out.append(int(nxt))
        return ttft, steps, ids_out

    once(4)
    runs = [once(new_tokens) for _ in range(repeats)]
    best = min(runs, key=lambda r: float(np.mean(r[1])))
    return {
        "impl": "hf", "model": path.name, "dtype": dtype, "capture": "none", "threads": torch.get_num_threads(),
        "load_s": load_s, "ids": best[2],
        "prompt_tokens": int(ids.shape[1]), "ttft_s": min(r[0] for r in runs), "tpot_s": _stats(best[1]),
        "tokens_per_s": 1 / float(np.mean(best[1])), "peak_rss_bytes": _rss_peak_bytes(),
    }


LLAMA_CPP_SCRIPT = """
import json, sys, time, resource
from llama_cpp import Llama, __version__
path, ids = sys.argv[1], json.loads(sys.argv[2])
n, repeats, threads = map(int, sys.argv[3:6])
t0 = time.perf_counter()
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
load_s = time.perf_counter() - t0
def once(n):
    llm.reset()
    stamps = [time.perf_counter()]
    # EOS ignored, as in the other runs (a -inf logit bias; llama-cpp-python has no ignore_eos)
    for _ in llm.create_completion(ids, max_tokens=n, temperature=0.0, stream=True,
                                   logit_bias={llm.token_eos(): float("-inf")}):
        stamps.append(time.perf_counter())
    return stamps[1] - stamps[0], [b - a for a, b in zip(stamps[1:], stamps[2:])]
once(4)
runs = [once(n) for _ in range(repeats)]
print(json.dumps({"version": __version__, "load_s": load_s, "runs": runs,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def llama_cpp_python() -> str | None:
    """An interpreter that can import llama_cpp: $INFERENCE_LAB_LLAMA_PYTHON, this one, or `make servers`'s own."""
    if os.environ.get("INFERENCE_LAB_LLAMA_PYTHON"):
        return os.environ["INFERENCE_LAB_LLAMA_PYTHON"]
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        other = Path(__file__).resolve().parents[1] / ".venv-servers" / "llamacpp" / "bin" / "python"
        return str(other) if other.exists() else None
    return sys.executable


def run_llama_cpp(new_tokens: int, repeats: int, threads: int, model: str | None = None) -> dict:
    """llama.cpp (llama-cpp-python) on the same Q4_1 GGUF file, same prompt ids, greedy, streamed token by token.

    Runs in the interpreter that has llama_cpp (possibly another virtual environment), so the script is plain text.
    """
    from engine.formats.locate import resolve_model_path
    from engine.tokenizer import Tokenizer

    python = llama_cpp_python()
    if python is None:
        raise RuntimeError("llama-cpp-python is not installed")
    path = resolve_model_path(model)
    tok = Tokenizer.from_gguf(str(path))
    ids = prompt_ids(tok)[0]
    r = subprocess.run([python, "-c", LLAMA_CPP_SCRIPT, str(path), json.dumps(ids), str(new_tokens), str(repeats),
                        str(threads)], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError((r.stderr.strip().splitlines() or ["llama.cpp failed"])[-1])
    d = json.loads(r.stdout.strip().splitlines()[-1])
    best = min(d["runs"], key=lambda x: float(np.mean(x[1])) if x[1] else float("inf"))
    return {
        "impl": f"llama.cpp (llama-cpp-python {d['version']})", "model": path.name,
        "dtype": "q4_1" if model is None else "the file's own", "capture": "none",
        "threads": str(threads), "load_s": d["load_s"], "prompt_tokens": len(ids),
        "ttft_s": min(x[0] for x in d["runs"]), "tpot_s": _stats(best[1]), "tokens_per_s": 1 / float(np.mean(best[1])),
        "new_tokens": len(best[1]) + 1, "peak_rss_bytes": d["peak_rss_bytes"],
    }


EXPORT_KEY = "export-hf-1"


def exported_default_model() -> Path:
    """The default model as a Hugging Face directory (what vLLM loads), exported once into the cache.

    Keyed by the GGUF file (path, size, mtime) and by the exporter's source, so a changed exporter re-exports.
    """
    import hashlib

    from engine.formats.locate import cache_root
    from engine.loaders import default_model_path, export_hf

    path = default_model_path()
    st = path.stat()
    code = hashlib.sha256(Path(export_hf.__file__).read_bytes()).hexdigest()[:12]
    key = f"{EXPORT_KEY}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{code}"
    out = cache_root() / "export-hf" / hashlib.sha256(key.encode()).hexdigest()[:20]
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out  # export() renames a finished directory into place: present means complete
    return export_hf.export(path, out, overwrite=True)


def vllm_result(runs: list, version: str | None, dtype: str, load_s: float, prompt_ids_sent: int,
                threads: int, cpus: list[int] | None = None, rss_bytes: int | None = None) -> dict:
    """run_llama_cpp's fields from vLLM's timed requests (engine.remote.loadlab.RequestResult): TTFT the best run's
    first-token time over all runs, TPOT the statistics of the fastest run's gaps between streamed chunks."""
    if not runs:
        raise ValueError("no timed vLLM requests")
    best = min(runs, key=lambda r: r.tpot_s if r.output_tokens > 1 else float("inf"))
    if best.output_tokens < 2 or not best.itl_s:
        raise ValueError(f"vLLM streamed {best.output_tokens} token(s): no decode step to time")
    return {
        "impl": f"vLLM {version or '?'} (CPU)", "dtype": dtype, "capture": "none", "threads": str(threads),
        "omp_cpus": cpus, "load_s": load_s, "prompt_tokens": best.prompt_tokens or prompt_ids_sent,
        "prompt_tokens_sent": prompt_ids_sent, "ttft_s": min(r.ttft_s for r in runs),
        "tpot_s": _stats(list(best.itl_s)), "tokens_per_s": 1 / best.tpot_s, "new_tokens": best.output_tokens,
        "chunks": len(best.itl_s) + 1, "peak_rss_bytes": rss_bytes,
    }


def _tree_peak_rss_bytes(pid: int) -> int | None:
    """Sum of the peak RSS (VmHWM) of a process and its descendants; None where /proc cannot say."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for p in procs:
        try:
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
    return total or None


def run_vllm(new_tokens: int, repeats: int, threads: int, dtype: str = "auto",
             start_timeout_s: float = 420.0) -> dict:
    """vLLM's CPU build as a server on 127.0.0.1: the default model exported as a Hugging Face directory, the same
    prompt ids sent to /v1/completions, greedy, EOS ignored, one stream at a time; one warm-up request, then
    `repeats` timed ones. Prefix caching is off so every TTFT is a full prefill. The server is always stopped."""
    import tempfile
    import threading

    from engine.loaders import default_model_path
    from engine.remote.backend import RemoteBackend
    from engine.remote.launch import start_vllm, vllm_log_facts, vllm_python
    from engine.remote.loadlab import one_request
    from engine.tokenizer import Tokenizer

    python = vllm_python()
    if python is None:
        raise RuntimeError("vLLM is not installed (make servers, or set INFERENCE_LAB_VLLM_PYTHON)")
    hf_dir = exported_default_model()
    ids = list(prompt_ids(Tokenizer.from_gguf(str(default_model_path())))[0])  # the chat template applied
    cancel = threading.Event()
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as logs:
        server = start_vllm(hf_dir, Path(logs), timeout_s=start_timeout_s, threads=threads, dtype=dtype,
                            extra_args=["--no-enable-prefix-caching"], python=python)
        try:
            backend = RemoteBackend(server.url, timeout=120.0)
            info = backend.probe()
            runs = []
            for i in range(repeats + 1):  # the first is the warm-up
                n = 4 if i == 0 else new_tokens
                r = one_request(backend, ids, n, cancel, time.perf_counter(), timeout_s=300.0 + n)
                if not r.ok:
                    raise RuntimeError(f"vLLM request failed: {r.error}")
                if i:
                    runs.append(r)
            rss = _tree_peak_rss_bytes(server.proc.pid)
            facts = vllm_log_facts(server.log.read_text(errors="replace"))
        except BaseException:
            print(server.log_tail(), file=sys.stderr)
            raise
        finally:
            server.stop()
    return vllm_result(runs, info.version, facts["dtype"] or dtype, server.start_s, len(ids), threads,
                       facts["cpus"], rss)


def cmd_bench_one(a: argparse.Namespace) -> int:
    import torch

    from engine.model.threads import available_cores

    fixed = a.threads if a.threads != "auto" else available_cores()
    dtype = a.dtype or ("auto" if a.impl == "vllm" else "float32")
    if dtype == "auto" and a.impl != "vllm":
        print("error: --dtype auto is for --impl vllm only (vLLM's own choice)", file=sys.stderr)
        return 2
    if a.impl == "hf":
        torch.set_num_threads(fixed)
        r = run_hf(dtype, a.new_tokens, a.repeats, a.model)
    elif a.impl == "llama.cpp":
        r = run_llama_cpp(a.new_tokens, a.repeats, fixed, a.model)
    elif a.impl == "vllm":
        if a.model:
            print("error: --impl vllm measures the default model only", file=sys.stderr)
            return 2
        r = run_vllm(a.new_tokens, a.repeats, fixed, dtype)
    else:
        r = run_ours(dtype, a.capture, a.new_tokens, a.repeats, a.generations, a.threads, a.model, a.kernels)
    print(json.dumps(r))
    return 0


# ---- the driver -------------------------------------------------------------------------------------------------
def run_json(args: list[str], timeout: float = 900) -> dict:
    """`python ARGS` of this program in a fresh process (offscreen Qt); its last stdout line is JSON.

    A failure raises RuntimeError with the command's last line on stderr."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    env.setdefault("QT_QPA_PLATFORM", "offscreen")
    try:
        r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(str(e)) from e
    if r.returncode != 0:
        raise RuntimeError((r.stderr.strip().splitlines() or ["(no output)"])[-1])
    return json.loads(r.stdout.strip().splitlines()[-1])


def _child(args: list[str], timeout: float = 900) -> dict | None:
    try:
        return run_json(["-m", "benchmarks", "bench-one", *args], timeout)
    except RuntimeError as e:
        print(f"  {' '.join(args)}: failed: {e}", file=sys.stderr)
        return None


class BusyMeter:
    """CPU used by other processes while we measure: a busy machine makes timings untrustworthy.

    Other processes' CPU = the whole machine's busy CPU time minus ours and our (finished) children's.
    """

    def __init__(self) -> None:
        import psutil

        self.psutil = psutil
        self.t0 = time.perf_counter()
        self.c0 = self._machine_busy() - self._ours()

    def _machine_busy(self) -> float:
        t = self.psutil.cpu_times()
        return t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)

    @staticmethod
    def _ours() -> float:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    def cores_used(self) -> float:
        others = self._machine_busy() - self._ours() - self.c0
        return max(0.0, others / (time.perf_counter() - self.t0))


def _machine() -> dict:
    import psutil
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
            "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads()}


def cmd_bench(a: argparse.Namespace) -> int:

    from engine.costs import formulas as costs
    from engine.costs.hardware import measure_this_machine
    from engine.loaders import load

    threads = str(a.threads)
    n_new, reps = (8, 1) if a.smoke else (a.new_tokens, a.repeats)
    busy = BusyMeter()
    machine = _machine()
    hw = measure_this_machine("cpu", "float32")
    lm = load(None, device="cpu", dtype="float32")  # converts and caches on a first run, so children start warm
    cfg = lm.cfg
    del lm
    base = ["--threads", threads, "--new-tokens", str(n_new), "--repeats", str(reps)]
    results: dict[str, dict | None] = {}
    dtypes = ["float32"] if a.smoke else ["float32", "bfloat16"]
    for dt in dtypes:
        for cap in ("none", "all"):
            print(f"measuring ours {dt} capture={cap} …", file=sys.stderr)
            gens = "0" if a.smoke or cap == "none" or dt != "float32" else str(a.generations)
            results[f"ours-{dt}-{cap}"] = _child(["--impl", "ours", "--dtype", dt, "--capture", cap,
                                                 "--generations", gens, *base])
    if not a.smoke and not a.no_hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("transformers is not installed (pip install '.[bench]'): no Hugging Face comparison",
                  file=sys.stderr)
        else:
            for dt in dtypes:
                print(f"measuring Hugging Face transformers {dt} …", file=sys.stderr)
                results[f"hf-{dt}"] = _child(["--impl", "hf", "--dtype", dt, *base])
        if llama_cpp_python() is None:
            print("llama-cpp-python is not installed (pip install '.[llama]' or make servers): no llama.cpp comparison",
                  file=sys.stderr)
        else:
            print("measuring llama.cpp on the same Q4_1 file …", file=sys.stderr)
            results["llama.cpp-q4_1"] = _child(["--impl", "llama.cpp", *base])
        from engine.remote.launch import vllm_python

        if a.no_vllm:
            pass
        elif vllm_python() is None:
            print("vLLM is not installed (make servers, or set INFERENCE_LAB_VLLM_PYTHON): no vLLM comparison",
                  file=sys.stderr)
        else:
            print("measuring vLLM (CPU build, a server on 127.0.0.1) on the exported model …", file=sys.stderr)
            results["vllm"] = _child(["--impl", "vllm", *base], timeout=1500)
        from engine.formats.locate import gemma3_path

        if gemma3_path() is None:
            print("Gemma 3 270M is not installed (make setup installs it): no Gemma 3 figures", file=sys.stderr)
        else:  # the second model: the file's Q4_K_M weights dequantized, the prompt as plain text (a base model)
            for dt in dtypes:
                print(f"measuring ours on Gemma 3 270M {dt} …", file=sys.stderr)
                results[f"gemma3-ours-{dt}-none"] = _child(["--impl", "ours", "--model", "gemma3-270m", "--dtype",
                                                            dt, "--capture", "none", *base])
            if llama_cpp_python() is not None:
                print("measuring llama.cpp on Gemma 3 270M …", file=sys.stderr)
                results["gemma3-llama.cpp"] = _child(["--impl", "llama.cpp", "--model", "gemma3-270m", *base])
    gui = None
    if not a.smoke and not a.no_gui:
        print("measuring GUI responsiveness …", file=sys.stderr)
        gui = _gui_bench()
    cores_busy = busy.cores_used()
    measured = [r for r in results.values() if r]
    prompt_tokens = measured[0]["prompt_tokens"] if measured else 41
    # the mean decode step attends over the prompt plus half the new tokens
    floor_bytes = costs.decode_cost(cfg, prompt_tokens + n_new // 2, weight_dtype="float32").bytes
    report = {
        "machine": machine, "bandwidth_bytes_per_s": hw.bandwidth_bytes_per_s,
        "matmul_flops": hw.peak_flops.get("fp32"), "decode_bytes_per_token_fp32": floor_bytes,
        "tpot_floor_s": floor_bytes / hw.bandwidth_bytes_per_s, "results": results, "gui": gui,
        "other_processes_cores": cores_busy, "trustworthy": cores_busy < 0.15, "prompt_tokens": prompt_tokens,
        "new_tokens": n_new, "threads": threads, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "tokenizer_gemma3": gemma3_tokenizer_timings(),
    }
    report["ratios"] = _ratios(report)
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(json.dumps(report, indent=2) + "\n")
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    if a.smoke:
        ok = all(results.values())
        return 0 if ok else 1
    return 0


def _ratios(r: dict) -> dict:
    res = r["results"]
    out = {}
    off, on = res.get("ours-float32-none"), res.get("ours-float32-all")
    hf = res.get("hf-float32")
    if on:
        out["tpot_all_over_floor"] = on["tpot_s"]["mean"] / r["tpot_floor_s"]
        out["achieved_bandwidth_fraction"] = r["decode_bytes_per_token_fp32"] / on["tpot_s"]["mean"] / r[
            "bandwidth_bytes_per_s"]
    if on and off:
        out["capture_on_over_off"] = on["tpot_s"]["mean"] / off["tpot_s"]["mean"]
    if on and hf:
        out["decode_tokens_per_s_vs_hf"] = on["tokens_per_s"] / hf["tokens_per_s"]
        out["ttft_vs_hf"] = on["ttft_s"] / hf["ttft_s"]
        out["peak_rss_vs_hf"] = (off or on)["peak_rss_bytes"] / hf["peak_rss_bytes"]
    bf = res.get("ours-bfloat16-none")
    if off and bf:
        out["bf16_tpot_over_fp32"] = bf["tpot_s"]["mean"] / off["tpot_s"]["mean"]
    llama = res.get("llama.cpp-q4_1")
    if llama and (bf or off):
        out["ours_fastest_tpot_over_llama_cpp"] = min(x["tpot_s"]["mean"] for x in (bf, off) if x) / llama[
            "tpot_s"]["mean"]
    g32, gbf, gllama = (res.get(k) for k in ("gemma3-ours-float32-none", "gemma3-ours-bfloat16-none",
                                             "gemma3-llama.cpp"))
    if g32 and off:
        out["gemma3_over_smollm2_tpot_fp32"] = g32["tpot_s"]["mean"] / off["tpot_s"]["mean"]
    if g32 and gbf:
        out["gemma3_bf16_tpot_over_fp32"] = gbf["tpot_s"]["mean"] / g32["tpot_s"]["mean"]
    if gllama and (g32 or gbf):
        out["gemma3_ours_fastest_tpot_over_llama_cpp"] = min(x["tpot_s"]["mean"] for x in (g32, gbf) if x) / gllama[
            "tpot_s"]["mean"]
    vllm = res.get("vllm")
    if vllm and (bf or off):
        out["ours_fastest_tpot_over_vllm"] = min(x["tpot_s"]["mean"] for x in (bf, off) if x) / vllm["tpot_s"]["mean"]
        out["ours_ttft_over_vllm"] = min(x["ttft_s"] for x in (bf, off) if x) / vllm["ttft_s"]
    if on and on.get("rss_over_generations"):
        s = on["rss_over_generations"]
        out["rss_growth_bytes_over_generations"] = s[-1] - s[min(len(s) - 1, 5)]
    return out


def _gui_bench() -> dict | None:
    try:
        return run_json(["-m", "benchmarks.gui"], timeout=600)
    except RuntimeError as e:
        print(f"  GUI benchmark failed: {e}", file=sys.stderr)
        return None


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e3:.1f} ms"


def _print_report(r: dict) -> None:
    m = r["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.0f} GiB, torch {m['torch']}, "
          f"{m['threads']} threads")
    print(f"measured memory bandwidth {r['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, fp32 matmul "
          f"{(r['matmul_flops'] or 0) / 1e9:.0f} GFLOP/s; decode reads {r['decode_bytes_per_token_fp32'] / 1e6:.0f} MB"
          f" per token in float32 → TPOT floor {_ms(r['tpot_floor_s'])}")
    print(f"{'configuration':<24}{'load':>9}{'TTFT':>10}{'TPOT mean':>11}{'p50':>10}{'p90':>10}{'tok/s':>8}"
          f"{'peak RSS':>10}")
    for name, x in r["results"].items():
        if x is None:
            print(f"{name:<24} failed")
            continue
        t = x["tpot_s"]
        rss = x.get("peak_rss_bytes")
        print(f"{name:<24}{x['load_s']:>8.2f}s{_ms(x['ttft_s']):>10}{_ms(t['mean']):>11}{_ms(t['p50']):>10}"
              f"{_ms(t['p90']):>10}{x['tokens_per_s']:>8.1f}" + (f"{rss / 2**20:>8.0f}MB" if rss else f"{'–':>10}"))
    for name, x in r["results"].items():
        if x and "ours" not in name:
            print(f"  {name}: {x.get('impl', name)}, {x.get('dtype')}, {x.get('threads')} threads"
                  + (" (load = server start; RSS = sum of its processes' peaks)" if name == "vllm" else ""))
    tok = next((x["tokenizer"] for x in r["results"].values() if x and "tokenizer" in x), None)
    for name, t in (("tokenizer", tok), ("Gemma 3 tokenizer", r.get("tokenizer_gemma3"))):
        if t:
            print(f"{name}: encode {t['encode_tokens']:,} tokens {_ms(t['encode_s'])} (median), "
                  f"load from its cache {_ms(t['load_s'])}")
    if r["gui"]:
        print("GUI: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r["gui"].items()))
    for k, v in r["ratios"].items():
        print(f"{k:<40}{v:>12.3f}" if abs(v) < 1e6 else f"{k:<40}{v:>12.0f}")
    busy = r["other_processes_cores"]
    print(f"other processes used {busy:.2f} cores during the run"
          + ("" if r["trustworthy"] else " — NOT a quiet machine: do not trust these timings"))


def add_subcommands(sub) -> None:
    p = sub.add_parser("bench", help="benchmark load, TTFT, TPOT, memory and capture overhead (prints ratios)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--smoke", action="store_true", help="a short run that only checks the benchmark works")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--generations", type=int, default=100, help="generations for the memory-growth check")
    p.add_argument("--threads", type=threads_arg, default="auto", help="auto (default) or a fixed count")
    p.add_argument("--output", default=None, help="also write the raw results as JSON to this file")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face transformers comparison")
    p.add_argument("--no-gui", action="store_true", help="skip the GUI responsiveness measurement")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM (a server started for the run)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("bench-one", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=["ours", "hf", "llama.cpp", "vllm"], default="ours")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "auto"],
                   help="float32 by default; vllm: auto (vLLM's choice) by default")
    p.add_argument("--capture", choices=["none", "all"], default="none")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--generations", type=int, default=0)
    p.add_argument("--threads", type=threads_arg, default="auto")
    p.add_argument("--model", default=None, help="ours, hf and llama.cpp: another model (default: SmolLM2-135M)")
    p.add_argument("--kernels", default="exact", choices=["exact", "file", "fast"], help="ours: the kernel mode")
    p.set_defaults(func=cmd_bench_one)

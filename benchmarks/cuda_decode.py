"""Decode on an NVIDIA GPU: the engine against Hugging Face transformers on the same weights, in one run.

`python -m benchmarks.cuda_decode --shapes DIR [--new-tokens 128] [--repeats 3] [--dtype bfloat16]`

DIR holds a model's config.json and tokenizer files, without weights: `python -m engine export-hf --out DIR` on
SmolLM2, then its model.safetensors deleted (a GPU machine that cannot reach the network gets the 4 files, a few
MB, instead of the weights). The benchmark writes seeded random weights of the config's shapes beside a copy of
them, so every product, cache and attention has the real model's shapes; the tokens themselves mean nothing.

Both decode the same prompt ids greedily with a KV cache, one token a step, and wait for the GPU after each step:
- the engine as the CLI runs it (Session.generate, nothing captured), and as the app runs it (every layer's
  attention, the residual norms, the funnel, the logits and the lens captured each step);
- transformers' model on the same safetensors file, SDPA attention, a plain cached loop.
Prints the GPU, then one JSON line: each one's TPOT (best of `--repeats`; every run's too, the first of which meets
each step's shapes for the first time), TTFT, and the engine's tokens/s over transformers'.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

PROMPT = "Explain in three sentences why the sky is blue, as a physics teacher would to a curious ten-year-old."


def write_random_weights(shapes: Path, out: Path, seed: int = 0) -> Path:
    """A copy of `shapes` (config and tokenizer) with seeded random weights of its config's shapes (float32 file)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(shapes, out)
    (out / "model.safetensors").unlink(missing_ok=True)
    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # O(1) activations through every layer, as a trained model has
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02 if "embed" not in name else 1.0)
    model.save_pretrained(out, safe_serialization=True)
    return out


DEVICE = "cuda"  # --device cpu checks the script itself where there is no GPU


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def engine_decode(path: Path, dtype: str, new_tokens: int, repeats: int, capture_all: bool) -> dict:
    import torch

    from engine.events import Finished
    from engine.loaders import load
    from engine.protocol import Capture, SamplingParams
    from engine.run.session import Session

    lm = load(path, device=DEVICE, dtype=dtype)
    s = Session(lm)
    capture = replace(Capture.everything(lm.cfg.n_layers), lens_top=5) if capture_all else None

    def once(n: int) -> Finished:
        fin = None
        for ev in s.generate(PROMPT, SamplingParams.greedy_params(), n, capture=capture, chat=True, ignore_eos=True):
            if isinstance(ev, Finished):
                fin = ev
        return fin

    once(4)
    runs = [once(new_tokens) for _ in range(repeats)]
    best = min(runs, key=lambda f: f.tpot_s)
    return {"tpot_ms": best.tpot_s * 1e3, "ttft_ms": min(f.ttft_s for f in runs) * 1e3,
            "tpot_ms_every_run": [round(f.tpot_s * 1e3, 3) for f in runs], "ids": [int(i) for i in best.ids[:16]],
            "prompt_tokens": len(s.tokenizer.encode(s.tokenizer.chat_prompt(PROMPT)).ids),
            "dtype": str(lm.dtype).removeprefix("torch."),
            "gpu_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if DEVICE == "cuda" else None}


def hf_decode(path: Path, dtype: str, new_tokens: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from engine.tokenizer.load import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    model = model.to(DEVICE).eval()
    tok = load_tokenizer(str(path))
    ids = torch.tensor([tok.encode(tok.chat_prompt(PROMPT)).ids], device=DEVICE)

    def once(n: int) -> tuple[float, list[float], list[int]]:
        out_ids = []
        with torch.inference_mode():
            _sync()
            t = time.perf_counter()
            out = model(ids, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            _sync()
            ttft = time.perf_counter() - t
            out_ids.append(int(nxt))
            past, steps = out.past_key_values, []
            for _ in range(n - 1):
                t = time.perf_counter()
                out = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                _sync()
                steps.append(time.perf_counter() - t)
                out_ids.append(int(nxt))
        return ttft, steps, out_ids

    once(4)
    runs = [once(new_tokens) for _ in range(repeats)]
    best = min(runs, key=lambda r: statistics.mean(r[1]))
    return {"tpot_ms": statistics.mean(best[1]) * 1e3, "ttft_ms": min(r[0] for r in runs) * 1e3,
            "tpot_ms_every_run": [round(statistics.mean(r[1]) * 1e3, 3) for r in runs], "ids": best[2][:16],
            "prompt_tokens": int(ids.shape[1])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cuda_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", required=True, type=Path, help="a folder with config.json and tokenizer files")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    import torch

    global DEVICE
    DEVICE = a.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("torch sees no CUDA GPU: this benchmark runs on a machine with one", file=sys.stderr)
        return 1
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "none (--device cpu)"
    print(f"GPU: {gpu}, torch {torch.__version__}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="ilab-cuda-") as tmp:
        path = write_random_weights(a.shapes, Path(tmp) / "model")
        ours = engine_decode(path, a.dtype, a.new_tokens, a.repeats, capture_all=False)
        ours_all = engine_decode(path, a.dtype, a.new_tokens, a.repeats, capture_all=True)
        hf = hf_decode(path, a.dtype, a.new_tokens, a.repeats)
    print(json.dumps({
        "command": "python -m benchmarks.cuda_decode " + " ".join(argv if argv is not None else sys.argv[1:]),
        "gpu": gpu, "torch": torch.__version__, "new_tokens": a.new_tokens,
        "engine": ours, "engine_every_capture": ours_all, "hf": hf,
        "decode_tokens_per_s_vs_hf": hf["tpot_ms"] / ours["tpot_ms"],
        "decode_tokens_per_s_vs_hf_every_capture": hf["tpot_ms"] / ours_all["tpot_ms"],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

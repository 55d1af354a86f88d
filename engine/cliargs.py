"""What the engine's commands share: the one-line parser, the model, sampling, thread and server arguments."""

from __future__ import annotations

import argparse
import sys

from engine.protocol import SamplingParams
from engine.remote.client import API_KEY_ENV
from engine.run.threads import threads_arg


class CliError(Exception):
    """Something the user can fix; printed as one line."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + error
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file, a Hugging Face model directory or a known model "
                   "(smollm2, gemma3-270m); default: SmolLM2")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "llama.cpp"],
                   help="the local runtime: torch (the readable engine), llama.cpp (a GGUF as it is, instrumented), "
                        "or auto: llama.cpp for GGUF models of 1B parameters or more when it is installed")
    add_url_args(p)


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=threads_arg, default="auto",
                   help="CPU threads: auto (default; fewer when other programs hold the cores) or a fixed count")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS to token ID's logit before sampling (repeatable), e.g. --logit-bias 7042=-100")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--greedy", action="store_true", help="same as --temperature 0")


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    try:
        bias = []
        for item in a.logit_bias:
            token, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--logit-bias takes ID=BIAS, got {item!r}")
            bias.append((int(token), float(value)))
        return SamplingParams(
            temperature=0.0 if a.greedy else a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
            repetition_penalty=a.repetition_penalty, logit_bias=tuple(bias), seed=a.seed,
        )
    except ValueError as e:
        raise CliError(str(e)) from None



def add_url_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="an OpenAI-compatible server (vLLM, llama.cpp) instead of --model")
    p.add_argument("--api-key-env", default=API_KEY_ENV, metavar="VAR",
                   help=f"environment variable holding the server's API key (default {API_KEY_ENV})")
    p.add_argument("--allow-insecure-key", action="store_true",
                   help="send the API key even over plain http:// to another machine (refused otherwise)")


def session_from_args(a: argparse.Namespace):
    """A Session on the model the arguments name, run by the backend they choose (CliError with one sentence when
    it cannot load)."""
    from engine.backends import choose
    from engine.loaders import ModelLoadError, load
    from engine.run.session import Session

    try:
        if choose(a.model, getattr(a, "backend", "auto")) == "llama.cpp":
            from engine.backends.llamacpp import LlamaCppSession

            return LlamaCppSession(a.model, threads=a.threads)
        return Session(load(a.model, device=a.device, dtype=a.dtype), threads=a.threads)
    except (ModelLoadError, ValueError) as e:
        raise CliError(str(e)) from None

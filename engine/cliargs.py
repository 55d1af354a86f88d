"""What the engine's commands share: the one-line parser, bounded value types, the model, sampling, thread and
server arguments.

A value that cannot be right on any machine (a negative count, NaN, a seed past 64 bits, an unknown choice) is
refused by the parser, in one line with exit status 2, before anything loads. One that is wrong only for the model
loaded (a step past its context, a token past its vocabulary) is a UsageError, also exit status 2, once the model
says so. What the machine lacks (a model file, CUDA, llama.cpp) is a CliError: one line, exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from engine.protocol import API_KEY_ENV, DEFAULT_MODE, KERNEL_MODES, SamplingParams
from engine.text import server_address

MAX_INT = 2**31 - 1  # counts handed to C (llama.cpp's int32 fields, a server's max_tokens) stay in range
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed, numpy's default_rng and servers' int64 seeds all take it
MAX_BIAS = 100.0  # OpenAI's range for logit_bias, which --url sends on as it is


class CliError(Exception):
    """Something the user can fix; printed as one line (exit status 1)."""


class UsageError(CliError):
    """A flag's value that does not fit the loaded model (or the other flags); printed as one line with exit status
    2, as the parser's own refusals."""


@contextlib.contextmanager
def one_line(*errors: type[Exception], usage: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """The block's refusals the user can act on, as one line: those of `usage` a UsageError, of `errors` a CliError
    (their tracebacks would say nothing more to the user)."""
    try:
        yield
    except usage as e:
        raise UsageError(str(e)) from None
    except errors as e:
        raise CliError(str(e)) from None


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + error
        print(f"{self.prog}: error: {' '.join(message.split())}", file=sys.stderr)
        raise SystemExit(2)


def _shown(text: str) -> str:
    """A refused value as the message quotes it: short, one line."""
    text = " ".join(text.split())
    return repr(text if len(text) <= 40 else text[:39] + "…")


def int_in(lo: int, hi: int = MAX_INT) -> Callable[[str], int]:
    """An argparse type: an integer from `lo` to `hi`."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:  # also Python's refusal of a number with thousands of digits
            n = None
        if n is None or not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"takes an integer from {lo} to {hi}, got {_shown(text)}")
        return n

    parse.__name__ = "int"
    return parse


def float_in(lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False,
             inf: bool = False) -> Callable[[str], float]:
    """An argparse type: a number in the interval given (NaN never; infinity only with `inf`)."""
    shown = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open or (math.isinf(hi) and not inf) else ']'}"

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            x = math.nan
        ok = (not math.isnan(x) and (inf or math.isfinite(x)) and (lo < x if lo_open else lo <= x)
              and (x < hi if hi_open else x <= hi))
        if not ok:
            raise argparse.ArgumentTypeError(f"takes a number in {shown}, got {_shown(text)}")
        return x

    parse.__name__ = "float"
    return parse


def int_list(lo: int, hi: int) -> Callable[[str], list[int]]:
    """An argparse type: integers from `lo` to `hi` separated by commas ("1,2,4")."""
    one = int_in(lo, hi)

    def parse(text: str) -> list[int]:
        try:
            out = [one(x) for x in text.split(",") if x.strip()]
        except argparse.ArgumentTypeError:
            out = []
        if not out:
            raise argparse.ArgumentTypeError(f"takes integers from {lo} to {hi} separated by commas, got "
                                             f"{_shown(text)}")
        return out

    parse.__name__ = "list"
    return parse


def regex(text: str) -> str:
    """--regex: a regular expression the grammar engine (llguidance) reads, checked before any model loads."""
    import llguidance

    report = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_regex(text))
    if report:  # several lines with a caret drawing; the line that says what is wrong starts with "error:"
        lines = [ln.strip() for ln in report.splitlines() if ln.strip()]
        why = next((ln.removeprefix("error:").strip() for ln in lines if ln.startswith("error:")), lines[0])
        raise argparse.ArgumentTypeError(f"not a regular expression the grammar engine reads ({why}): {_shown(text)}")
    return text


def threads(text: str) -> int | str:
    """--threads: auto, or a count from 1 to four threads per CPU (more only queue; 99999 crashed torch)."""
    if text == "auto":
        return text
    most = 4 * (os.cpu_count() or 1)
    try:
        return int_in(1, most)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"takes auto or a count from 1 to {most} (4 per CPU here), got "
                                         f"{_shown(text)}") from None


def logit_bias(text: str) -> tuple[int, float]:
    """--logit-bias ID=BIAS: a token id and a finite bias within OpenAI's ±100."""
    token, sep, value = text.partition("=")
    try:
        tid, bias = int(token), float(value)
    except ValueError:
        sep = ""
    if not sep:
        raise argparse.ArgumentTypeError(f"takes ID=BIAS (e.g. 7042=-5), got {_shown(text)}")
    if not 0 <= tid <= MAX_INT or not -MAX_BIAS <= bias <= MAX_BIAS:  # NaN fails the comparison too
        raise argparse.ArgumentTypeError(f"takes a token id from 0 and a bias from -{MAX_BIAS:g} to {MAX_BIAS:g}, "
                                         f"got {_shown(text)}")
    return tid, bias


def _in_a_folder(path: Path, text: str) -> str:
    parent = path.absolute().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{_shown(str(parent))} is no folder that exists, so {_shown(text)} cannot be "
                                         "written there")
    return text


def output_file(text: str) -> str:
    """A file to write: not a folder, in a folder that exists (checked before any work is done)."""
    path = Path(text).expanduser()
    if not text.strip() or path.is_dir():
        raise argparse.ArgumentTypeError(f"takes a file to write, got {_shown(text)}")
    return _in_a_folder(path, text)


def output_folder(text: str) -> str:
    """A folder to write: not a file; it may not exist yet, the folder it goes in must."""
    path = Path(text).expanduser()
    if not text.strip() or (path.exists() and not path.is_dir()):
        raise argparse.ArgumentTypeError(f"takes a folder to write, got {_shown(text)}")
    return _in_a_folder(path, text)


def add_model_args(p: argparse.ArgumentParser) -> None:
    add_local_model_args(p)
    add_url_args(p)


def add_local_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file, a Hugging Face model directory or a known model "
                   "(smollm2, gemma3-270m); default: SmolLM2")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    add_kernels_arg(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "llama.cpp"],
                   help="the local runtime: torch (the readable engine), llama.cpp (a GGUF as it is, instrumented), "
                        "or auto: llama.cpp for GGUF models of 1B parameters or more when it is installed")


def add_kernels_arg(p: argparse.ArgumentParser, name: str = "--kernels", of: str = "") -> None:
    """--kernels exact|file|fast: how the torch runtime's decode products compute (KERNEL_MODES)."""
    p.add_argument(name, default=DEFAULT_MODE, choices=list(KERNEL_MODES),
                   help=f"how the torch runtime computes {of or 'the model'}: "
                        + "; ".join(f"{k}: {v}" for k, v in KERNEL_MODES.items()))


EXACT_PRODUCTS = "exact"  # what a command that forces F.linear on every product computes, whatever the model's mode


def stamped(doc: dict, info: object | None, kernels: str | None = None) -> dict:
    """A command's --json document with what computed it: the kernel mode and dtype of the model `info`
    (ModelInfo; None: a server, which computes as it does); `kernels`: the mode the command itself ran its products
    in, where it overrides the model's (EXACT_PRODUCTS: the why-experiments that force F.linear)."""
    assert "kernels" not in doc and "dtype" not in doc, "a document's own kernels or dtype would be overwritten"
    if info is None:
        return {**doc, "kernels": "server", "dtype": None}
    return {**doc, "kernels": kernels or info.kernels, "dtype": info.dtype}


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=threads, default="auto",
                   help="CPU threads: auto (default; fewer when other programs hold the cores) or a fixed count")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float_in(0, 10), default=0.7, help="0 = greedy")
    p.add_argument("--top-k", type=int_in(0), default=0, help="0 = off")
    p.add_argument("--top-p", type=float_in(0, 1, lo_open=True), default=1.0, help="1 = off")
    p.add_argument("--min-p", type=float_in(0, 1, hi_open=True), default=0.0, help="0 = off")
    p.add_argument("--repetition-penalty", type=float_in(0, 100, lo_open=True), default=1.0, help="1 = off")
    p.add_argument("--logit-bias", type=logit_bias, action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS to token ID's logit before sampling (repeatable), e.g. --logit-bias 7042=-100")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=None)
    p.add_argument("--greedy", action="store_true", help="same as --temperature 0")


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    with one_line(usage=(ValueError,)):
        return SamplingParams(
            temperature=0.0 if a.greedy else a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
            repetition_penalty=a.repetition_penalty, logit_bias=tuple(a.logit_bias), seed=a.seed,
        )


def server_url(text: str) -> str:
    """--url: an http(s) address with a host and a valid port (checked without connecting)."""
    try:
        server_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def check_bias(params: SamplingParams, vocab_size: int) -> None:
    """UsageError when --logit-bias names a token past the loaded model's vocabulary."""
    for token, _ in params.logit_bias:
        if token >= vocab_size:
            raise UsageError(f"--logit-bias names token {token}, past this model's vocabulary (0 to {vocab_size - 1})")


def add_url_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", type=server_url, default=None,
                   help="an OpenAI-compatible server (vLLM, llama.cpp) instead of --model")
    p.add_argument("--api-key-env", default=API_KEY_ENV, metavar="VAR",
                   help=f"environment variable holding the server's API key (default {API_KEY_ENV})")
    p.add_argument("--allow-insecure-key", action="store_true",
                   help="send the API key even over plain http:// to another machine (refused otherwise)")
    p.add_argument("--timeout", type=float_in(0, 3600, lo_open=True), default=60.0, metavar="SECONDS",
                   help="how long to wait for the server's answer, and then for each complete streamed event "
                        "(default 60)")

"""llama.cpp as a second local backend, instrumented: a GGUF file runs in about its own memory at llama.cpp's speed,
and every panel still gets the events this engine's own Session yields.

How each event is obtained:
- the prompt is tokenized by this engine's tokenizer (pieces and spans match the app's) and fed to llama.cpp as
  token ids (llama_decode with a batch);
- logits: llama.cpp's full-vocabulary logits of the last position; the token is chosen by this engine's sampling
  funnel (engine.run.sampling), so the Logits panel's funnel is exact and settings mean the same as in Session;
- attention and the residual stream: llama.cpp's graph callback (engine.backends.llamacpp_seam._Tap) copies out
  `kq_soft_max-N` (layer N's weights, numpy (heads, queries, keys)), `l_out-N` and the embedding, and only while
  the step's Capture asks for them;
- the logit lens: the captured residual vectors through the model's final norm and output matrix, the only two
  tensors read (and dequantized) from the file here, and only once a lens is first asked for;
- costs: engine.costs.formulas with the config read from the GGUF header and the file's own bytes per weight.

llama.cpp's attention must not be fused (flash attention never forms the softmax), so contexts are made without it
unless asked (then attention is reported as unavailable). Sliding-window models get a full-size cache (`swa_full`),
so a cache cell is always the position of the same number and prefix reuse can truncate anywhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from engine.backend import Unsupported
from engine.backends import isa
from engine.backends.llamacpp_seam import _Tap
from engine.backends.local import LocalBackend
from engine.costs import formulas as costs
from engine.costs.info import model_info
from engine.events import Capability, RunSource
from engine.formats.locate import ModelLoadError, cache_root, resolve_model_path
from engine.formats.runtime_rule import DEFAULT_CONTEXT
from engine.model.config import ModelConfig
from engine.model.dtypes import lookup as dtype_lookup
from engine.model.threads import available_cores
from engine.run.session import Engine
from engine.runtime.llamacpp import LlamaCppRuntime, free_context
from engine.tokenizer.load import load_tokenizer

HEADER_CACHE_VERSION = "2"  # bump when read_config, tensor_stats, _lens_places or file_type_name change their answer
UBATCH = 512  # tokens per graph evaluation during a prefill (llama.cpp splits a longer batch itself)
# ggml_type of llama.cpp's K and V caches -> the dtype engine.costs prices them at (its default is F16, whatever the
# weights' type: a Q4 file still keeps float16 keys and values); GGML_TYPE_BF16 (30) is not exported by llama_cpp
KV_TYPES = {0: "float32", 1: "float16", 30: "bfloat16", 8: "q8_0", 3: "q4_1"}
LENS_ROWS = 1024  # rows of the output matrix dequantized at a time (the gguf package's temporaries: a few MiB each)
HEAD_CHUNK = 1 << 20  # values of the lens's float16 output matrix widened to float32 at a time (4 MiB, held in
# the last-level cache until the product reads it; a row count by values keeps a narrow model's loop short)


def _header_cache(path: Path) -> Path:
    """Where a GGUF file's header facts are kept: by its path, size and modification time."""
    st = path.stat()
    key = f"{HEADER_CACHE_VERSION}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return cache_root() / "headers" / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")




def _llama():
    """The llama_cpp module, with ggml's tensor accessors bound once; ModelLoadError when it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        raise ModelLoadError(
            "the llama.cpp backend needs llama-cpp-python: run `pip install llama-cpp-python==0.3.36`") from None
    if not hasattr(llama_cpp, "_lab_ggml"):
        # before the first product: a build that would die of SIGILL here is refused in one sentence instead
        why = isa.refusal(llama_cpp.llama_print_system_info().decode(errors="replace"), isa.cpu_flags())
        if why:
            raise ModelLoadError(why)
        from llama_cpp._ctypes_extensions import load_shared_library

        base = load_shared_library("ggml-base", Path(llama_cpp.__file__).parent / "lib")
        base.ggml_backend_buffer_is_host.argtypes, base.ggml_backend_buffer_is_host.restype = [ctypes.c_void_p], \
            ctypes.c_bool
        base.ggml_nbytes.argtypes, base.ggml_nbytes.restype = [ctypes.c_void_p], ctypes.c_size_t
        base.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        base.ggml_backend_tensor_get.restype = None
        llama_cpp._lab_ggml = base
        silent = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda level, text, data: None)
        llama_cpp._lab_log = silent  # kept alive: llama.cpp holds the pointer
        llama_cpp.llama_log_set(silent, None)
        llama_cpp.llama_backend_init()
    return llama_cpp


class _LensHead(torch.nn.Module):
    """The final norm and the LM head read from the file: what engine.run.lens projects through.

    The (V, d) output matrix is kept in float16, half the memory of float32, and widened to float32 HEAD_CHUNK
    values at a time as it multiplies; the quantized file's values fit float16's 11-bit mantissa closely (BENCHMARKS.md,
    "The lens's memory"). A matrix float16 cannot hold stays float32.
    """

    def __init__(self, norm: torch.Tensor, output: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.norm_weight = torch.nn.Parameter(norm, requires_grad=False)  # (d,), first: lens_probs reads its dtype
        self.output = torch.nn.Parameter(output, requires_grad=False)  # (V, d)
        self.eps = eps

    def head(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), self.norm_weight.float(), self.eps)
        h2 = h.reshape(-1, h.shape[-1])
        out = h2.new_empty(h2.shape[0], self.output.shape[0])
        if self.output.dtype == torch.float32:  # a matrix float16 could not hold: one product
            return torch.mm(h2, self.output.T, out=out).reshape(*h.shape[:-1], -1)
        rows = max(1, HEAD_CHUNK // self.output.shape[1])
        for i in range(0, self.output.shape[0], rows):  # every layer's row at once, a slice of the vocabulary each
            torch.mm(h2, self.output[i:i + rows].float().T, out=out[:, i:i + rows])
        return out.reshape(*h.shape[:-1], -1)


def _lens_places(reader) -> dict:
    """Where the lens's two tensors lie in the file: {"norm"|"output": {offset, n_bytes, type, shape}} (shape as
    ggml's ne, innermost first), kept in the header cache so that a lens reads only their bytes."""
    tensors = {t.name: t for t in reader.tensors}
    out = tensors.get("output.weight") or tensors.get("token_embd.weight")
    norm = tensors.get("output_norm.weight")
    if out is None or norm is None:
        return {}  # an architecture whose head is named otherwise: the lens says it cannot
    return {k: {"offset": int(t.data_offset), "n_bytes": int(t.n_bytes), "type": int(t.tensor_type),
                "shape": [int(x) for x in t.shape]} for k, t in (("norm", norm), ("output", out))}


def _read_rows(path: Path, place: dict, dtype) -> torch.Tensor:
    """One tensor of the file, dequantized LENS_ROWS rows at a time into `dtype` (float16 falls back to float32
    when a value lies beyond its range). Only the tensor's own bytes are mapped, after checking they lie in the
    file and match its type and shape."""
    import gguf

    qtype = gguf.GGMLQuantizationType(place["type"])
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    shape = tuple(reversed(place["shape"]))  # torch order: (rows, row length)
    n = int(np.prod(shape))
    if n % block or n // block * type_size != place["n_bytes"] or shape[-1] % block:
        raise ValueError(f"{path.name}: a {qtype.name} tensor of shape {shape} cannot hold {place['n_bytes']} bytes")
    if place["offset"] < 0 or place["offset"] + place["n_bytes"] > path.stat().st_size:
        raise ValueError(f"{path.name}: a tensor's bytes lie beyond the end of the file")
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=place["offset"], shape=(place["n_bytes"],))
    out = np.empty(shape, dtype=dtype).reshape(-1, shape[-1])
    data = data.reshape(out.shape[0], -1)  # (rows, bytes per row)
    for i in range(0, out.shape[0], LENS_ROWS):
        rows = gguf.quants.dequantize(data[i:i + LENS_ROWS], qtype)
        if dtype == np.float16 and not np.isfinite(rows.astype(np.float16)).all():
            return _read_rows(path, place, np.float32)  # values beyond float16's range: this one stays float32
        out[i:i + LENS_ROWS] = rows
    return torch.from_numpy(out.reshape(shape))


def _info_dtype(file_type: str, bits_per_weight: float) -> str:
    """A dtype name the cost panels accept for the file's weights (the exact type stays in ModelInfo.file_type)."""
    name = {"ALL_F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(file_type, file_type.lower())
    try:
        dtype_lookup(name)
        return name
    except ValueError:
        return "int4" if bits_per_weight <= 5 else "int8" if bits_per_weight <= 9 else "float16"


def kv_cache_dtype(type_k: int, type_v: int) -> str:
    """The dtype of a llama.cpp context's KV cache, from its llama_context_params' type_k and type_v."""
    if type_k != type_v or type_k not in KV_TYPES:
        raise ModelLoadError(f"llama.cpp's KV cache types (K {type_k}, V {type_v}) are not one this engine can price")
    return KV_TYPES[type_k]


def _sha256(path: Path) -> str:
    """The file's SHA-256, hashed once per file version and remembered in the cache (a saved session names it)."""
    from engine.formats.locate import file_sha256

    try:
        return file_sha256(path, memo=cache_root() / "sha256")
    except OSError:
        return ""


class LlamaCppSession(Engine):
    """A GGUF model run by llama.cpp: the engine (engine.run.session.Engine) over llama.cpp's runtime.

    `threads`: "auto" (every core this process may use) or a count; `n_ctx`: positions the KV cache holds (it is
    allocated whole, at load); `flash_attn`: llama.cpp's fused attention (faster on some machines; attention
    weights are then not available); `ubatch`: tokens per graph evaluation in a prefill.
    """

    threads = None  # Session's adaptive thread controller; llama.cpp keeps a fixed count (n_threads)
    _ctx = _batch = _model = _seam = None  # until made (close frees what was)

    def __init__(self, model: str | os.PathLike | None = None, threads: int | str = "auto",
                 n_ctx: int | None = None, flash_attn: bool = False, ubatch: int = UBATCH) -> None:
        t0 = time.perf_counter()
        self.path = resolve_model_path(model)
        if self.path.is_dir():
            raise ModelLoadError(f"{self.path.name} is a folder: the llama.cpp backend runs GGUF files")
        self.llama = _llama()
        self.cfg, stats, file_type = self._read_header(self.path)
        self._lens_places = stats["lens_tensors"]
        self.tokenizer = load_tokenizer(self.path)
        L = self.llama
        self.n_threads = available_cores() if threads == "auto" else int(threads)
        if self.n_threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.flash_attn = flash_attn
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0  # this engine's device is the CPU; a GPU build would otherwise take every layer
        # Read, not mapped: llama.cpp repacks most weights into its own interleaved layout on AVX2 and AVX-512 CPUs,
        # and a mapped file's pages stay resident beside that copy, counting the weights twice (BENCHMARKS.md "The
        # llama.cpp backend": peak memory). Read into its buffers, the file's bytes are held once either way.
        mp.load_mode = L.LLAMA_LOAD_MODE_NONE
        self._model = L.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {self.path.name} (its log says why; it was silenced)")
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self._model))
        if n_vocab != self.cfg.vocab_size:
            self.close()
            raise ModelLoadError(
                f"{self.path.name}: llama.cpp sees {n_vocab} tokens, the file's header says {self.cfg.vocab_size}")
        want = min(self.cfg.context_length, n_ctx or DEFAULT_CONTEXT)
        self.tap = _Tap(L._lab_ggml)
        self.tap.callback = L.ggml_backend_sched_eval_callback(self.tap)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = want, want, max(1, min(ubatch, want))
        cp.n_outputs_max_per_seq = 0  # every position's logits when a prefill scores the prompt
        cp.n_threads = cp.n_threads_batch = self.n_threads
        cp.flash_attn_type = 1 if flash_attn else 0  # llama_flash_attn_type: ENABLED, DISABLED
        cp.swa_full = True
        cp.no_perf = True
        cp.cb_eval = self.tap.callback
        try:
            self.kv_dtype = kv_cache_dtype(cp.type_k, cp.type_v)  # llama.cpp's default, read rather than assumed
        except ModelLoadError:
            self.close()
            raise
        self._ctx = L.llama_init_from_model(self._model, cp)
        if not self._ctx:
            self.close()
            raise ModelLoadError(f"llama.cpp could not make a context of {want} positions for {self.path.name}")
        self.n_ctx = int(L.llama_n_ctx(self._ctx))
        self.cfg = replace(self.cfg, context_length=min(self.n_ctx, self.cfg.context_length))
        self._mem = L.llama_get_memory(self._ctx)
        self._batch = L.llama_batch_init(cp.n_batch, 0, 1)
        self._batch_size = cp.n_batch
        self.stop_ids = frozenset(self.tokenizer.eos_ids) | frozenset(self.cfg.eos_token_ids)
        self._lens: _LensHead | None = None
        self.cannot: tuple[Capability, ...] = ("attention",) if flash_attn else ()
        files = stats["file_tensors"]
        self.file_bytes = sum(b for b, _ in files.values())
        self.embedding_file_bytes = stats["file_embedding_bytes"]
        bits = 8 * self.file_bytes / max(1, sum(n for _, n in files.values()))
        self.info = model_info(
            self.cfg, str(self.path), n_params=costs.n_params(self.cfg), dtype=_info_dtype(file_type, bits),
            device="cpu", kv_dtype=self.kv_dtype, kv_windowed=False,  # swa_full: every layer keeps every position
            weight_bytes=self.file_bytes,
            decode_weight_bytes=costs.step_weight_bytes_file(self.cfg, self.file_bytes, self.embedding_file_bytes, 1),
            file_type=file_type, file_tensors=files, file_embedding_bytes=self.embedding_file_bytes,
            load_s=time.perf_counter() - t0, from_cache=False, sha256=_sha256(self.path),
            kernels="file",  # llama.cpp multiplies the file's quantized blocks as they are
        )  # the one ModelInfo of this model: every runtime made over it (engine.runtime.llamacpp) reuses it
        self._rt = LlamaCppRuntime.of_session(self)  # generations: sequence 0 of this context, watched

    @staticmethod
    def _read_header(path: Path) -> tuple[ModelConfig, dict, str]:
        """Config, storage by tensor type and file type from the header; the weights are left to llama.cpp.

        The gguf package parses every metadata array in Python, slow on a large vocabulary (Gemma's 262,144 tokens),
        so the three facts are kept in the cache by file, as the tokenizer is, and later loads read them at once.
        """
        from engine.loaders import gguf as gg

        cached = _header_cache(path)
        try:
            d = json.loads(cached.read_text(encoding="utf-8"))
            return ModelConfig.from_dict(d["config"]), d["stats"], str(d["file_type"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none yet, or unreadable: read the header
        try:
            reader = gg.open_reader(path)
            cfg = gg.read_config(reader, path.stem)
            stats, file_type = gg.tensor_stats(reader), gg.file_type_name(reader)
            stats["lens_tensors"] = _lens_places(reader)
        except (ValueError, OSError) as e:
            text = str(e) if str(e).startswith(path.name) else f"cannot load {path.name}: {e}"
            raise ModelLoadError(text) from None
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(".tmp")
            tmp.write_text(json.dumps({"config": cfg.to_dict(), "stats": stats, "file_type": file_type}),
                           encoding="utf-8")
            tmp.replace(cached)
        except OSError:
            pass  # a read-only or full disk only costs the next load
        return cfg, stats, file_type

    def close(self) -> None:
        """Free llama.cpp's contexts and model (also done when the object is collected)."""
        if self._seam is not None:
            self._seam.close()
        free_context(self)
        if self._model:
            self.llama.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        if not sys.is_finalizing():  # at exit the module's globals (free_context) may be gone; the OS frees it
            self.close()

    def set_threads(self, n: int) -> None:
        """Use `n` threads from the next step on (llama.cpp has no adaptive setting: see engine.model.threads)."""
        if int(n) < 1:
            raise ValueError(f"threads must be at least 1, got {n}")
        self.n_threads = int(n)
        self.llama.llama_set_n_threads(self._ctx, self.n_threads, self.n_threads)

    # ---- the intervention seam (engine.model.seam's points, engine.backends.llamacpp_seam) ------------------------
    runtime_name = "llama.cpp"
    can = frozenset({"edit"})  # engine.backend.CAPABILITIES: no backward pass, no early exit, its own KV cache

    def seam_context(self):
        """The seam's own llama.cpp runtime (made on first use, freed with the session)."""
        from engine.backends.llamacpp_seam import SeamRuntime

        if self._seam is None:
            self._seam = SeamRuntime(self)
        return self._seam

    def run_points(self, prompts, edits=(), record=(), every: bool = False):
        """engine.model.seam.run_points on llama.cpp (engine.backends.llamacpp_seam)."""
        from engine.backends.llamacpp_seam import run_points

        return run_points(self, prompts, edits, record, every)

    def sibling(self, path: str) -> LlamaCppSession:
        """A session of another GGUF file on llama.cpp, with this one's threads and attention setting."""
        return LlamaCppSession(path, threads=self.n_threads, flash_attn=self.flash_attn)

    @property
    def dtype_name(self) -> str:
        return self.info.file_type  # the file's own type: what llama.cpp multiplies

    def new_runtime(self, n_seq: int = 1, capacity: int | None = None, page_size: int | None = None
                    ) -> LlamaCppRuntime:
        """A context of `n_seq` sequences of up to `capacity` positions over this model (weights held once);
        `page_size`: one unified pool of cells instead of a stream per sequence."""
        return LlamaCppRuntime(self, n_seq, capacity, pooled=page_size is not None)

    @contextlib.contextmanager
    def intervened(self, edits, adapter: bool = True):
        """The seam's `edits` applied to every step this session's context runs inside the `with` block: vectors
        added to blocks' outputs at every position (steering) through llama.cpp's control-vector adapter, which costs
        a step nothing while the vectors stay as they are (BENCHMARKS.md, "The why-experiments on llama.cpp"), unless
        `adapter` is False; any other edit through the graph callback (engine.backends.llamacpp_seam.Writes)."""
        from engine.backends.llamacpp_seam import AdapterSteer, Writes

        edits = list(edits)
        if self.tap.writes is not None or self.tap.adapter is not None:
            raise ValueError("an intervention is already on for this session")
        if adapter and edits and all(AdapterSteer.takes(e, self.cfg) for e in edits):
            self.tap.adapter = AdapterSteer(self, edits)
            try:
                yield edits
            finally:
                self.tap.adapter.clear()
                self.tap.adapter = None
            return
        writes = Writes(edits, self.cfg)
        if self.flash_attn and any(n.startswith(b"kqv_out-") for n in writes.by_node):
            raise Unsupported("llama.cpp's flash attention fuses the heads' outputs away: load without it to edit a "
                              "head's output")
        self.tap.writes = writes
        self.tap.active = True
        try:
            yield writes
        finally:
            self.tap.writes = None
            self.tap.end()

    # ---- the cache and one forward step ------------------------------------------------------------------------
    device = torch.device("cpu")

    def runtime(self, capacity: int | None = None) -> LlamaCppRuntime:
        """The one-sequence runtime generations run on: this session's own context (allocated whole at load)."""
        return self._rt

    def source(self) -> RunSource:
        """What a generation on this session says it runs on (RunStarted)."""
        return RunSource(kind="local", name=f"{self.info.name} (llama.cpp)", cannot=self.cannot)

    def forget_cache(self) -> None:
        self._rt.clear()

    def lens_head(self) -> _LensHead:
        """The final norm (float32) and the output matrix (float16), dequantized from the file on first use."""
        if self._lens is None:
            places = self._lens_places
            if not places:
                raise Unsupported("the logit lens needs the file's output_norm and output tensors, which it lacks")
            self._lens = _LensHead(_read_rows(self.path, places["norm"], np.float32),
                                   _read_rows(self.path, places["output"], np.float16), self.cfg.norm_eps)
        return self._lens


class LlamaCppBackend(LocalBackend):
    """llama.cpp behind the backend seam: generations, previews, tokenization and the labs (batched decode,
    scheduling, speculative decoding, on engine.runtime.llamacpp) through LocalBackend's own calls; its session keeps
    the fixed thread count it was loaded with (no adaptive controller to set)."""

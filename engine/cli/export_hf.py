"""Export a model (a GGUF file, usually) as a Hugging Face directory that vLLM and transformers can serve.

    python -m engine export-hf --model M --out DIR

writes config.json, model.safetensors (float32: the dequantized GGUF values exactly), tokenizer.json (the same
`tokenizers` pipeline this engine tokenizes with, so SmolLM2's one-digit-per-token split and llama.cpp's handling of
bytes the vocabulary lacks survive), tokenizer_config.json with the chat template, and generation_config.json
(BOS/EOS only: no sampling defaults, so a server's defaults stay the server's).

The engine keeps q/k rows in the adjacent-pair RoPE layout (engine.model.rope); HF checkpoints use rotate-halves,
so those rows are reordered back here — the exact inverse of `halves_to_pairs`, which the HF loader applies.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the tokenizer load only when exporting: `python -m engine` starts fast
    import torch

    from engine.model.config import ModelConfig
    from engine.tokenizer import Tokenizer

HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

class ExportError(Exception):
    """The model cannot be exported; the message is one sentence for the user."""


def pairs_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k rows from adjacent pairs back to rotate-halves: the inverse of engine.model.rope.halves_to_pairs."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str:
    from engine.loaders.hf import WEIGHT_MAP, renamed

    hf = renamed(name, {engine: hf for hf, engine in WEIGHT_MAP.items()})
    if hf is None:
        raise ExportError(f"tensor {name!r} has no Hugging Face name")
    return hf


def hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Unfused engine tensors -> Hugging Face tensors (q/k rows in the rotate-halves layout)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, w in sd.items():
        if ".attn.wq." in name:
            w = pairs_to_halves(w, cfg.n_heads)
        elif ".attn.wk." in name:
            w = pairs_to_halves(w, cfg.n_kv_heads)
        out[_hf_name(name)] = w.detach().to(torch.float32).contiguous()
    return out


def hf_config(cfg: ModelConfig, eos_id: int | None) -> dict:
    if cfg.architecture not in HF_CLASSES:
        raise ExportError(f"cannot export architecture {cfg.architecture!r} (exportable: {', '.join(HF_CLASSES)})")
    return {
        "architectures": [HF_CLASSES[cfg.architecture]],
        "model_type": cfg.architecture,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_scaling": None,
        "attention_bias": cfg.qkv_bias,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tied_embeddings,
        "vocab_size": cfg.vocab_size,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def hf_backend(tok: Tokenizer):
    """The engine's own `tokenizers` pipeline (BPE + the llama.cpp pre-tokenizer) as a stand-alone tokenizer.json
    model: GGUF control / user-defined tokens become added tokens (matched in the text, as llama.cpp matches them),
    and a BPE post-processor adds BOS when the model asks for it."""
    from tokenizers import AddedToken, processors

    from engine.tokenizer.vocab import _TYPE_CONTROL, _TYPE_UNKNOWN, _TYPE_USER_DEFINED

    rules = tok._rules
    if rules is not None and rules.kind != "bpe":
        raise ExportError("only byte-level BPE tokenizers can be exported yet (this one is SentencePiece-style)")
    backend = tok._backend.__class__.from_str(tok._backend.to_str())
    if rules is not None:
        added = []
        for i, kind in enumerate(rules.token_types.tolist()):
            text = tok._text(i)
            if not text or kind not in (_TYPE_CONTROL, _TYPE_UNKNOWN, _TYPE_USER_DEFINED):
                continue
            added.append((i, AddedToken(text, special=kind != _TYPE_USER_DEFINED, normalized=False)))
        backend.add_tokens([a for _, a in added])
        wrong = [(i, a.content) for i, a in added if backend.token_to_id(a.content) != i]
        if wrong:
            raise ExportError(f"added token {wrong[0][1]!r} would get another id than {wrong[0][0]}")
    if tok.add_bos and tok.bos_id is not None:
        bos = tok._text(tok.bos_id)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_id)]
        )
    return backend


def export(model: str | os.PathLike | None, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write the model as a Hugging Face directory at `out`; returns the directory."""
    from safetensors.torch import save_file

    from engine.loaders import ModelLoadError, _read_source, resolve_model_path
    from engine.model import quant

    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file, not a directory to write")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ExportError(f"{out} exists and is not empty (pass --overwrite to replace it)")
        if not (out / "config.json").is_file():  # `--out ~ --overwrite` must not delete a home directory
            raise ExportError(f"{out} holds no earlier export (no config.json): --overwrite replaces only one")
    try:
        path = resolve_model_path(model)
        cfg, sd, tok, _ = _read_source(path, lambda f, m: None)
    except ModelLoadError as e:
        raise ExportError(str(e)) from None
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        raise ExportError(f"cannot read {Path(str(model)).name if model else 'the default model'}: {e}") from None
    eos_id = tok.eos_ids[0] if tok.eos_ids else (cfg.eos_token_ids[0] if cfg.eos_token_ids else None)
    config = hf_config(cfg, eos_id)
    # a quantized projection's raw blocks or REQUANT marker (kept for the decode kernels) are not weights: its float
    # weight beside them is what is exported
    blocks = tuple(f".{kind}" for kind in quant.KINDS)
    tensors = hf_state_dict({k: v for k, v in sd.items() if not k.endswith(blocks)}, cfg)

    def text(i: int | None) -> str | None:
        return None if i is None else tok._text(i)

    backend = hf_backend(tok)
    added = backend.get_added_tokens_decoder()
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text(tok.bos_id),
        "eos_token": text(eos_id),
        "unk_token": None,
        "pad_token": text(eos_id),
        "add_bos_token": tok.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.context_length,
        "chat_template": tok.chat_template,
        "added_tokens_decoder": {
            str(i): {"content": t.content, "special": t.special, "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False}
            for i, t in sorted(added.items())
        },
    }
    gen_config = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(tok.eos_ids) or eos_id}

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "tokenizer.json").write_text(backend.to_str(pretty=False), encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False),
                                                   encoding="utf-8")
        (tmp / "generation_config.json").write_text(json.dumps(gen_config, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"cannot write {out}: {e}") from None
    return out


def add_subcommand(sub) -> None:
    from engine.cliargs import output_folder

    q = sub.add_parser("export-hf", help="write the model as a Hugging Face directory (for vLLM or transformers)")
    q.add_argument("--model", default=None, help="a .gguf file or a Hugging Face model directory (default: SmolLM2)")
    q.add_argument("--out", type=output_folder, required=True, help="the directory to write (in one that exists)")
    q.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    q.set_defaults(func=_cmd)


def _cmd(a) -> int:
    import sys

    from engine.cliargs import one_line

    with one_line(ExportError):
        out = export(a.model, a.out, overwrite=a.overwrite)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.0f} MB)", file=sys.stderr)
    return 0

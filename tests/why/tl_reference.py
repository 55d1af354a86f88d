"""TransformerLens (4.x) on the same weights as the engine, offline: the reference engine/why's tests are held to.

TransformerLens 4 dropped HookedTransformer; its TransformerBridge wraps the Hugging Face model itself, hooks named as
before (blocks.L.hook_resid_pre, blocks.L.attn.hook_z, blocks.L.attn.hook_pattern, …). `boot_transformers` takes a
local Hugging Face directory: the tiny checkpoint's, or the default model exported with `python -m engine export-hf`
(float32, the GGUF's dequantized values exactly). HF_HUB_OFFLINE keeps it from asking the network for anything.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.requires import import_required


def boot(hf_dir: Path):
    """A TransformerBridge on the Hugging Face directory `hf_dir`, float32 on the CPU, in eval mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import_required("transformer_lens", "references", dist="transformer-lens")
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(str(hf_dir), device="cpu")
    bridge.eval()
    return bridge


def export_default(out: Path) -> Path:
    """The default model (SmolLM2) as a Hugging Face directory, as `python -m engine export-hf` writes it."""
    from engine.cli.export_hf import export
    from tests.requires import default_model

    default_model()  # skips (or fails where required) when the model is not installed
    return export(None, out)

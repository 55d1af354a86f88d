"""The model picker's "fits" counts what the chosen local runtime needs: a GGUF that --backend auto sends to
llama.cpp needs its file (mapped, never dequantized) plus the KV cache llama.cpp allocates at load, whatever the
window's dtype; a model on the torch engine needs its weights at that dtype."""

from __future__ import annotations

from tests.requires import import_required

import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")

from engine.backends.llamacpp import LlamaCppSession  # noqa: E402
from engine.formats import runtime_rule as rule  # noqa: E402
from engine.formats.discover import read_model_facts  # noqa: E402


def test_fits_counts_the_file_and_kv_cache_on_llamacpp_and_float32_weights_on_torch(tiny_dir, monkeypatch):
    size = tiny_dir.gguf.stat().st_size
    torch_entry = read_model_facts(tiny_dir.gguf, "tiny", "file", memory=1 << 40)
    assert torch_entry.weight_bytes["float32"] == 4 * torch_entry.n_params  # small: the torch engine, float32

    monkeypatch.setattr(rule, "LLAMACPP_ABOVE_PARAMS", 1)  # now "auto" sends it to llama.cpp
    entry = read_model_facts(tiny_dir.gguf, "tiny", "file", memory=1 << 40)
    lcpp = LlamaCppSession(tiny_dir.gguf)  # the context it allocates when the app loads it (no n_ctx given)
    kv = lcpp.runtime().kv_event(0).bytes_allocated  # engine.costs' float16 KV cache at that context
    lcpp.close()
    assert set(entry.weight_bytes.values()) == {size + kv}  # the same at every dtype: llama.cpp runs the file
    assert entry.fits["float32"]
    assert not read_model_facts(tiny_dir.gguf, "tiny", "file", memory=size + kv - 1).fits["float32"]

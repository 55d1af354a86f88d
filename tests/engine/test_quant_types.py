"""Every tensor type the `gguf` package dequantizes loads: Q4_0…Q8_0, the K-quants, the IQ types, F16, BF16, ….

For each type a tiny Llama GGUF stores every weight matrix in that type; the loader's tensors must equal the gguf
package's own dequantization of the stored blocks (the reference), in the engine's [out, in] layout. Types that
gguf can also quantize get real quantized data, and a model built from them runs; the others get random blocks.
"""

from __future__ import annotations

import gguf  # a dependency of the app itself: never skipped
import numpy as np
import pytest
import torch
from torch.testing import assert_close

# random blocks hold random fp16 scales: some are inf or NaN, and numpy says so while dequantizing them
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")

from engine.loaders import gguf as gg  # noqa: E402
from engine.loaders import load  # noqa: E402
from tests.tiny_tokenizer import add_tiny_vocab  # noqa: E402

D, FFN, HEADS, KV_HEADS, VOCAB = 256, 256, 4, 2, 300  # rows of 256 values: whole blocks of every type
MATRICES = {  # GGUF name -> torch shape [out, in]
    "token_embd.weight": (VOCAB, D), "output.weight": (VOCAB, D),
    "blk.0.attn_q.weight": (D, D), "blk.0.attn_k.weight": (D // 2, D), "blk.0.attn_v.weight": (D // 2, D),
    "blk.0.attn_output.weight": (D, D), "blk.0.ffn_gate.weight": (FFN, D), "blk.0.ffn_up.weight": (FFN, D),
    "blk.0.ffn_down.weight": (D, FFN),
}
ENGINE = {
    "token_embd.weight": "tok_embeddings.weight", "output.weight": "output.weight",
    "blk.0.attn_q.weight": "layers.0.attn.wq.weight", "blk.0.attn_k.weight": "layers.0.attn.wk.weight",
    "blk.0.attn_v.weight": "layers.0.attn.wv.weight", "blk.0.attn_output.weight": "layers.0.attn.wo.weight",
    "blk.0.ffn_gate.weight": "layers.0.mlp.w_gate.weight", "blk.0.ffn_up.weight": "layers.0.mlp.w_up.weight",
    "blk.0.ffn_down.weight": "layers.0.mlp.w_down.weight",
}


def _dequantizable() -> list:
    out = []
    for t in gguf.GGMLQuantizationType:
        block, size = gguf.GGML_QUANT_SIZES[t]
        if 256 % block:
            continue
        try:
            gguf.quants.dequantize(np.zeros((1, 256 // block * size), np.uint8), t)
        except NotImplementedError:
            continue
        out.append(t)
    return out


def _quantizable(t) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, 256), np.float32), t)
        return True
    except NotImplementedError:
        return False


TYPES = _dequantizable()


def test_the_types_the_issue_names_are_covered():
    names = {t.name for t in TYPES}
    assert {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16",
            "IQ2_XXS", "IQ4_NL", "IQ4_XS"} <= names


def write(path, qtype, seed=0) -> dict[str, np.ndarray]:
    """A one-layer Llama GGUF with every matrix in `qtype`; returns the stored blocks by GGUF name."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    add_tiny_vocab(w, VOCAB)
    stored = {}
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    for name, (rows, cols) in MATRICES.items():
        if _quantizable(qtype):
            data = gguf.quants.quantize((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), qtype)
        else:
            data = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
        if data.dtype == np.uint8:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:  # F32, F16 and BF16 come back as arrays of their own element type
            w.add_tensor(name, data, raw_dtype=qtype)
        stored[name] = data
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, np.ones(D, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_dequantizable_type_loads(tmp_path, qtype):
    stored = write(tmp_path / f"{qtype.name}.gguf", qtype)
    reader = gg.open_reader(tmp_path / f"{qtype.name}.gguf")
    cfg = gg.read_config(reader, "quant-test")
    sd = gg.read_weights(reader, cfg)
    norms = 3 * D if qtype.name == "F32" else 0  # the norm vectors are F32 in every file
    assert gg.tensor_stats(reader)["file_tensors"][qtype.name][1] == sum(r * c for r, c in MATRICES.values()) + norms
    for name, data in stored.items():
        ref = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype), np.float32).reshape(MATRICES[name]))
        assert_close(sd[ENGINE[name]], ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("qtype", [t for t in TYPES if _quantizable(t) and t.name != "F32"], ids=lambda t: t.name)
def test_quantized_model_runs(tmp_path, qtype):
    path = tmp_path / f"{qtype.name}.gguf"
    write(path, qtype)
    lm = load(path, device="cpu", dtype="float32", use_cache=False)
    assert lm.info.file_bits_per_weight[qtype.name] == 8 * gguf.GGML_QUANT_SIZES[qtype][1] / gguf.GGML_QUANT_SIZES[
        qtype][0]
    from engine.model.kv_cache import KVCache

    logits = lm.model(torch.tensor([[5, 7, 9]]), KVCache(lm.cfg, 1, 8, torch.float32))
    assert torch.isfinite(logits).all()

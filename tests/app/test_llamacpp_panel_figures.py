"""The KV cache, scheduling and roofline panels on a model that llama.cpp runs: their figures come from that runtime.

llama.cpp keeps its keys and values in float16 (its context's default type_k / type_v) whatever type the weights
have; the torch engine keeps them in the running dtype. So a panel that priced the cache at ModelInfo.dtype (the
weights') would show 4 bytes per value on an F32 file and 0.625 on a Q4_1 one. llama.cpp's own figure is the line
its context logs when it is made ("llama_kv_cache: size = 90.00 MiB (4096 cells, 30 layers, 1/1 seqs), K (f16):
…"), read here by installing a log callback of the test's own.
"""

from __future__ import annotations

import ctypes
import re

import pytest

from tests.requires import default_model, import_required

import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")

from engine.backends.llamacpp import LlamaCppSession, _llama  # noqa: E402
from engine.costs import formulas as costs  # noqa: E402
from engine.events import KVCacheGrew  # noqa: E402
from engine.protocol import Loaded  # noqa: E402
from engine.run.sampling import SamplingParams  # noqa: E402

KV_LINE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers.*K \((\w+)\).*V \((\w+)\)")


def load_logging(path, n_ctx: int) -> tuple[LlamaCppSession, list[str]]:
    """A llama.cpp session whose context's log lines are kept (the backend silences them otherwise)."""
    L = _llama()
    lines: list[str] = []
    keep = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(
        lambda level, text, data: lines.append(text.decode(errors="replace")))
    L.llama_log_set(keep, None)
    try:
        s = LlamaCppSession(path, n_ctx=n_ctx, threads=1)
    finally:
        L.llama_log_set(L._lab_log, None)
    return s, lines


def llama_cpp_kv(lines: list[str]) -> tuple[float, int, str]:
    """(bytes, cells, K type) of the KV cache llama.cpp says it allocated."""
    m = KV_LINE.search("".join(lines))
    assert m, "llama.cpp logged no KV cache size"
    assert m.group(4) == m.group(5)
    return float(m.group(1)) * 2**20, int(m.group(2)), m.group(4)


def show(qtbot, bridge, s: LlamaCppSession, module):
    bridge.replay(Loaded(s.info, s.tokenizer, s.cfg, runtime="llama.cpp"))
    panel = module.PANEL(bridge)
    qtbot.addWidget(panel)
    panel.resize(500, 350)
    panel.show()
    return panel


def check_kv_panels(qtbot, bridge, s: LlamaCppSession, lines: list[str]) -> None:
    from app.panels import kv_cache, scheduling

    size, cells, k_type = llama_cpp_kv(lines)
    kv = {"f16": "float16", "f32": "float32", "bf16": "bfloat16"}[k_type]
    per_token = s.info.kv_bytes_per_token
    assert per_token == pytest.approx(size / cells, abs=0.005 * 2**20 / cells)  # the log rounds to 0.01 MiB
    panel = show(qtbot, bridge, s, kv_cache)
    for ev in s.generate("The cat sat", SamplingParams.greedy_params(), 3, ignore_eos=True):
        if isinstance(ev, KVCacheGrew):
            bridge.replay(ev)
            assert ev.bytes_used == per_token * ev.n_tokens
    panel.flush()
    text = panel.formula.text()
    assert f"{per_token:,.0f} bytes" in text and f"· {costs.bytes_per_value(kv):g} B ({kv})" in text
    assert f"{per_token:,.0f} bytes" in panel.model_help(s.cfg, s.info)
    assert f"{kv} KV cache" in show(qtbot, bridge, s, scheduling).model_help(s.cfg, s.info)
    assert s.kv_dtype == kv  # what the runtime's step costs price the cache at


def test_the_kv_panel_prices_the_cache_llama_cpp_made_on_an_f32_file(qtbot, bridge, tiny_dir):
    s, lines = load_logging(tiny_dir.gguf, 256)
    try:
        assert s.info.dtype == "float32"  # the weights: 4 bytes a value; the cache: 2
        check_kv_panels(qtbot, bridge, s, lines)
    finally:
        s.close()


@pytest.mark.slow
def test_kv_and_roofline_on_the_default_models_q4_1_file(qtbot, bridge):
    from app.panels import roofline

    s, lines = load_logging(default_model(), 512)
    try:
        assert s.info.file_type == "Q4_1"
        check_kv_panels(qtbot, bridge, s, lines)
        panel = show(qtbot, bridge, s, roofline)
        assert panel.dtype() == "q4_1"  # the file's type, not the fp32 the box opened on
        decode = panel.analytic_costs()["decode"]
        # the bytes llama.cpp's kernels read: the file's own blocks (Q4_1 layers, its Q8_0 table), as its steps report
        assert decode.weight_bytes == pytest.approx(s.info.decode_weight_bytes_file)
        assert decode.weight_bytes != pytest.approx(costs.step_weight_bytes(s.cfg, "fp32", 1))
    finally:
        s.close()


def test_a_sliding_window_model_on_llama_cpp_keeps_every_position(qtbot, bridge, tmp_path):
    """llama.cpp's cache is full size in local layers too (swa_full): the panel's bytes are per token × tokens, and
    it says so instead of the torch engine's window arithmetic."""
    from app.panels import kv_cache
    from tests.requires import import_required as need
    from tests.tiny_families import write_checkpoint

    need("transformers", name="transformers")
    s = LlamaCppSession(write_checkpoint(tmp_path, "gemma3").gguf, n_ctx=256, threads=1)
    try:
        assert s.cfg.n_local_layers and s.cfg.sliding_window < 12
        panel = show(qtbot, bridge, s, kv_cache)
        per_token = costs.kv_bytes_per_token(s.cfg, "float16")  # every layer, every position
        last = None
        for ev in s.generate("the cat sat on the mat and", SamplingParams.greedy_params(), 6, ignore_eos=True):
            if isinstance(ev, KVCacheGrew):
                bridge.replay(ev)
                last = ev
        assert last.n_tokens > s.cfg.sliding_window and last.bytes_used == per_token * last.n_tokens
        panel.flush()
        text = panel.formula.text()
        assert "llama.cpp keeps every position" in text and f"× {per_token:,.0f} B =" in text
        assert "more than the formula" not in text
    finally:
        s.close()

"""The app against a server: Connect, generate there, and the Load lab (a loopback stub server stands in here;
tests/remote/test_real_servers.py runs the app against a real vLLM)."""

from __future__ import annotations

import json
import threading
from http.server import ThreadingHTTPServer

import numpy as np
import pytest

from app.panels.load_lab import COLUMNS
from tests.remote.test_client_errors import Handler


@pytest.fixture
def stub():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.mode = "ok"
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_connect_generate_and_load_lab(qtbot, window, stub, tmp_path):
    window.connect_server(stub)
    qtbot.waitUntil(lambda: window.bridge.server is not None, timeout=30_000)
    assert window.server_label.isVisible() and "openai-compatible" in window.server_label.text()
    gen = window.panels["generation"]
    gen.set_text("hi")
    with qtbot.waitSignal(window.bridge.sig_finished, timeout=30_000) as blocker:
        assert gen.generate()
    assert blocker.args[0].text == "Hello there!"
    window.tick_panels(flush=True)
    assert "server" in window.panels["attention"].status.text()

    lab = window.panels["load_lab"]
    with qtbot.waitSignal(window.bridge.sig_serve_done, timeout=60_000):
        assert lab.run({"concurrency": [1, 2], "num_prompts": 3, "max_new_tokens": 4, "request_rate": None,
                        "burstiness": 1.0, "time_limit_s": 30.0})
    assert [r["concurrency"] for r in lab.runs] == [1, 2]
    assert all(r["completed"] == 3 and r["failed"] == 0 for r in lab.runs)
    lab.flush()
    x, y = lab.tput_curve.getData()
    np.testing.assert_allclose(y, [r["output_throughput"] for r in lab.runs])
    assert lab.table.rowCount() == 2 and lab.progress.value() == 1000
    lab.export(str(tmp_path / "runs.csv"))
    lab.export(str(tmp_path / "runs.json"))
    assert (tmp_path / "runs.csv").read_text().count("\n") == 3
    assert '"runs"' in (tmp_path / "runs.json").read_text()


def test_connect_failure_is_one_line_and_the_app_goes_on(qtbot, window):
    with qtbot.waitSignal(window.bridge.sig_server_failed, timeout=30_000) as blocker:
        window.connect_server("http://127.0.0.1:9")
    assert "connection refused" in blocker.args[0]
    assert window.bridge.server is None and "connection refused" in window.message.text()
    assert not window.panels["load_lab"].run_button.isEnabled()


def test_load_lab_cancel(qtbot, window, stub):
    window.connect_server(stub)
    qtbot.waitUntil(lambda: window.bridge.server is not None, timeout=30_000)
    lab = window.panels["load_lab"]
    done = []
    window.bridge.sig_serve_request.connect(done.append)
    # 400 requests at 5 a second: 80 s unless cancelled (the time limit is further still)
    with qtbot.waitSignal(window.bridge.sig_serve_done, timeout=300_000) as blocker:
        with qtbot.waitSignal(window.bridge.sig_serve_request, timeout=60_000):  # the run is under way
            assert lab.run({"concurrency": [1], "num_prompts": 400, "max_new_tokens": 4, "request_rate": 5.0,
                            "burstiness": 1.0, "time_limit_s": 240.0})
        lab.cancel()
    window.bridge.sig_serve_request.disconnect(done.append)
    assert blocker.args[0].outcome == "cancelled" and lab.outcome == "cancelled" and not lab.running
    assert 1 <= len(done) < 400


def test_load_lab_plots_live_per_request_and_sends_slos(qtbot, window, stub):
    """Before a level's row arrives, its point is drawn from the requests finished so far; the SLO fields reach the
    bench (goodput). Reference: the figures recomputed here from the streamed RequestResults with numpy."""
    window.connect_server(stub)
    qtbot.waitUntil(lambda: window.bridge.server is not None, timeout=30_000)
    lab = window.panels["load_lab"]
    lab.levels_edit.setText("2")
    lab.prompts_spin.setValue(4)
    lab.tokens_spin.setValue(4)
    lab.slo_spins["tpot"].setValue(0.001)  # no request streams a token per microsecond: goodput 0
    lab.slo_spins["ttft"].setValue(60_000)
    cfg = lab.config()
    assert cfg["slo_ms"] == {"tpot": 0.001, "ttft": 60_000.0}
    seen = []

    def on_request(_r):  # connected after the panel's slot, so the panel already holds this request
        if not lab.runs:
            lab.flush()
            seen.append((list(lab.level_requests), lab.tput_live.getData(), (lab.lat_curves["p99_tpot_ms"].xData,
                                                                         lab.lat_curves["p99_tpot_ms"].yData)))

    window.bridge.sig_serve_request.connect(on_request)
    with qtbot.waitSignal(window.bridge.sig_serve_done, timeout=60_000):
        assert lab.run(cfg)
    window.bridge.sig_serve_request.disconnect(on_request)
    assert len(seen) == 4
    for reqs, (lx, ly), (cx, cy) in seen:
        ok = [r for r in reqs if r.ok]
        assert ok, "the stub serves every request"
        tokens = sum(r.output_tokens for r in ok)
        duration = max(r.start_s + r.e2el_s for r in ok)
        tpot = np.mean([(r.e2el_s - r.ttft_s) / (r.output_tokens - 1) for r in ok])
        np.testing.assert_allclose(ly, [tokens / duration], rtol=1e-9)
        np.testing.assert_allclose(lx, [1 / tpot], rtol=1e-9)
        assert list(cx) == [2.0]  # the live level on the latency plot (data before the log axis)
        np.testing.assert_allclose(cy, [max(np.percentile([(r.e2el_s - r.ttft_s) / (r.output_tokens - 1)
                                                            for r in ok], 99) * 1e3, 1e-3)], rtol=1e-9)
    assert [len(s[0]) for s in seen] == [1, 2, 3, 4]
    (run,) = lab.runs
    assert run["goodput"] == 0.0 and run["completed"] == 4
    lab.flush()
    assert lab.tput_live.getData()[0] is None or len(lab.tput_live.getData()[0]) == 0
    assert lab.table.item(0, COLUMNS.index("goodput")).text() == "0.00"


def test_roofline_places_the_servers_measured_decode(qtbot, window, stub):
    """The stub's model has no readable config: one line says so; with a catalogue model chosen the measured decode
    is placed at that model's decode intensity and the rate the chunks arrived at (references: the model's FLOPs and
    bytes counted here by hand from its shapes, the tokens' arrival times rather than the gaps the panel sums, and
    the chip's datasheet roofs). The chip picked for a server is remembered for its URL."""
    roof = window.panels["roofline"]
    window.connect_server(stub)
    qtbot.waitUntil(lambda: window.bridge.server is not None, timeout=30_000)
    assert window.bridge.server.config is None and "'m'" in window.bridge.server.config_note
    roof.select_hardware("h100-sxm")
    tokens = []
    window.bridge.sig_token.connect(tokens.append)
    gen = window.panels["generation"]
    gen.set_text("hi")
    with qtbot.waitSignal(window.bridge.sig_finished, timeout=30_000):
        assert gen.generate()
    window.tick_panels(flush=True)
    assert "Server decode not placed: the server's model shapes are unknown" in roof.takeaway.text()
    assert roof.server_point.getData()[0] is None or len(roof.server_point.getData()[0]) == 0

    roof.select_model("llama-2-70b")
    roof.flush()
    decode = [t for t in tokens if t.phase == "decode"]
    assert len(decode) == 2
    tpot = (decode[-1].arrival_s - tokens[0].arrival_s) / len(decode)
    # Llama-2-70B's last decode step by hand (config.json: 80 layers, d_model 8192, 64 query and 8 KV heads of 128,
    # FFN 28672, vocabulary 32000, untied head; 68,976,648,192 parameters as Hugging Face counts them), weights and
    # KV cache in the panel's dtype
    layers, d, heads, kv_heads, hd, ffn, vocab = 80, 8192, 64, 8, 128, 28672, 32000
    context = decode[-1].position + 1  # the token attends to every position up to its own
    bpv = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}[roof.dtype()]
    matrices = 2 * d * heads * hd + 2 * d * kv_heads * hd + 3 * d * ffn  # q and o, k and v, SwiGLU's three
    flops = 2 * layers * matrices + 4 * layers * heads * hd * context + 2 * vocab * d  # + QK and AV + LM head
    weights = (68_976_648_192 - vocab * d + d) * bpv  # every matrix once; of the input embedding one row
    kv = context * 2 * layers * kv_heads * hd * bpv  # K and V of context - 1 cached positions read, its own written
    x, y = roof.server_point.xData, roof.server_point.yData
    np.testing.assert_allclose(x, [flops / (weights + kv)], rtol=1e-9)
    np.testing.assert_allclose(y, [flops / tpot], rtol=1e-6)
    # NVIDIA's H100 SXM datasheet (dense): peak FLOP/s per dtype, 3.35 TB/s
    peak = {"fp32": 67e12, "fp16": 989.5e12, "bf16": 989.5e12, "int8": 1979e12}[roof.dtype()]
    share = flops / tpot / min(peak, flops / (weights + kv) * 3.35e12)
    label = roof.server_text.toPlainText()
    assert label.startswith("server decode") and (f"{share:.3g}× the roof: wrong chip or model?" in label
                                                   if share > 1 else "of roof" in label), label
    assert "llama-2-70b as chosen under Model" in roof.takeaway.text()

    roof.select_hardware("a100-80gb")
    chosen = roof.hw_combo.currentData()
    window.disconnect_server()
    qtbot.waitUntil(lambda: window.bridge.server is None, timeout=30_000)
    roof.select_hardware("this-machine")
    window.connect_server(stub)
    qtbot.waitUntil(lambda: window.bridge.server is not None, timeout=30_000)
    assert roof.hw_combo.currentData() == chosen != "this-machine"


def test_capacity_shows_the_servers_measured_tpot(qtbot, window, stub):
    """Capacity's 'TPOT measured' is the server's mean decode gap (reference: the tokens' arrival times), drawn at
    batch 1 next to the estimate, and each Load lab level adds its mean TPOT and system tok/s at its concurrency."""
    cap = window.panels["capacity"]
    window.tick_panels(flush=True)
    assert "Connect to server" in cap.values["measured"].text()
    window.connect_server(stub)
    qtbot.waitUntil(lambda: window.bridge.server is not None, timeout=30_000)
    tokens = []
    window.bridge.sig_token.connect(tokens.append)
    gen = window.panels["generation"]
    gen.set_text("hi")
    with qtbot.waitSignal(window.bridge.sig_finished, timeout=30_000):
        assert gen.generate()
    window.bridge.sig_token.disconnect(tokens.append)
    cap.flush()
    decode = [t for t in tokens if t.phase == "decode"]
    tpot_ms = (decode[-1].arrival_s - tokens[0].arrival_s) / len(decode) * 1e3
    assert f"{tpot_ms:,.2f} ms" in cap.values["measured"].text() and "batch 1" in cap.values["measured"].text()
    np.testing.assert_allclose(cap.measured_tpot.xData, [1.0])
    np.testing.assert_allclose(cap.measured_tpot.yData, [tpot_ms], rtol=1e-6)

    lab = window.panels["load_lab"]
    with qtbot.waitSignal(window.bridge.sig_serve_done, timeout=60_000):
        assert lab.run({"concurrency": [2], "num_prompts": 2, "max_new_tokens": 4, "request_rate": None,
                        "burstiness": 1.0, "time_limit_s": 30.0})
    cap.flush()
    (run,) = lab.runs
    np.testing.assert_allclose(cap.measured_tpot.xData, [1.0, 2.0])
    np.testing.assert_allclose(cap.measured_tpot.yData, [tpot_ms, run["mean_tpot_ms"]], rtol=1e-6)
    np.testing.assert_allclose(cap.measured_system.yData, [run["output_throughput"]])


def gpt2_byte_string(b: bytes) -> str:
    """GPT-2's bytes_to_unicode, written out here as the reference: printable bytes stand for themselves, the
    other 68 map to U+0100 onward in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, n = {}, 0
    for v in range(256):
        if v in keep:
            table[v] = chr(v)
        else:
            table[v], n = chr(256 + n), n + 1
    return "".join(table[v] for v in b)


class TokenizingHandler(Handler):
    """A vLLM-like stub: /v1/models says vLLM, /tokenize splits on spaces and returns vocabulary strings (Ġ for
    a leading space, as byte-level BPE writes it) with their ids; it records the texts asked for, and holds its
    answer for the text in `server.hold` until `server.release` is set."""

    def do_GET(self):  # noqa: N802
        if self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "m", "owned_by": "vllm"}]}).encode())
        else:
            super().do_GET()

    def do_POST(self):  # noqa: N802
        if self.path != "/tokenize":
            return super().do_POST()
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        if "prompt" not in body:  # a chat prompt's tokens: not offered by this stub
            return self._send(400, b'{"error": {"message": "no chat template"}}')
        self.server.tokenize_calls.append(body["prompt"])
        if body["prompt"] == self.server.hold:
            self.server.release.wait(120)
        words = body["prompt"].split(" ")
        strs = [gpt2_byte_string((" " if i else "").encode() + w.encode()) for i, w in enumerate(words)]
        self._send(200, json.dumps({"tokens": [100 + i for i in range(len(strs))], "token_strs": strs,
                                    "count": len(strs)}).encode())


@pytest.fixture
def tokenizing_stub():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), TokenizingHandler)
    srv.mode, srv.tokenize_calls, srv.hold, srv.release = "ok", [], None, threading.Event()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.release.set()
    srv.shutdown()
    srv.server_close()


def test_prompt_shows_the_servers_tokens(qtbot, window, tokenizing_stub, monkeypatch):
    """Connected, the Prompt panel's boundaries are the server's /tokenize answer (reference: the stub's own split),
    asked once for a burst of edits, labelled as the server's; an answer for an older text never replaces a newer
    one's. Nothing here depends on how fast the machine is: the burst runs without the event loop (the debounce
    timer cannot fire inside it) and the stub holds the older answer until the newer text has been asked for."""
    srv = tokenizing_stub
    prompt = window.panels["prompt"]
    asked = []  # the texts the panel sent to the engine process, in order
    send = window.bridge.server_tokenize

    def server_tokenize(text: str, chat: bool = False) -> int:
        asked.append(text)
        return send(text, chat)

    monkeypatch.setattr(window.bridge, "server_tokenize", server_tokenize)
    window.connect_server(f"http://127.0.0.1:{srv.server_address[1]}")
    qtbot.waitUntil(lambda: window.bridge.server is not None, timeout=30_000)
    assert window.bridge.server.tokenize == "/tokenize"
    qtbot.waitUntil(lambda: prompt.tok is not None, timeout=30_000)  # the text already there, now the server's
    assert asked == srv.tokenize_calls == [prompt.text()]
    asked.clear()
    srv.tokenize_calls.clear()

    srv.hold = "the cat"
    prompt.set_text("the cat")
    qtbot.waitUntil(lambda: srv.tokenize_calls == ["the cat"], timeout=30_000)  # its answer is held back
    answers = []  # (text answered, the panel's ids right after that answer): connected after the panel's slot
    window.bridge.sig_server_tokens.connect(lambda a: answers.append((a.text, prompt.tok and prompt.tok.ids)))
    for text in ("the cat sat", "héllo the cat sat"):
        prompt.set_text(text)  # a burst of edits within the debounce
    assert prompt.tok is None and "asking the server" in prompt.counters.text()
    qtbot.waitUntil(lambda: len(asked) == 2, timeout=30_000)
    assert asked == ["the cat", "héllo the cat sat"]  # debounced: the burst's last text only
    srv.release.set()  # the stale answer arrives first, then the newest
    qtbot.waitUntil(lambda: len(answers) == 2, timeout=30_000)
    assert answers == [("the cat", None), ("héllo the cat sat", [100, 101, 102, 103])]
    assert srv.tokenize_calls == ["the cat", "héllo the cat sat"]
    assert prompt.tok.ids == [100, 101, 102, 103]
    assert prompt.tok.pieces == ["héllo", " the", " cat", " sat"]  # Ġ read back as a space
    assert prompt.tok.offsets == [(0, 5), (5, 9), (9, 13), (13, 17)]
    assert prompt.tok.byte_offsets == [(0, 6), (6, 10), (10, 14), (14, 18)]  # é is two bytes
    assert "server's own tokenizer" in prompt.source_label.text() and prompt.source_label.isVisibleTo(prompt)
    assert "<b>4 tokens</b>" in prompt.counters.text()

    window.disconnect_server()  # the local tokenizer's boundaries again, without the server's label
    qtbot.waitUntil(lambda: window.bridge.server is None, timeout=30_000)
    assert prompt.tok.ids == window.bridge.tokenizer.encode("héllo the cat sat").ids
    assert not prompt.source_label.isVisibleTo(prompt)


def test_prompt_falls_back_when_the_server_cannot_tokenize(qtbot, window, stub):
    prompt = window.panels["prompt"]
    window.connect_server(stub)
    qtbot.waitUntil(lambda: window.bridge.server is not None, timeout=30_000)
    prompt.set_text("the cat")
    assert prompt.tok is not None and prompt.tok.ids == window.bridge.tokenizer.encode("the cat").ids
    line = prompt.source_label.text()
    assert "has no tokenize endpoint" in line and "local model's tokenizer" in line and "\n" not in line

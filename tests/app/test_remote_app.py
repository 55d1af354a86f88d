"""The app against a server: Connect, generate there, and the Load lab (a loopback stub server stands in here;
tests/remote/test_real_servers.py runs the app against a real vLLM)."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer

import numpy as np
import pytest

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
    with qtbot.waitSignal(window.bridge.sig_serve_done, timeout=60_000) as blocker:
        lab.run({"concurrency": [1], "num_prompts": 400, "max_new_tokens": 4, "request_rate": 5.0,
                 "burstiness": 1.0, "time_limit_s": 60.0})
        qtbot.wait(300)
        lab.cancel()
    assert blocker.args[0] == "cancelled" and not lab.running

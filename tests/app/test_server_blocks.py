"""The Server KV blocks panel: a Load-lab run with 'KV events' on subscribes the engine process to a publisher on
loopback (a plain ZeroMQ one here, sending vLLM's message shape; tests/remote/test_kvevents.py holds the subscriber
to vLLM's own publisher), and the panel draws the blocks its events stored, coloured by sharing, beside /metrics'
KV usage of the same scrape. The reference: the chains written by hand below."""

from __future__ import annotations

import threading
import time
from http.server import ThreadingHTTPServer

import msgpack
import numpy as np
import zmq

from app.panels.server_blocks import EMPTY, EMPTY_GAP, SHARED, SINGLE
from engine.remote.launch import free_port
from tests.remote.test_timeline import Stub


class MetricsStub(Stub):
    def do_GET(self):  # noqa: N802
        if self.path != "/metrics":
            return super().do_GET()
        body = b"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.25\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def stored(hashes, parent):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": [0] * (16 * len(hashes)), "block_size": 16}


def test_the_servers_blocks_are_drawn_by_sharing(qtbot, window):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), MetricsStub)
    srv.count, srv.lock = 0, threading.Lock()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = free_port()
    stop = threading.Event()

    def publish():  # connects once the engine process has bound the port, then sends one batch, again and again
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.connect(f"tcp://127.0.0.1:{port}")
        batch = msgpack.packb([time.time(), [stored([1, 2], None), stored([3], 2), stored([4], 2), stored([7], None)]])
        seq = 0
        while not stop.wait(0.2):
            pub.send_multipart([b"", seq.to_bytes(8, "big"), batch])
            seq += 1
        pub.close(0)
        ctx.term()

    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    try:
        window.connect_server(f"http://127.0.0.1:{srv.server_address[1]}")
        qtbot.waitUntil(lambda: window.bridge.server is not None, timeout=30_000)
        lab, panel = window.panels["load_lab"], window.panels["server_blocks"]
        lab.kv_check.setChecked(True)
        lab.kv_port.setValue(port)
        cfg = {**lab.config(), "concurrency": [1], "num_prompts": 6, "max_new_tokens": 5, "request_rate": 3.0}
        assert cfg["kv_events_port"] == port
        got = []
        window.bridge.sig_serve_blocks.connect(got.append)
        with qtbot.waitSignal(window.bridge.sig_serve_done, timeout=60_000):
            assert lab.run(cfg)
        last = next(n for n in reversed(got) if n.blocks.n_blocks == 5)
        panel._on_blocks(last)
        panel.flush()
        # by hand: chain order 1 2 3 4 | 7; sequences through them: 2 2 1 1 | 1
        assert last.blocks.sharers.tolist() == [2, 2, 1, 1, 1] and last.kv_usage == 0.25
        cells = panel.grid.reshape(-1, 3)
        assert [tuple(c) for c in cells[:5]] == [SHARED, SHARED, SINGLE, SINGLE, SINGLE]
        assert np.all(cells[5:] == EMPTY) and panel.grid.shape == (1, 8, 3)  # one short row: 5 blocks, 3 empty
        img = panel.image.image  # on the screen: each cell 6 × 6 pixels, its last row and column the gap
        assert img.shape == (6, 48, 3) and tuple(img[2, 6 * 2 + 2]) == SINGLE and tuple(img[5, 2]) == EMPTY_GAP
        text = panel.status_label.text()
        assert text.startswith("5 blocks of 16 tokens cached, 2 of them a prefix two or more sequences share")
        assert "/metrics KV usage 25.0%" in text
    finally:
        stop.set()
        publisher.join(5)
        srv.shutdown()
        srv.server_close()

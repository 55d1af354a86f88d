"""Serve this model: the engine process starts llama.cpp's server for the loaded model on 127.0.0.1, connects to
it, generates there, and stops it on Disconnect (nothing listens on its port afterwards)."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import pytest

from engine import protocol as P
from engine.events import Finished, RunStarted
from engine.protocol import GenerateRequest, SamplingParams
from engine.remote.launch import LLAMA_PY
from tests.engine.test_server import Client

pytestmark = [pytest.mark.slow, pytest.mark.server]


def test_serve_the_loaded_model_then_stop_it():
    if not LLAMA_PY.exists():
        pytest.skip(f"llama-cpp-python's virtual environment is missing ({LLAMA_PY}): run `make servers`")
    c = Client()  # the engine server in a thread, as the app drives it

    def until(pred, timeout: float = 240) -> object:
        return c.until(pred, timeout)[-1]

    try:
        c.send(P.Load(None, "cpu", "float32"))
        assert isinstance(until(lambda m: isinstance(m, (P.Loaded, P.LoadFailed))), P.Loaded)
        c.send(P.ServeModel())
        connected = until(lambda m: isinstance(m, (P.Connected, P.Done)))
        assert isinstance(connected, P.Connected), connected
        assert until(lambda m: isinstance(m, P.Done)) == P.Done("serve_model", "")
        host = urlsplit(connected.info.url)
        assert host.hostname == "127.0.0.1" and connected.info.kind == "llama-cpp-python"
        assert any(isinstance(m, P.Progress) and m.job == "serve_model" for m in c.seen)
        c.send(P.Generate(GenerateRequest("The capital of France is", chat=False, max_new_tokens=4,
                                                 params=SamplingParams.greedy_params())))
        fin = until(lambda m: isinstance(m, Finished))
        assert len(fin.ids) >= 1
        assert next(m for m in c.seen if isinstance(m, RunStarted)).source.kind == "server"
        c.send(P.Disconnect())
        until(lambda m: isinstance(m, P.Disconnected))
        c.send(P.Ping(1))
        until(lambda m: isinstance(m, P.Pong))
        with pytest.raises(OSError), socket.create_connection((host.hostname, host.port), timeout=5):
            pass  # the server is gone: nothing accepts on its port
    finally:
        c.send(P.Quit())
        c.thread.join(30)
    assert not c.thread.is_alive()

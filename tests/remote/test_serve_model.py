"""Serve this model: the engine process starts llama.cpp's server for the loaded model on 127.0.0.1, connects to
it, generates there, and stops it on Disconnect (nothing listens on its port afterwards)."""

from __future__ import annotations

import multiprocessing
import socket
import threading
from urllib.parse import urlsplit

import pytest

from engine import protocol as P
from engine.events import Finished, RunStarted
from engine.protocol import GenerateRequest, SamplingParams
from engine.remote.launch import LLAMA_PY
from engine.server import serve

pytestmark = [pytest.mark.slow, pytest.mark.server]


def test_serve_the_loaded_model_then_stop_it():
    if not LLAMA_PY.exists():
        pytest.skip(f"llama-cpp-python's virtual environment is missing ({LLAMA_PY}): run `make servers`")
    cmd_recv, commands = multiprocessing.Pipe(duplex=False)
    events, events_send = multiprocessing.Pipe(duplex=False)
    engine = threading.Thread(target=serve, args=(cmd_recv, events_send), daemon=True)
    engine.start()
    seen: list = []

    def until(pred, timeout: float = 240) -> object:
        while events.poll(timeout):
            got = events.recv()
            for m in got if isinstance(got, list) else [got]:
                seen.append(m)
                if pred(m):
                    return m
        raise AssertionError(f"no answer; last messages: {seen[-3:]}")

    try:
        commands.send(P.Load(None, "cpu", "float32"))
        assert isinstance(until(lambda m: isinstance(m, (P.Loaded, P.LoadFailed))), P.Loaded)
        commands.send(P.ServeModel())
        connected = until(lambda m: isinstance(m, (P.Connected, P.Done)))
        assert isinstance(connected, P.Connected), connected
        assert until(lambda m: isinstance(m, P.Done)) == P.Done("serve_model", "")
        host = urlsplit(connected.info.url)
        assert host.hostname == "127.0.0.1" and connected.info.kind == "llama-cpp-python"
        assert any(isinstance(m, P.Progress) and m.job == "serve_model" for m in seen)
        commands.send(P.Generate(GenerateRequest("The capital of France is", chat=False, max_new_tokens=4,
                                                 params=SamplingParams.greedy_params())))
        fin = until(lambda m: isinstance(m, Finished))
        assert len(fin.ids) >= 1
        assert next(m for m in seen if isinstance(m, RunStarted)).source.kind == "server"
        commands.send(P.Disconnect())
        until(lambda m: isinstance(m, P.Disconnected))
        commands.send(P.Ping(1))
        until(lambda m: isinstance(m, P.Pong))
        with pytest.raises(OSError), socket.create_connection((host.hostname, host.port), timeout=5):
            pass  # the server is gone: nothing accepts on its port
    finally:
        commands.send(P.Quit())
        engine.join(30)
    assert not engine.is_alive()

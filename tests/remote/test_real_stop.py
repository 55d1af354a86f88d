"""stop() from another thread against real servers on loopback: the generation ends as "stopped" with the tokens that
arrived, and the server, whose request was cancelled by the closed connection, serves the next one."""

from __future__ import annotations

import threading

import pytest

from tests.remote.conftest import API_KEY

pytestmark = [pytest.mark.slow, pytest.mark.server]


@pytest.mark.parametrize("which", ["vllm_server", "llama_server"])
def test_stop_mid_stream_from_another_thread(request, which):
    from engine.remote.backend import RemoteBackend
    from engine.run.sampling import SamplingParams

    server = request.getfixturevalue(which)
    b = RemoteBackend(server.url, api_key=API_KEY if which == "vllm_server" else None)
    b.probe()
    greedy = SamplingParams(temperature=0.0)
    # llama-cpp-python ignores ignore_eos: a chat answer to this prompt runs long enough to be stopped
    gen = b.generate("Tell me a long story about a dragon.", greedy, 400, chat=which == "llama_server",
                     ignore_eos=True)
    events: list = []
    streaming, done = threading.Event(), threading.Event()

    def work():
        for ev in gen:
            events.append(ev)
            if type(ev).__name__ == "RemoteTokenSampled" and ev.step >= 3:
                streaming.set()
        done.set()
        streaming.set()

    threading.Thread(target=work, daemon=True).start()
    assert streaming.wait(240) and not done.is_set(), events[-1:]
    gen.stop()  # as the engine's command thread does
    assert done.wait(60), "stop() did not end the generation"
    fin = events[-1]
    assert type(fin).__name__ == "Finished" and fin.reason == "stopped", fin
    assert 4 <= len(fin.ids) < 400
    after = list(b.generate("The capital of France is", greedy, 4, ignore_eos=True))
    assert type(after[-1]).__name__ == "Finished" and after[-1].reason == "length" and len(after[-1].ids) == 4

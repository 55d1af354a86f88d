"""Parsing the chunk streams real servers sent (recorded once by tests/remote/record_streams.py, committed).

The reference in each stream is the server's own bookkeeping: its final usage chunk counts the completion tokens,
`token_ids` name them, and the chunks' text is what it generated.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.remote.metrics import parse_prometheus, server_metrics
from engine.remote.sse import StreamFormatError, parse_chunk, sse_data

STREAMS = Path(__file__).parent / "streams"
RECORDED = sorted(STREAMS.glob("*.sse"))


def chunks_of(path: Path):
    data = list(sse_data(path.read_bytes().splitlines(keepends=True)))
    assert data[-1] == "[DONE]"
    return [parse_chunk(d) for d in data[:-1]]


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_every_recorded_stream_counts_like_the_server(path):
    chunks = chunks_of(path)
    usage = [c.usage for c in chunks if c.usage]
    if path.stem.startswith("vllm"):
        assert len(usage) == 1  # stream_options include_usage: one final usage chunk
        n = usage[0]["completion_tokens"]
    else:
        assert usage == []  # llama-cpp-python ignores include_usage: the recorder's max_tokens=6, all used
        n = 6
    tokens = [t for c in chunks for t in c.tokens]
    assert len(tokens) == n
    assert "".join(t.text for t in tokens) == "".join(c.text for c in chunks)
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]


def test_vllm_chat_several_tokens_in_one_chunk():
    chunks = chunks_of(STREAMS / "vllm-chat.sse")
    multi = [c for c in chunks if len(c.tokens) > 1]
    assert multi, "the recording holds a chunk with two tokens"
    c = multi[0]
    assert "".join(t.text for t in c.tokens) == c.text
    assert all(t.id is not None and t.raw == t.text.encode() and len(t.top) == 3 for t in c.tokens)
    assert chunks[0].prompt_token_ids[:2] == (1, 9690)  # <|im_start|>system: vLLM applied the chat template
    for t in c.tokens:
        assert t.top[0].logprob >= t.top[1].logprob >= t.top[2].logprob
        assert t.logprob == max(x.logprob for x in t.top)  # greedy: the sampled token is the top-1


def test_vllm_token_ids_everywhere():
    """return_tokens_as_token_ids names the top-N by id; token_ids and the plain stream agree on the text."""
    with_ids = [t for c in chunks_of(STREAMS / "vllm-ids.sse") for t in c.tokens]
    plain = [t for c in chunks_of(STREAMS / "vllm-completions.sse") for t in c.tokens]
    assert [t.id for t in with_ids] == [t.id for t in plain] and None not in [t.id for t in with_ids]
    assert all(all(x.id is not None for x in t.top) for t in with_ids)
    assert [t.top[0].id for t in with_ids] == [t.id for t in with_ids]  # greedy
    assert [t.logprob for t in with_ids] == [t.logprob for t in plain]
    assert [t.text for t in with_ids] == [t.text for t in plain]


def test_vllm_chat_ids_never_show_token_id_strings():
    """vLLM 0.32 sends the bytes of "token_id:N" for the chat top-N with return_tokens_as_token_ids: not taken."""
    chunks = chunks_of(STREAMS / "vllm-chat-ids.sse")
    plain = [t for c in chunks_of(STREAMS / "vllm-chat.sse") for t in c.tokens]
    toks = [t for c in chunks for t in c.tokens]
    assert b"token_id" in (STREAMS / "vllm-chat-ids.sse").read_bytes()
    assert [t.id for t in toks] == [t.id for t in plain]
    assert [[x.id for x in t.top] for t in toks][0][0] == toks[0].id
    assert all(x.raw is None or not x.raw.startswith(b"token_id") for t in toks for x in t.top)
    assert [t.raw for t in toks] == [t.raw for t in plain]  # the sampled token's own bytes are right


def test_llamacpp_formats_name_no_ids():
    """llama-cpp-python reports tokens as text only: ids stay unknown (None), never guessed."""
    chat = [t for c in chunks_of(STREAMS / "llamacpp-chat.sse") for t in c.tokens]
    legacy = [t for c in chunks_of(STREAMS / "llamacpp-completions.sse") for t in c.tokens]
    assert all(t.id is None and len(t.top) == 3 for t in chat + legacy)
    assert [t.text for t in legacy][:3] == [" ", "2", "0"]  # digits one by one, as in the vLLM recording
    for t in chat + legacy:
        assert t.logprob == pytest.approx(t.top[0].logprob)  # greedy: the sampled token is the top-1


def test_vllm_metrics_recording():
    m = server_metrics(parse_prometheus((STREAMS / "vllm-metrics.txt").read_text()))
    assert m.kv_usage == 0.0 and m.running == 0.0 and m.waiting == 0.0
    assert m.mean_ttft_s is not None and 0 < m.mean_ttft_s < 60
    assert m.prefix_hit_rate is not None and 0 <= m.prefix_hit_rate <= 1


def test_sse_framing_and_bad_chunks():
    raw = [b": keep-alive\n", b"data: {\"choices\": []}\n", b"\n", b"data: a\n", b"data: b\n", b"\n", b"data: [DONE]"]
    assert list(sse_data(raw)) == ['{"choices": []}', "a\nb", "[DONE]"]
    with pytest.raises(StreamFormatError, match="not JSON"):
        parse_chunk("<html>")
    with pytest.raises(StreamFormatError, match="without 'choices'"):
        parse_chunk('{"object": "x"}')
    with pytest.raises(StreamFormatError, match="out of memory"):
        parse_chunk('{"error": {"message": "out of memory"}}')

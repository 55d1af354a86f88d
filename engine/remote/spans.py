"""A server's own account of one request, from its OpenTelemetry span (vLLM's `llm_request`, `gen_ai.*` attributes).

vLLM (v1 engine, output_processor.do_tracing) starts the span at the request's arrival in the engine (wall clock) and
sets, in seconds: gen_ai.latency.time_in_queue = scheduled − queued; time_in_model_prefill = first token − scheduled;
time_in_model_decode = last token − first token; time_to_first_token = first token − arrival; e2e = the iteration
that finished it − arrival; and gen_ai.request.id, the id of the engine request: the completion's id with the
prompt's index appended ("cmpl-…-0").
"""

from __future__ import annotations

from dataclasses import dataclass

# attribute -> ServerSpan field; the latencies in seconds, the counts in tokens
LATENCIES = {
    "gen_ai.latency.time_to_first_token": "ttft_s",
    "gen_ai.latency.e2e": "e2el_s",
    "gen_ai.latency.time_in_queue": "queue_s",
    "gen_ai.latency.time_in_model_prefill": "prefill_s",
    "gen_ai.latency.time_in_model_decode": "decode_s",
}
COUNTS = {"gen_ai.usage.prompt_tokens": "prompt_tokens", "gen_ai.usage.completion_tokens": "completion_tokens"}
REQUEST_ID = "gen_ai.request.id"


@dataclass(frozen=True)
class ServerSpan:
    """One request as the server timed it. Latencies in seconds (None: the span did not say); `start_wall_s` is its
    arrival on the wall clock (s since the epoch), the span's start."""

    request_id: str
    start_wall_s: float
    end_wall_s: float
    name: str = ""
    ttft_s: float | None = None
    e2el_s: float | None = None
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def matches(span_id: str, response_id: str) -> bool:
    """A span's request id names this response: vLLM appends the prompt's index to the completion's id."""
    if not span_id or not response_id:
        return False
    return span_id == response_id or (span_id.startswith(response_id + "-")
                                      and span_id[len(response_id) + 1:].isdigit())

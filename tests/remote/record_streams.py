"""Record small SSE streams from a real server for the fast parsing tests (run by hand, results committed).

    python -m tests.remote.record_streams URL KIND [API_KEY]

writes tests/remote/streams/KIND-{chat,completions,plain[,ids]}.sse: the raw bytes of the response bodies.
"""

from __future__ import annotations

import http.client
import json
import sys
from pathlib import Path
from urllib.parse import urlsplit

OUT = Path(__file__).parent / "streams"


def record(url: str, kind: str, api_key: str | None = None) -> list[Path]:
    u = urlsplit(url)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("GET", "/v1/models", headers=headers)
    model = json.loads(conn.getresponse().read())["data"][0]["id"]
    extra = {"return_token_ids": True} if kind == "vllm" else {}
    base = {"model": model, "max_tokens": 6, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    bodies = {
        "chat": base | extra | {"messages": [{"role": "user", "content": "Count: 1, 2, 3"}], "logprobs": True,
                                "top_logprobs": 3},
        "completions": base | extra | {"prompt": "The year 2024 was", "logprobs": 3},
        "plain": base | {"prompt": "Hello, my name is"},
    }
    if kind == "vllm":  # what engine.remote asks vLLM for: ids for the top-N too
        bodies["ids"] = base | extra | {"prompt": "The year 2024 was", "logprobs": 3,
                                        "return_tokens_as_token_ids": True}
        bodies["chat-ids"] = bodies["chat"] | {"return_tokens_as_token_ids": True}
    paths = []
    for name, body in bodies.items():
        path = "/v1/chat/completions" if name.startswith("chat") else "/v1/completions"
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        r = conn.getresponse()
        data = r.read()
        assert r.status == 200, (name, r.status, data[:200])
        p = OUT / f"{kind}-{name}.sse"
        p.write_bytes(data)
        paths.append(p)
    return paths


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for p in record(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None):
        print(p, p.stat().st_size)

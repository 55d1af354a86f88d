"""How closely the client's stream and vLLM's own spans agree on each request's first and last token.

`python -m benchmarks.spans [--levels 1,2,1] [--requests 6] [--tokens 16]`: starts vLLM (CPU build, the default model
exported, `--otlp-traces-endpoint` at an OTLP receiver on loopback), runs one small load run per level on the same
server, and prints per request how long after vLLM's timestamp of its first and last token (span arrival + its TTFT,
arrival + its E2EL) the client saw them, and when vLLM's engine saw the request after it was sent. Stops the server.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> int:
    from engine.cli.export_hf import export
    from engine.remote import launch, loadlab, timeline
    from engine.remote.backend import RemoteBackend
    from engine.remote.otlp import SpanReceiver

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levels", default="1,2,1", help="concurrency of each run, in order")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--tokens", type=int, default=16)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, SpanReceiver() as rx:
        hf = export(None, Path(tmp) / "hf")
        server = launch.start_vllm(hf, Path(tmp), otlp_endpoint=rx.endpoint)
        try:
            b = RemoteBackend(server.url)
            b.probe()
            print("| concurrency | first token, ms | last token, ms | engine saw it after, ms |")
            print("| --- | --- | --- | --- |")
            for c in (int(x) for x in a.levels.split(",")):
                got: list = []
                loadlab.run_once(b, c, a.requests, a.tokens, spans=rx, span_wait_s=20, on_spans=got.extend,
                                 time_limit_s=300)
                gaps = [(r, timeline.delivery(r)) for r in got]
                gaps = [(r, g) for r, g in gaps if g is not None]
                first = ", ".join(f"{g[0] * 1e3:.2f}" for _, g in gaps)
                last = ", ".join(f"{g[1] * 1e3:.2f}" for _, g in gaps)
                seen = ", ".join(f"{(r.server.start_wall_s - r.sent_wall_s) * 1e3:.2f}" for r, _ in gaps)
                print(f"| {c} | {first} | {last} | {seen} |", flush=True)
            if rx.problems():
                print("span receiver: " + "; ".join(rx.problems()))
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

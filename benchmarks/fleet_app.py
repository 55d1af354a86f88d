"""The fleet in the app: two vLLM replicas of the default model and a round-robin and a cache-aware vllm-router in
front of them, all on loopback; the Fleet panel watches a config naming each replica's spans port, and the Load lab
('shared prefixes') drives each router in turn. Prints what the panel shows as JSON; everything started is stopped.

    QT_QPA_PLATFORM=offscreen python -m benchmarks.fleet_app [--num-prompts 64] [--screenshot fleet.png]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def _wait(app, pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:.0f} s")
        app.processEvents()
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fleet_app")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--screenshot", default=None, help="save the Fleet panel here (PNG)")
    a = p.parse_args(argv)

    from PySide6 import QtWidgets

    from app.main_window import MainWindow
    from engine.cli.export_hf import export
    from engine.remote import fleet as fl
    from engine.remote import launch

    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(sys.argv[:1])
    servers, routers = [], []
    with tempfile.TemporaryDirectory(prefix="fleet-app-") as tmp:
        logs = Path(tmp)
        hf = export(None, logs / "hf")
        ports = [launch.free_port(), launch.free_port()]
        win = MainWindow(None, persist=False, load=False, interactive=False)  # the servers need no local model
        win.show()
        try:
            for port in ports:
                servers.append(launch.start_vllm(hf, logs, otlp_endpoint=f"http://127.0.0.1:{port}/v1/traces"))
            for policy in ("round_robin", "cache_aware"):
                routers.append((policy, fl.start_router([s.url for s in servers], policy, logs)))
            cfg = logs / "fleet.json"
            cfg.write_text(json.dumps({"router": routers[0][1].url, "replicas": [
                {"url": s.url, "name": f"replica {i + 1}", "spans_port": port}
                for i, (s, port) in enumerate(zip(servers, ports, strict=True))]}))
            panel, lab = win.panels["fleet"], win.panels["load_lab"]
            panel.source.setText(str(cfg))
            panel.watch()
            lab.shared_check.setChecked(True)
            for _, router in routers:
                done = []
                win.bridge.sig_serve_done.connect(done.append)
                win.connect_server(router.url)
                _wait(app, lambda r=router: win.bridge.server is not None and win.bridge.server.url == r.url, 120,
                      "connecting to the router")
                config = {**lab.config(), "concurrency": [a.concurrency], "num_prompts": a.num_prompts,
                          "max_new_tokens": a.max_new_tokens}
                if not lab.run(config):
                    raise RuntimeError(lab.status)
                _wait(app, lambda d=done: bool(d), 900, "the Load lab's run")
                win.bridge.sig_serve_done.disconnect(done.append)
            n = a.num_prompts * len(routers)
            _wait(app, lambda: sum(1 for r in panel.requests if panel.served.get(f"{r.request_id}-0")) >= n, 30,
                  "every request's span")
            settle = time.monotonic() + 2.0  # another scrape or two: the replicas' counters after the last request
            _wait(app, lambda: time.monotonic() > settle, 10, "")
            panel.flush()
            policy_of = {r.url: policy for policy, r in routers}
            out = {"replicas": [dict(zip(("name", "waiting", "running", "kv_use", "prefix_hits", "tokens_per_s",
                                          "done", "served_here"), row, strict=True)) for row in panel.rows()],
                   "routers": [dict(zip(("router", "completed", "ttft_p50_ms", "served_by"), row, strict=True),
                                    policy=policy_of.get(row[0], "")) for row in panel.router_rows()],
                   "summary": panel.summary()}
            if a.screenshot:
                panel.resize(900, 700)
                panel.grab().save(a.screenshot)
            print(json.dumps(out, indent=1))
        finally:
            win.bridge.watch_fleet("")
            for _, r in routers:
                r.stop()
            for s in servers:
                s.stop()
            win.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

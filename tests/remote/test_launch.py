"""engine.remote.launch without a real server: thread binding, what a vLLM log says, stopping a process group."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

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

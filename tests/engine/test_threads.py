"""engine.model.threads: the decode thread count follows what the steps show (simulated machine, real controller)."""

import pytest
import torch

from engine.model import threads as th


class FakeMeter:
    """Other processes' CPU use as the simulated machine sets it."""

    def __init__(self) -> None:
        self.others = 0.0

    def others_cores(self) -> float:
        return self.others

    def elapsed(self) -> float:
        return 1.0

    def restart(self) -> None:
        pass


@pytest.fixture()
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def controller(max_threads: int = 2) -> tuple[th.AdaptiveThreads, FakeMeter]:
    c = th.AdaptiveThreads("auto", max_threads=max_threads)
    c.max = max_threads  # the test machine may have fewer cores; the policy is what is tested
    c.current = max_threads
    meter = FakeMeter()
    c._meter = meter
    return c, meter


def run(c: th.AdaptiveThreads, steps: int, per_thread_count: dict[int, float]) -> list[int]:
    """Drive `steps` decode steps whose seconds per byte depend on the thread count; return the counts used."""
    used = []
    for _ in range(steps):
        n = c.begin_step()
        assert torch.get_num_threads() == n
        used.append(n)
        c.end_step(per_thread_count[n] * 1000.0, 1000.0)
    return used


QUIET = {2: 1.0, 1: 1.9}  # two threads 1.9 × faster, as measured on a quiet 2-core machine
ONE_BUSY_CORE = {2: 3.8, 1: 2.0}  # a `yes` loop: every parallel region waits for a descheduled thread


def test_quiet_machine_keeps_all_threads(restore_threads):
    c, meter = controller()
    used = run(c, 600, QUIET)
    assert used[-1] == 2
    assert used.count(1) <= 2 + 2 * (600 // th.REFRESH)  # the first probe and the periodic refreshes only
    assert used.count(1) >= 2  # it did measure one thread (else it could not know)


def test_one_slow_step_on_a_quiet_machine_is_jitter_two_are_load(restore_threads):
    c, meter = controller()
    run(c, 50, QUIET)
    assert c.current == 2
    jitter = {2: 1.2 * QUIET[1], 1: QUIET[1]}  # a many-thread step at 1.2 × one thread's time (seen: 32.8 vs 29 ms)
    assert run(c, 1, jitter) == [2] and c.current == 2  # one such step: keep all threads
    assert run(c, 1, QUIET) == [2] and c.current == 2
    run(c, 2, jitter)  # two in a row: one thread
    assert c.current == 1


def test_busy_core_moves_to_one_thread_and_stays(restore_threads):
    c, meter = controller()
    meter.others = 1.0  # another process holds a core
    used = run(c, 300, ONE_BUSY_CORE)
    assert used[-1] == 1
    assert used.count(2) <= 2  # at most the first step and one try


def test_load_arriving_mid_run_is_answered_in_one_step(restore_threads):
    c, meter = controller()
    run(c, 50, QUIET)
    assert c.current == 2
    meter.others = 1.0
    used = run(c, 100, ONE_BUSY_CORE)
    assert used[1:].count(2) == 0  # one slow step, then one thread; never back while the core stays busy


def test_load_leaving_brings_all_threads_back(restore_threads):
    c, meter = controller()
    meter.others = 1.0
    run(c, 100, ONE_BUSY_CORE)
    assert c.current == 1
    meter.others = 0.05
    used = run(c, 200, QUIET)
    back = used.index(2)
    assert back <= th.BACKOFF_MIN + 1  # the last try held for many steps, so the wait is short
    assert used[back:].count(1) <= 2  # and it stays (one refresh probe at most)


def test_failed_tries_back_off(restore_threads):
    c, meter = controller()
    meter.others = 1.0
    run(c, 20, ONE_BUSY_CORE)
    meter.others = 0.0  # the meter says idle, but the steps say otherwise (e.g. a competitor between ticks)
    used = run(c, 400, ONE_BUSY_CORE)
    tries = sum(1 for a, b in zip(used, used[1:], strict=False) if a == 1 and b == 2)
    assert 3 <= tries <= 8  # waits of 4, 8, 16, … steps: log2(400) tries, not one every few steps


def test_fixed_count_is_set_once_and_kept(restore_threads):
    c = th.AdaptiveThreads(1)
    assert torch.get_num_threads() == 1 and not c.auto
    for _ in range(20):
        assert c.begin_step() == 1
        c.end_step(10.0, 1.0)
    assert c.switches == 0


@pytest.mark.parametrize("bad", [0, -2, "two", 1.5, True])
def test_bad_setting_is_refused(bad):
    with pytest.raises(ValueError, match="threads"):
        th.AdaptiveThreads(bad)


def test_cpu_meter_counts_a_busy_process():
    """A child that burns 0.5 s of CPU time is someone else's CPU time, not ours: the meter's cores times its window
    hold at least those 0.5 s, however long the child took to get them on a busy machine (others only add)."""
    import subprocess
    import sys
    import time

    t0 = time.perf_counter()
    meter = th.CpuMeter()
    subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 0.5: pass"], check=True)
    others = meter.others_cores()
    window = time.perf_counter() - t0  # at least the meter's own window, so others × window ≥ its CPU seconds
    assert others is not None and others * window >= 0.5 - 0.05  # /proc/stat counts in clock ticks (10 ms)


def test_a_later_session_still_has_all_threads(restore_threads, monkeypatch):
    """torch's count is process-wide: one session ending on one thread must not cap the next one at one."""
    monkeypatch.setattr(th, "_CONFIGURED", [2])  # the process started with two threads
    c, meter = controller()
    meter.others = 1.0
    run(c, 50, ONE_BUSY_CORE)
    assert c.current == 1 and torch.get_num_threads() == 1
    later = th.AdaptiveThreads("auto")
    assert later.max == min(2, th.available_cores())

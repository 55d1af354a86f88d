"""benchmarks.load: its competitors really load the machine and really stop; its ratios say what they claim."""

import time

from benchmarks.load import Competitor, ratios


def test_busy_competitor_uses_a_core_and_stops():
    comp = Competitor("busy", limit=120)
    try:
        c0 = comp.cpu_s()
        deadline = time.monotonic() + 60  # a `yes` loop burns CPU: on a loaded machine it may take a while to get it
        while comp.cpu_s() - c0 < 0.1 and time.monotonic() < deadline:
            time.sleep(0.05)
        used = comp.cpu_s() - c0
    finally:
        comp.stop()
    assert used >= 0.1
    assert comp.proc.poll() is not None  # and it is gone


def test_ratios_compare_auto_with_the_same_conditions_fixed_counts():
    out = {"dtype": "float32", "also": "bfloat16", "conditions": {
        "quiet": {"tpot_s": {"1": 0.030, "2": 0.015, "auto": 0.0156, "bfloat16:1": 0.018, "bfloat16:auto": 0.009}},
        "busy": {"tpot_s": {"1": 0.032, "2": 0.060, "auto": 0.033, "bfloat16:1": 0.02, "bfloat16:auto": 0.02}},
    }}
    r = ratios(out, 2)
    assert abs(r["quiet: auto / all threads (target ≤ 1.05)"] - 1.04) < 1e-9
    assert abs(r["busy: auto / quiet 1 thread (target ≤ 1.15)"] - 1.1) < 1e-9
    assert abs(r["busy: auto / best fixed count, same condition"] - 0.033 / 0.032) < 1e-9
    assert abs(r["quiet: bfloat16 / float32 at auto thread(s)"] - 0.009 / 0.0156) < 1e-9

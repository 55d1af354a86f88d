"""Timeline on a long run: at most BARS_PER_PIXEL bars per pixel of the plot, each as tall as the longest step it
stands for, so painting it does not cost more the longer the run (and a stall stays visible)."""

from __future__ import annotations

import numpy as np

from app.panels.timeline import bars_for


def test_bars_for_groups_neighbours_and_keeps_the_longest_step():
    rng = np.random.default_rng(0)
    steps = np.arange(8000, dtype=float)
    secs = rng.random(8000) * 0.1
    secs[4321] = 3.0  # a stall
    x, h, w = bars_for(steps, secs, 1000)
    assert len(x) <= 1000 and len(x) == len(h) == len(w)
    k = 8  # 8,000 steps in at most 1,000 bars
    for i in range(len(x)):  # the reference: each group of k neighbours, by hand
        group = secs[i * k: (i + 1) * k]
        assert h[i] == max(group)
        assert x[i] - w[i] / 2 <= i * k and x[i] + w[i] / 2 >= min(8000, (i + 1) * k) - 1
    assert h.max() == 3.0
    x2, h2, w2 = bars_for(steps[:900], secs[:900], 1000)  # fewer steps than bars: one bar a step, as before
    np.testing.assert_array_equal(x2, steps[:900])
    np.testing.assert_array_equal(h2, secs[:900])
    assert w2 == 0.8


def test_an_uneven_last_group():
    steps = np.arange(10, dtype=float)
    secs = np.arange(10, dtype=float)
    x, h, w = bars_for(steps, secs, 4)  # 3 steps a bar: 0-2, 3-5, 6-8, 9
    np.testing.assert_array_equal(h, [2, 5, 8, 9])
    np.testing.assert_array_equal(x, [1, 4, 7, 9])

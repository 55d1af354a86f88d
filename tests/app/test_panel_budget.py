"""The shared draw timer's rate limit: a panel's redraws follow what its drawing costs (Panel.paint_budget)."""

import time

from app.panels import base
from app.panels.base import Panel


class Costly(Panel):
    cost_s = 0.0

    def draw(self) -> None:
        time.sleep(self.cost_s)


def _draws_in(panel, seconds: float) -> int:
    end = time.monotonic() + seconds
    before = panel.draw_count
    while time.monotonic() < end:
        panel.mark_dirty()  # new data arrives all the time, as during a generation
        panel.tick()
        time.sleep(0.005)
    return panel.draw_count - before


def test_costly_panel_redraws_less_often_but_at_least_once_a_second(qtbot, bridge):
    cheap, costly = Costly(bridge), Costly(bridge)
    qtbot.addWidget(cheap)
    qtbot.addWidget(costly)
    costly.cost_s = 0.06  # 60 ms a frame: 2 % of a core allows one every 3 s, the floor makes it 1 s
    n_cheap, n_costly = _draws_in(cheap, 1.2), _draws_in(costly, 2.6)
    assert 5 <= n_cheap <= 11  # capped by max_fps (8 a second)
    assert 2 <= n_costly <= 3  # about once a second (the first draw comes at once); without the floor: 1
    assert costly.paint_budget == base.Panel.paint_budget and base.MAX_DRAW_INTERVAL_S == 1.0


def test_flush_draws_at_once_whatever_the_limit(qtbot, bridge):
    p = Costly(bridge)
    qtbot.addWidget(p)
    p.mark_dirty()
    p.tick()
    p.mark_dirty()
    p.tick()  # too soon: stays dirty
    assert p.draw_count == 1
    p.flush()
    assert p.draw_count == 2

"""The shared draw timer's rate limit: a panel's redraws follow what its drawing costs (Panel.paint_budget).

The panel reads its clock through base.time.monotonic; the tests give it a clock that advances only when a frame
costs time or the test lets time pass, so the counts are the rule's own and no busy machine can change them.
"""

import types

import pytest

from app.panels import base
from app.panels.base import Panel


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(base, "time", types.SimpleNamespace(monotonic=c.monotonic))
    return c


class Costly(Panel):
    cost_s = 0.0
    clock: Clock

    def draw(self) -> None:
        self.clock.now += self.cost_s  # drawing takes this long on the panel's clock


def panel(qtbot, bridge, clock, cost_s: float) -> Costly:
    p = Costly(bridge)
    p.clock, p.cost_s = clock, cost_s
    qtbot.addWidget(p)
    p.show()  # the timer's tick draws only a panel on screen
    qtbot.waitExposed(p)
    return p


def draws_in(p: Costly, seconds: float, tick_s: float = 0.001, paint_s: float = 0.0) -> int:
    """Ticks every `tick_s` for `seconds` of the panel's clock, with new data before each (as during a generation);
    the window's paint after each draw takes `paint_s`, charged to the panel as the window does.
    A draw comes at the first tick after its interval, so the tests end their windows mid-interval."""
    end = p.clock.now + seconds
    before = p.draw_count
    while p.clock.now < end:
        p.mark_dirty()
        p.tick()
        if p.paint_due:
            p.clock.now += paint_s
            p.charge_paint(paint_s)
        p.clock.now += tick_s
    return p.draw_count - before


def test_cheap_panel_is_capped_by_max_fps(qtbot, bridge, clock):
    cheap = panel(qtbot, bridge, clock, 0.001)
    assert Panel.max_fps == 8.0
    # a 1 ms frame would allow 20 a second by the budget (2 % of a core); max_fps caps it at one per 0.125 s
    assert draws_in(cheap, 15.5 * 0.125) == 16


def test_costly_panel_redraws_less_often_but_at_least_once_a_second(qtbot, bridge, clock):
    assert Panel.paint_budget == 0.02 and base.MAX_DRAW_INTERVAL_S == 1.0
    medium = panel(qtbot, bridge, clock, 0.005)  # 5 ms / 2 % = one frame per 0.25 s
    assert draws_in(medium, 7.5 * 0.25) == 8
    costly = panel(qtbot, bridge, clock, 0.06)  # 60 ms: 2 % of a core allows one every 3 s, the floor makes it 1 s
    assert draws_in(costly, 5.5) == 6  # without the floor: 2


def test_the_paint_after_a_draw_counts_toward_the_panels_budget(qtbot, bridge, clock):
    """A draw that only sets data is cheap; the window's paint that follows is what costs. 1 ms of draw and 4 ms of
    paint: 5 ms a frame at 2 % of a core is one frame per 0.25 s, not max_fps's one per 0.125 s."""
    p = panel(qtbot, bridge, clock, 0.001)
    assert draws_in(p, 7.5 * 0.25, paint_s=0.004) == 8  # uncharged: 15


def test_the_window_charges_its_paint_to_the_panels_that_drew(qtbot, make_window, clock, monkeypatch):
    """The window's paint (Qt's UpdateRequest) is charged to the panels that drew since the last paint, in equal
    shares, and to no other: 10 ms after two cheap draws is 5 ms each, one frame per 0.25 s at 2 % of a core instead
    of max_fps's 0.125 s; 60 ms after one draw makes that panel wait a second (3 s at 2 %, the floor makes it 1 s).
    Both clocks are the test's (the panels' base.time.monotonic, the window's main_window.time.perf_counter), so the
    figures are the rule's own whatever the machine's load."""
    import types

    from PySide6 import QtCore, QtWidgets

    from app import main_window

    w = make_window(load=False)
    timeline, kv, roofline = w.panels["timeline"], w.panels["kv_cache"], w.panels["roofline"]
    window_clock = types.SimpleNamespace(now=100.0, readings=[])
    monkeypatch.setattr(main_window, "time", types.SimpleNamespace(
        perf_counter=lambda: window_clock.readings.pop(0) if window_clock.readings else window_clock.now))

    def paint_of_the_window(seconds: float) -> None:
        """Qt's paint of the window, which takes `seconds` on the window's clock (its start and end readings)."""
        window_clock.readings = [window_clock.now, window_clock.now + seconds]
        QtWidgets.QApplication.sendEvent(w, QtCore.QEvent(QtCore.QEvent.Type.UpdateRequest))
        assert not window_clock.readings  # the paint read the clock at its start and its end
        window_clock.now += seconds

    for p in w.panels.values():
        p.paint_due = False
    paint_of_the_window(0.0)  # nothing drawn: whatever was due before the test is painted
    roofline_next = roofline._next_draw
    for p in (timeline, kv):
        p.mark_dirty()
        p.flush()  # a draw that takes no time on the panels' clock
        assert p.paint_due and p._next_draw == pytest.approx(clock.now + 1 / Panel.max_fps)  # alone it is cheap
    assert not roofline.paint_due
    paint_of_the_window(0.010)
    for p in (timeline, kv):
        assert not p.paint_due
        assert p._next_draw == pytest.approx(p._drawn_at + 0.005 / Panel.paint_budget)  # 0.25 s: its 5 ms share
    assert roofline._next_draw == roofline_next  # it did not draw: none of the paint is its

    clock.now += 1.0
    timeline.mark_dirty()
    timeline.flush()
    paint_of_the_window(0.060)
    assert not timeline.paint_due
    assert timeline._next_draw == pytest.approx(timeline._drawn_at + base.MAX_DRAW_INTERVAL_S)
    assert kv._next_draw == pytest.approx(kv._drawn_at + 0.25)  # drew before the last paint: charged once only


def test_flush_draws_at_once_whatever_the_limit(qtbot, bridge, clock):
    p = panel(qtbot, bridge, clock, 0.06)
    p.mark_dirty()
    p.tick()
    p.mark_dirty()
    p.tick()  # too soon: stays dirty
    assert p.draw_count == 1
    p.flush()
    assert p.draw_count == 2


def test_while_generating_the_window_draws_within_the_guis_share(qtbot, make_window):
    """During a generation, drawing and painting that already took more than the GUI's share of the last second
    hold the draw timer back (the engine keeps its cores); idle, or within the share, panels draw."""
    import time

    from app import main_window

    w = make_window(load=False)
    timeline = w.panels["timeline"]
    budget = main_window.GENERATING_GUI_SHARE * max(1, main_window._cores() - 1) * main_window.GATE_WINDOW_S
    w._on_state("generating")
    w._gui_busy.append((time.perf_counter(), budget * 1.5))  # a paint that used more than the share
    timeline.mark_dirty()
    before = timeline.draw_count
    w.tick_panels()
    assert timeline.draw_count == before and timeline._dirty  # held back, the data kept for a later tick
    w._on_state("idle")  # the run ended: the window draws at once
    for _ in range(len(w.panels)):
        w.tick_panels()
    assert timeline.draw_count == before + 1


def test_while_generating_the_panels_redraw_at_most_at_the_set_rate(qtbot, make_window, monkeypatch):
    """However cheap a draw, the panels together redraw at most GENERATING_REDRAWS_PER_S times a second while the
    engine generates (a cheaper draw leaves the engine its core); idle, every tick may draw."""
    import types

    from app import main_window

    now = [1000.0]
    monkeypatch.setattr(main_window, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(main_window.MainWindow, "_over_budget", lambda self: False)  # the CPU share: another test
    w = make_window(load=False)
    panels = [p for p in w.panels.values() if p.on_screen()]
    assert len(panels) >= 4
    w._on_state("generating")

    def draws_in(seconds: float, ticks: int) -> int:
        before = sum(p.draw_count for p in w.panels.values())
        for _ in range(ticks):
            for p in panels:
                p.mark_dirty()
                p._next_draw = 0.0  # each panel's own rate limit: not what is tested here
            w.tick_panels()
            now[0] += seconds / ticks
        return sum(p.draw_count for p in w.panels.values()) - before

    rate = main_window.GENERATING_REDRAWS_PER_S
    n = draws_in(2.0, 60)  # the draw timer's 30 ticks a second, for two seconds
    assert 2 * rate - 1 <= n <= 2 * rate + main_window.REDRAW_BURST
    w._on_state("idle")
    assert draws_in(1.0, 30) == 30  # idle: one panel a tick

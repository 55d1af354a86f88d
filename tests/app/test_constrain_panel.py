"""Constrain output panel: the next generation matches the regex; the sampling panel shows the grammar's stage."""

from __future__ import annotations

import re

from tests.app.test_sessions import generate


def test_a_regex_from_the_panel_shapes_the_next_generation(qtbot, window):
    panel = window.panels["constrain"]
    panel.set_constraint("regex", "[0-9]{3}")
    assert window.bridge.options.grammar == {"regex": "[0-9]{3}"}
    fin = generate(qtbot, window, n=10)
    assert re.fullmatch("[0-9]{3}", fin.text) and fin.reason == "eos"
    window.tick_panels(flush=True)
    assert "grammar kept" in window.panels["sampling"].summary.text()
    panel.set_constraint(None)
    assert window.bridge.options.grammar == {}


def test_a_bad_schema_is_refused_in_the_panel_and_a_bad_regex_by_the_engine(qtbot, window):
    panel = window.panels["constrain"]
    panel.set_constraint("json_schema", "[1, 2")
    assert window.bridge.options.grammar == {} and "Not a JSON schema" in panel.status.text()
    panel.set_constraint("regex", "(unclosed")
    with qtbot.waitSignal(window.bridge.sig_failed, timeout=30_000):
        window.panels["prompt"].set_text("the cat")
        assert window.panels["generation"].generate()
    assert "cannot be used" in panel.status.text()

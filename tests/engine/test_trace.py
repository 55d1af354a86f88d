"""Perfetto / Chrome trace export: valid trace-event JSON, one slice per prefill and decode step."""

import json

import pytest

from engine.events import PrefillDone, TokenSampled
from engine.run.sampling import SamplingParams
from engine.run.session import Session
from engine.run.trace import TraceRecorder, check_writable, trace_events
from tests.engine.test_cli import cli

PHASES = {"X": {"ts", "dur"}, "C": {"ts", "args"}, "M": {"args"}, "i": {"ts", "s"}}


def check_trace_format(d: dict) -> list[dict]:
    """The Trace Event Format's rules for the JSON object form; returns the complete ("X") events."""
    assert set(d) >= {"traceEvents"} and isinstance(d["traceEvents"], list)
    for e in d["traceEvents"]:
        assert e["ph"] in PHASES and isinstance(e["name"], str) and isinstance(e["pid"], int)
        assert isinstance(e["tid"], int) and PHASES[e["ph"]] <= set(e)
        if "ts" in e:
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
        if e["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in e["args"].values())  # counters are numbers
    return [e for e in d["traceEvents"] if e["ph"] == "X"]


def test_one_slice_per_step_in_order(tiny_lm):
    rec = TraceRecorder()
    events = []
    for ev in Session(tiny_lm).generate("the cat sat", SamplingParams.greedy_params(), 6, ignore_eos=True):
        rec.add(ev)
        events.append(ev)
    d = json.loads(json.dumps(rec.trace()))  # survives a JSON round trip
    slices = check_trace_format(d)
    steps = [e for e in events if isinstance(e, TokenSampled)]
    assert len(slices) == len(steps) == 6
    pre = next(e for e in events if isinstance(e, PrefillDone))
    assert slices[0]["name"] == f"prefill ({pre.n_tokens} tokens)" and slices[0]["cat"] == "prefill"
    assert [s["name"] for s in slices[1:]] == [f"decode {k}" for k in range(1, 6)]
    for s, t in zip(slices, steps, strict=True):
        assert s["dur"] == pytest.approx(t.seconds * 1e6) and s["args"]["token_id"] == t.token_id
    for a, b in zip(slices, slices[1:], strict=False):
        assert a["ts"] + a["dur"] <= b["ts"] + 1e-6  # steps never overlap
    assert sum(e["ph"] == "C" for e in d["traceEvents"]) == 6  # KV cache bytes after every step


def test_events_without_times_are_laid_end_to_end(tiny_lm):
    events = list(Session(tiny_lm).generate("hello", SamplingParams.greedy_params(), 3, ignore_eos=True))
    slices = check_trace_format(trace_events((None, e) for e in events))
    assert slices[0]["ts"] == 0 and slices[1]["ts"] == pytest.approx(slices[0]["dur"])


def test_unwritable_places_are_named(tmp_path):
    with pytest.raises(OSError, match="does not exist"):
        check_writable(tmp_path / "nope" / "t.json")
    with pytest.raises(OSError, match="folder"):
        check_writable(tmp_path)
    check_writable(tmp_path / "t.json")


@pytest.mark.slow
def test_cli_trace(tmp_path):
    out = tmp_path / "trace.json"
    r = cli("generate", "--prompt", "Hello", "--greedy", "--max-new-tokens", "4", "--ignore-eos", "--json",
            "--trace", str(out))
    assert r.returncode == 0, r.stderr
    assert len(check_trace_format(json.loads(out.read_text()))) == len(json.loads(r.stdout)["ids"]) == 4
    bad = cli("generate", "--prompt", "Hello", "--max-new-tokens", "2", "--trace", str(tmp_path / "no" / "t.json"))
    assert bad.returncode == 1 and "does not exist" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1

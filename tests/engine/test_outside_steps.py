"""The time a generation spends outside its timed steps (captures, the logit lens) is reported, so the timeline's
total and its TTFT + (n − 1)·TPOT formula never disagree silently."""

from engine.events import Finished
from engine.protocol import Capture, SamplingParams
from engine.run.session import Session


def _finished(lm, capture: Capture) -> Finished:
    events = list(Session(lm).generate("the cat sat", SamplingParams.greedy_params(), 6, capture, ignore_eos=True))
    return events[-1]


def test_the_lens_time_is_counted_outside_the_steps(tiny_lm):
    fin = _finished(tiny_lm, Capture(lens_top=5, residual_norms=True, prompt_scores=True))
    steps = fin.ttft_s + float(fin.step_seconds.sum())
    assert fin.outside_steps_s > 0
    # disjoint intervals of one clock: the steps and the time outside them never add up to more than the total
    assert steps + fin.outside_steps_s <= fin.total_s + 1e-6



def test_llamacpp_counts_the_same_time_outside_its_steps(tiny_dir):
    """The llama.cpp backend shares the torch engine's step bookkeeping: its captures and lens are counted too."""
    from tests.requires import import_required

    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    from engine.backends.llamacpp import LlamaCppSession

    s = LlamaCppSession(tiny_dir.gguf)
    try:
        events = list(s.generate("the cat sat", SamplingParams.greedy_params(), 6,
                                 Capture(lens_top=5, residual_norms=True, prompt_scores=True), ignore_eos=True))
    finally:
        s.close()
    fin = events[-1]
    assert isinstance(fin, Finished) and len(fin.ids) == 6
    assert fin.outside_steps_s > 0
    assert fin.ttft_s + float(fin.step_seconds.sum()) + fin.outside_steps_s <= fin.total_s + 1e-6

"""The tokenizer's speed is measured by the benchmark (never asserted in unit tests): the measurement itself works."""

from benchmarks.bench import tokenizer_timings


def test_tokenizer_timings_measure_a_2000_token_encode_and_a_cache_load(tiny_lm):
    t = tokenizer_timings(tiny_lm.tokenizer, repeats=3)
    assert 1500 < t["encode_tokens"] <= 2000
    assert t["encode_s"] > 0 and t["load_s"] > 0


def test_gemma3_tokenizer_timings_when_installed():
    from benchmarks.bench import gemma3_tokenizer_timings
    from engine.formats.locate import gemma3_path

    t = gemma3_tokenizer_timings()
    if gemma3_path(assemble=False) is None:
        assert t is None
    else:
        assert 1500 < t["encode_tokens"] <= 2000 and t["encode_s"] > 0 and t["load_s"] > 0

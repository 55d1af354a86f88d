"""The tokenizer's speed is measured by the benchmark (never asserted in unit tests): the measurement itself works."""

from engine.bench import tokenizer_timings


def test_tokenizer_timings_measure_a_2000_token_encode_and_a_cache_load(tiny_lm):
    t = tokenizer_timings(tiny_lm.tokenizer, repeats=3)
    assert 1500 < t["encode_tokens"] <= 2000
    assert t["encode_s"] > 0 and t["load_s"] > 0

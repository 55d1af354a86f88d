"""Batched decode: each sequence of a batch gets the same tokens as when decoded alone; the lab measures rows."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.labs.batching import bench_batch, generate_batch
from engine.run.session import Session


def _alone(lm, prompt: list[int], n: int) -> list[int]:
    """Greedy decode of one prompt on the model's single-sequence path (engine.model.kv_cache.KVCache)."""
    import torch

    from engine.model.kv_cache import KVCache

    cache = KVCache(lm.cfg, 1, len(prompt) + n, torch.float32)
    with torch.inference_mode():
        out = [int(lm.model(torch.tensor([prompt]), cache)[0].argmax())]
        for _ in range(n - 1):
            out.append(int(lm.model(torch.tensor([[out[-1]]]), cache)[0].argmax()))
    return out


def test_batched_greedy_equals_unbatched_exact_ids(tiny_lm):
    rng = np.random.default_rng(2)
    prompts = rng.integers(3, tiny_lm.cfg.vocab_size, size=(3, 6)).tolist()
    batched, _, _ = generate_batch(Session(tiny_lm), prompts, 5)
    for row, p in zip(batched, prompts, strict=True):
        assert row.tolist() == _alone(tiny_lm, p, 5)


def test_prompts_of_different_lengths_keep_their_own_positions(tiny_lm):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, tiny_lm.cfg.vocab_size, size=n).tolist() for n in (2, 9, 5)]
    batched, _, _ = generate_batch(Session(tiny_lm), prompts, 6)
    assert [row.tolist() for row in batched] == [_alone(tiny_lm, p, 6) for p in prompts]


def test_bench_rows_are_consistent(tiny_lm):
    rows = bench_batch(Session(tiny_lm), (1, 2, 4), prompt_tokens=8, new_tokens=5)
    assert [r.batch for r in rows] == [1, 2, 4]
    for r in rows:
        assert r.tokens_per_s_system == pytest.approx(r.batch * r.tokens_per_s_per_stream)
        assert r.tokens_per_s_per_stream == pytest.approx(1 / r.tpot_s)
    # the analytic intensity of a decode step rises with the batch (weights are read once per step)
    assert rows[0].intensity < rows[1].intensity < rows[2].intensity


def test_bench_stops_at_the_memory_limit(tiny_lm):
    rows = bench_batch(Session(tiny_lm), (1, 2, 64), prompt_tokens=8, new_tokens=3, memory_limit_bytes=50_000)
    assert [r.batch for r in rows] == [1, 2]


def test_bench_batch_cli_json(tiny_dir):
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "-m", "engine", "bench-batch", "--model", str(tiny_dir.gguf), "--batches", "1,2",
         "--prompt-tokens", "8", "--new-tokens", "4", "--json"],
        capture_output=True, text=True, cwd=root, env=dict(os.environ, PYTHONPATH=str(root)), timeout=120)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [x["batch"] for x in rows] == [1, 2] and all(x["tpot_s"] > 0 for x in rows)
    bad = subprocess.run([sys.executable, "-m", "engine", "bench-batch", "--batches", "1,x"], capture_output=True,
                         text=True, cwd=root, env=dict(os.environ, PYTHONPATH=str(root)), timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1

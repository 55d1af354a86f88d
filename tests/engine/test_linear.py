"""engine.model.transformer.linear, the CPU fast path, against F.linear in float64: every branch, 1 and 2 threads.

Branches: up to SPLIT_MAX_ROWS rows run the decode kernel chosen for the shape (engine.model.kernels; here each
candidate in turn, forced), more rows oneDNN's private fp32 op. The row-block split depends on the thread count (an
output that does not split evenly falls back), so each shape runs at 1 and at 2 threads.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.model import kernels
from engine.model.transformer import SPLIT_MAX_ROWS, linear

SHAPES = [  # (leading shape of x, in_features, out_features)
    ((1,), 64, 96),  # decode: one row
    ((1, 1), 576, 192),  # decode with a batch axis, SmolLM2's d_model
    ((SPLIT_MAX_ROWS,), 64, 96),  # the most rows the split takes
    ((SPLIT_MAX_ROWS + 1,), 64, 96),  # the fewest that go to oneDNN
    ((2, 41), 64, 96),  # a prefill of 41 tokens, batch 2
    ((3,), 13, 7),  # odd sizes: 7 outputs do not split over 2 threads
    ((1,), 33, 1),  # a single output
    ((5, 2), 17, 30),
]


@pytest.fixture(params=[None, *kernels.KERNELS], ids=lambda k: k or "measured")
def kernel(request):
    """The decode kernel linear runs: each candidate forced in turn, or whatever this process measured/chose."""
    with kernels.forced(request.param):
        yield request.param


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(("lead", "n_in", "n_out"), SHAPES)
def test_linear_equals_f_linear(threads, kernel, lead, n_in, n_out, bias):
    g = torch.Generator().manual_seed(n_in * 1000 + n_out)
    x = torch.randn(*lead, n_in, generator=g)
    w = torch.randn(n_out, n_in, generator=g) / math.sqrt(n_in)
    b = torch.randn(n_out, generator=g) if bias else None
    y = linear(x, w, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == (*lead, n_out) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_the_split_applies_where_the_output_divides_over_the_threads(threads):
    w = torch.zeros(96, 8)
    assert kernels.applicable("split", w, None, threads)
    assert kernels.applicable("split", torch.zeros(7, 8), None, threads) == (threads == 1)


def test_a_strided_input_gives_the_same_rows(threads, kernel):
    """A non-contiguous x (a slice of a larger activation, as x[:, -1] is) goes through every path correctly."""
    g = torch.Generator().manual_seed(1)
    big = torch.randn(3, 9, 64, generator=g)
    w = torch.randn(96, 64, generator=g)
    for x in (big[:, -1], big[0, ::2], big.transpose(0, 1)[2:4]):
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)

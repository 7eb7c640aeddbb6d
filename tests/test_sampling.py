"""The one warping function both sides use, and the inverse-CDF sampler."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.sampling import RowSampling, SamplingParams, sample_from, warp

logits_st = st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=2, max_size=40)


@settings(max_examples=60, deadline=None)
@given(logits=logits_st, t=st.floats(0.1, 3.0), k=st.integers(0, 45), top_p=st.floats(0.05, 1.0))
def test_warp_properties(logits, t, k, top_p):
    x = torch.tensor([logits])
    p = warp(x, torch.tensor([t]), torch.tensor([k]), torch.tensor([top_p]))[0]
    assert torch.isclose(p.sum(), torch.tensor(1.0), atol=1e-5)
    kept = p > 0
    assert int(kept.sum()) >= 1
    assert bool(kept[x[0].argmax()])  # the argmax always survives
    if k:
        assert int(kept.sum()) <= k or bool((x[0][kept] == x[0][kept].min()).sum() > 1)  # only ties exceed k
    # kept tokens are exactly the top ones, and keep their relative temperature-scaled weights
    assert bool(x[0][kept].min() >= x[0][~kept].max()) if bool((~kept).any()) else True
    ref = (x[0][kept] / t).softmax(-1)
    torch.testing.assert_close(p[kept], ref, atol=1e-5, rtol=1e-4)
    # top-p: the kept set without its smallest members (ties kept together) has mass < top_p
    full = (x[0] / t).softmax(-1)
    if k == 0 and bool((~kept).any()):
        boundary = kept & (x[0] == x[0][kept].min())
        assert float(full[kept & ~boundary].sum()) < top_p + 1e-5


def test_temperature_zero_is_one_hot_argmax_first_on_ties():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    p = warp(x, torch.tensor([0.0]), torch.tensor([0]), torch.tensor([1.0]))
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_sample_from_never_returns_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(1000, 5)
    u = torch.linspace(0, 1 - 1e-12, 1000, dtype=torch.float64)
    x = sample_from(probs, u)
    assert set(x.tolist()) == {1, 3}
    assert sample_from(torch.tensor([[0.2, 0.8, 0.0]]), torch.tensor([1.0 - 1e-17], dtype=torch.float64)).item() == 1


def test_bad_sampling_params_fail_early():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(top_k=-2)


def test_rows_draw_from_their_own_seeded_generators():
    a = RowSampling([SamplingParams(temperature=1, seed=1), SamplingParams(temperature=1, seed=2)])
    b = RowSampling([SamplingParams(temperature=1, seed=2)])
    assert torch.equal(a.draft_uniform(3)[1], b.draft_uniform(3)[0])
    sub = a.select(torch.tensor([1]))
    assert sub.seeds == [2] and sub.temperature.tolist() == [1.0]

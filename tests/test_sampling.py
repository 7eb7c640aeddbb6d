"""The one warping function both sides use, and the inverse-CDF sampler."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.sampling import RowSampling, SamplingParams, argmax, sample_from, warp

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
    assert sub.params == [a.params[1]] and sub.temperature.tolist() == [1.0]
    assert torch.equal(sub.draft_uniform(2)[0], b.draft_uniform(2)[0])  # the generator is shared, not copied


def _draws(fn) -> int:
    """How many random-fill calls ``fn`` makes (each one kernel launch on a device)."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in {"uniform_", "exponential_", "rand", "randint", "normal_"}:
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.calls


def test_unseeded_rows_draw_together_and_only_seeded_rows_loop():
    from specdec.types import DraftProposal

    proposal = DraftProposal.chain(torch.zeros(4, 3, dtype=torch.long))
    free = RowSampling([SamplingParams(temperature=1.0)] * 4)
    assert _draws(lambda: free.verify_noise(proposal, 11)) == 2  # noise and uniforms, one call each for all rows
    assert _draws(lambda: free.draft_uniform(3)) == 1
    mixed = RowSampling([SamplingParams(temperature=1.0, seed=s) for s in (1, 2)] + [SamplingParams(temperature=1.0)] * 2)
    assert _draws(lambda: mixed.verify_noise(proposal, 11)) == 2 + 2 * 2
    assert _draws(lambda: RowSampling([SamplingParams()] * 4).verify_noise(proposal, 11)) == 0  # all greedy
    u, noise = free.verify_noise(proposal, 11)
    assert len({tuple(r) for r in u.tolist()}) == 4 and bool((noise > 0).all())


def test_a_seeded_rows_numbers_depend_on_its_seed_and_step_only():
    """Alone or in a batch, with a block of 3 nodes or of 5 (a batch pads to its widest row), a
    seeded row draws the same uniforms for its nodes and the same noise, step after step; a
    greedy row's noise is 1."""
    from specdec.types import DraftProposal

    alone = RowSampling([SamplingParams(temperature=1.0, seed=7)])
    batch = RowSampling([SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, seed=7), SamplingParams()])
    for _ in range(3):
        u1, n1 = alone.verify_noise(DraftProposal.chain(torch.zeros(1, 3, dtype=torch.long)), 13)
        u3, n3 = batch.verify_noise(DraftProposal.chain(torch.zeros(3, 5, dtype=torch.long)), 13)
        assert torch.equal(u3[1, :3], u1[0]) and torch.equal(n3[1], n1[0])
        assert n3[2].tolist() == [1.0] * 13
    later, _ = alone.verify_noise(DraftProposal.chain(torch.zeros(1, 3, dtype=torch.long)), 13)
    assert not torch.equal(later, u1)  # a new step, new numbers


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.integers(-2, 2), min_size=1, max_size=300), rows=st.integers(1, 3))
def test_argmax_takes_the_first_index_on_ties(values, rows):
    """The verifiers' argmax (torch's max(dim)) against Tensor.argmax, on rows full of ties."""
    x = torch.tensor(values, dtype=torch.float32).roll(1).expand(rows, -1).clone()
    x[-1] = x[-1].flip(0)
    assert torch.equal(argmax(x), x.argmax(-1))
    first = [next(i for i, v in enumerate(r) if v == max(r)) for r in x.tolist()]
    assert argmax(x).tolist() == first


def test_joined_rows_keep_their_parameters_and_generators_and_refuse_mixed_keying():

    a = RowSampling([SamplingParams(), SamplingParams(temperature=0.5, seed=1)])
    b = RowSampling([SamplingParams(temperature=0.9, top_k=3, top_p=0.8, seed=2)])
    both = a.joined(b)
    assert both.batch == 3 and both.temperature.tolist() == pytest.approx([0.0, 0.5, 0.9])
    assert both.top_k.tolist() == [0, 0, 3] and both.greedy_rows.tolist() == [True, False, False]
    assert both._seeded[1] is a._seeded[1] and both._seeded[2] is b._seeded[0]  # a seeded row's stream continues
    b.key_by_position()
    with pytest.raises(ValueError, match="keyed"):
        a.joined(b)

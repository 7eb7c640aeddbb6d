"""The prefix scheduler in the core (specdec.scheduler): the schedule on padded and ragged blocks,
and ScheduledDrafter, which applies DSpark's rule to any chain drafter (here the planted one)."""

from __future__ import annotations

import pytest
import torch

from specdec.loop import Request, run
from specdec.scheduler import ScheduledDrafter, StepCosts, schedule, survival
from specdec.target import Target
from specdec.testing import RandomDrafter
from specdec.testing.planted import PlantedDrafter
from specdec.testing.tiny import tiny_model
from specdec.verifiers import GreedyVerifier

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]


def _costs(per_token: float, fixed: float = 1.0, draft: float = 0.05) -> StepCosts:
    tokens = [1, 8, 64, 512]
    return StepCosts(tokens, [fixed + per_token * n for n in tokens], [1, 64], [draft, draft])


def _theta(conf: torch.Tensor, lengths: list[int], costs: StepCosts, ragged: bool) -> float:
    a = survival(conf)
    tau = len(lengths) + sum(float(a[r, :n].sum()) for r, n in enumerate(lengths))
    tokens = sum(1 + n for n in lengths) if ragged else len(lengths) * (1 + max(lengths))
    return tau / (costs.verify(tokens) + costs.draft(len(lengths)))


def _first_decrease(conf: torch.Tensor, costs: StepCosts, ragged: bool) -> list[int]:
    """DSpark's Algorithm 1 as published: admit by survival while Θ does not decrease."""
    a, lengths = survival(conf), [0] * conf.shape[0]
    theta = _theta(conf, lengths, costs, ragged)
    for _, j, r in sorted((-float(a[r, j]), j, r) for r in range(conf.shape[0]) for j in range(conf.shape[1])):
        lengths[r] += 1
        new = _theta(conf, lengths, costs, ragged)
        if new < theta:
            lengths[r] -= 1
            break
        theta = new
    return lengths


def test_on_a_padded_block_every_row_drafts_when_a_whole_column_pays():
    """Rectangular pricing: the first draft of a column pays for the whole column. Stopping at the
    first decrease of Θ would never draft at batch 8; the best prefix drafts the best column count."""
    conf, costs = torch.full((8, 4), 0.8), _costs(per_token=0.1)
    lengths = schedule(conf, costs).tolist()
    assert _first_decrease(conf, costs, ragged=False) == [0] * 8
    best_uniform = max(range(5), key=lambda n: _theta(conf, [n] * 8, costs, False))
    assert best_uniform == 2 and lengths == [2] * 8


def test_on_a_ragged_block_it_is_algorithm_1():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        conf = torch.rand(5, 6, generator=gen) ** 0.3
        costs = _costs(per_token=float(torch.rand(1, generator=gen)) * 0.2)
        assert schedule(conf, costs, ragged=True).tolist() == _first_decrease(conf, costs, ragged=True)


def _target() -> Target:
    return Target(tiny_model("llama", vocab_size=64, init_scale=0.3, seed=0))


def _run(target, drafter, k=4):
    return run(target, drafter, GreedyVerifier(), [Request(p, 24) for p in PROMPTS], k=k, eos_token_ids=set())


@pytest.mark.parametrize("per_token, draft, expect", [(0.0, 0.0, "all"), (0.5, 0.0, "shorter"), (1.0, 1e3, "skips")])
def test_scheduled_planted_drafter_is_lossless_and_follows_the_costs(per_token, draft, expect):
    target = _target()
    ar = _run(target, None)
    planted = PlantedDrafter.create(target, p=0.8, seed=0)
    res = _run(target, ScheduledDrafter(planted, _costs(per_token, draft=draft)))
    assert [r.tokens for r in res.requests] == [r.tokens for r in ar.requests]
    steps = sum(r.metrics.steps for r in res.requests)
    verified = sum(r.metrics.drafted for r in res.requests)
    if expect == "all":  # free verification: the whole chain, every step
        assert verified == 4 * steps
    elif expect == "shorter":  # each drafted token costs half a step: fewer than k, but some
        assert 0 < verified < 4 * steps
    else:  # drafting never pays: most steps skipped, a probe now and then
        assert verified < steps


def test_the_scheduler_needs_chains_and_confidences():
    target = _target()
    tree = RandomDrafter.create(target, siblings="iid", branching=[2, 2])
    with pytest.raises(ValueError, match="draft_confidences"):
        ScheduledDrafter(tree, _costs(0.0))
    wrapped = ScheduledDrafter(tree, _costs(0.0), confidences=lambda state, p: torch.full(p.tokens.shape, 0.5))
    with pytest.raises(ValueError, match="shortens chains"):
        _run(target, wrapped, k=2)

"""The prefix scheduler as a draft-length policy (specdec.policy.PrefixPolicy): the schedule on
padded and ragged blocks, the policy on any chain drafter that reports a confidence (the planted
one), and DSpark's and the planted drafter's scheduled runs token for token against a reference.

``tests/data/prefix_schedule.json`` is that reference: per scenario below (the padded and ragged
trade-offs, a shared budget, skipped draft passes with their re-probes, greedy and sampled
decoding), the tokens, steps, drafted and accepted counts of every request, recorded from a
scheduler written apart from this policy (inside DSpark and a drafter wrapper), so the policy is
checked against an independent implementation, not against itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec.loop import Request, run
from specdec.policy import PrefixPolicy, StepCosts, make_policy, schedule, survival
from specdec.registry import DRAFTERS
from specdec.sampling import SamplingParams
from specdec.target import Target
from specdec.testing import RandomDrafter, Recording
from specdec.testing.planted import PlantedDrafter
from specdec.testing.tiny import tiny_model
from specdec.verifiers import GreedyVerifier, RejectionVerifier

RECORDED = json.loads((Path(__file__).parent / "data" / "prefix_schedule.json").read_text())
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [20, 3, 7]]
LIN = StepCosts.linear

# name -> (DSpark's scheduler options, temperature)
DSPARK = {
    "tradeoff_ragged_greedy": (dict(costs=LIN(1e-4, 1.0, 0.05), ragged=True), 0.0),
    "tradeoff_padded_sampled": (dict(costs=LIN(0.02, 1.0, 0.05)), 1.0),
    "budget_ragged_sampled": (dict(costs=LIN(1e-5, 1.0, 0.05), budget=7, ragged=True), 1.0),
    "skips_greedy": (dict(costs=LIN(1.0, 4.0, 1e3)), 0.0),
    "skips_sampled_probe3": (dict(costs=LIN(0.3, 1.0, 0.6), probe_every=3), 0.8),
}


def _table(per_token: float, fixed: float = 1.0, draft: float = 0.05) -> StepCosts:
    tokens = [1, 8, 64, 512]
    return StepCosts(tokens, [fixed + per_token * n for n in tokens], [1, 64], [draft, draft])


def _summary(res) -> list[dict]:
    return [{"tokens": r.tokens, "steps": r.metrics.steps, "drafted": r.metrics.drafted,
             "accepted": r.metrics.accepted} for r in res.requests]


@pytest.fixture(scope="module")
def target() -> Target:
    return Target(tiny_model("llama", vocab_size=32, init_scale=0.3, seed=0))


# --- DSpark keeps its behaviour -------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(DSPARK))
def test_dspark_schedules_the_same_drafts_and_tokens_as_before(target, name, monkeypatch):
    """The schedule itself, as recorded. Its requests are seeded (to be reproducible), and a seed
    now pins a sampled row's whole draft (tests/test_seeds.py), so the pin is lifted here."""
    monkeypatch.setattr(PrefixPolicy, "couples_rows", False)
    opts, temperature = DSPARK[name]
    d = Recording(DRAFTERS.get("dspark").tiny(target, scheduler=True, **opts))
    reqs = [Request(list(p), 20, SamplingParams(temperature=temperature, seed=i)) for i, p in enumerate(PROMPTS)]
    verifier = GreedyVerifier() if temperature == 0 else RejectionVerifier()
    res = run(target, d, verifier, reqs, k=4, eos_token_ids=set())
    before = RECORDED["dspark"][name]
    assert _summary(res) == before["requests"]
    assert [{"tokens": p.tokens.tolist(), "num_valid": p.num_valid.tolist()} for p in d.proposals] == before["proposals"]


@pytest.mark.parametrize("name, per_token, draft", [("all", 0.0, 0.0), ("shorter", 0.5, 0.0), ("skips", 1.0, 1e3)])
def test_the_policy_on_the_planted_drafter_is_the_old_wrapper(target, name, per_token, draft):
    """What ``ScheduledDrafter(planted, costs)`` did, the loop now does with ``PrefixPolicy(costs)``
    (the planted drafter reports its p as each draft's confidence)."""
    planted = PlantedDrafter.create(target, p=0.8, seed=0)
    res = run(target, planted, GreedyVerifier(), [Request(list(p), 24) for p in PROMPTS], k=4, eos_token_ids=set(),
              policy=PrefixPolicy(_table(per_token, draft=draft)))
    assert _summary(res) == RECORDED["planted"][name]["requests"]


@pytest.mark.parametrize("per_token, draft, expect", [(0.0, 0.0, "all"), (0.5, 0.0, "shorter"), (1.0, 1e3, "skips")])
def test_the_prefix_policy_is_lossless_and_follows_the_costs(target, per_token, draft, expect):
    ar = run(target, None, GreedyVerifier(), [Request(list(p), 24) for p in PROMPTS], eos_token_ids=set())
    res = run(target, PlantedDrafter.create(target, p=0.8, seed=0), GreedyVerifier(),
              [Request(list(p), 24) for p in PROMPTS], k=4, eos_token_ids=set(),
              policy=PrefixPolicy(_table(per_token, draft=draft)))
    assert [r.tokens for r in res.requests] == [r.tokens for r in ar.requests]
    steps = sum(r.metrics.steps for r in res.requests)
    verified = sum(r.metrics.drafted for r in res.requests)
    if expect == "all":  # free verification: the whole chain, every step
        assert verified == 4 * steps
    elif expect == "shorter":  # each drafted token costs half a step: fewer than k, but some
        assert 0 < verified < 4 * steps
    else:  # drafting never pays: most steps skipped, a probe now and then
        assert verified < steps


def test_a_skipped_step_does_not_ask_the_drafter(target):
    planted = Recording(PlantedDrafter.create(target, p=0.8, seed=0))
    res = run(target, planted, GreedyVerifier(), [Request(list(p), 24) for p in PROMPTS], k=4, eos_token_ids=set(),
              policy=PrefixPolicy(_table(1.0, draft=1e3)))
    assert len(planted.proposals) < res.metrics.batch_steps


def test_the_prefix_policy_needs_chains_and_confidences(target):
    tree = RandomDrafter.create(target, siblings="iid", branching=[2, 2])
    with pytest.raises(ValueError, match="shortens chains"):
        run(target, tree, GreedyVerifier(), [Request([1, 2], 4)], k=2, policy="prefix")
    ngram = DRAFTERS.get("ngram").tiny(target)  # deterministic chains: no confidence, no q
    with pytest.raises(ValueError, match="confidence"):
        run(target, ngram, GreedyVerifier(), [Request([1, 2, 1, 2, 1, 2], 8)], k=2, policy="prefix")
    with pytest.raises(ValueError, match="budget"):
        PrefixPolicy(budget=-1)
    assert isinstance(make_policy("prefix"), PrefixPolicy)


# --- the schedule -----------------------------------------------------------------------------------
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
    conf, costs = torch.full((8, 4), 0.8), _table(per_token=0.1)
    lengths = schedule(conf, costs).tolist()
    assert _first_decrease(conf, costs, ragged=False) == [0] * 8
    best_uniform = max(range(5), key=lambda n: _theta(conf, [n] * 8, costs, False))
    assert best_uniform == 2 and lengths == [2] * 8


def test_on_a_ragged_block_it_is_algorithm_1():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        conf = torch.rand(5, 6, generator=gen) ** 0.3
        costs = _table(per_token=float(torch.rand(1, generator=gen)) * 0.2)
        assert schedule(conf, costs, ragged=True).tolist() == _first_decrease(conf, costs, ragged=True)

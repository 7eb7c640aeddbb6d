"""The GPU kit: the planted-acceptance drafter, and the CPU dry run of experiments/gpu_bench.py."""

from __future__ import annotations

import torch

from specdec.loop import Request, run
from specdec.target import Target
from specdec.testing.planted import PlantedDrafter, greedy_continuations
from specdec.testing.tiny import tiny_model
from specdec.verifiers import GreedyVerifier

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]


def _target() -> Target:
    return Target(tiny_model("llama", vocab_size=64, init_scale=0.3, seed=0))


def test_planted_greedy_output_is_autoregressive():
    target = _target()
    reqs = lambda: [Request(p, 24) for p in PROMPTS]  # noqa: E731
    ar = run(target, None, GreedyVerifier(), reqs(), eos_token_ids=set())
    spec = run(target, PlantedDrafter.create(target, p=0.6, seed=1), GreedyVerifier(), reqs(), k=4,
               eos_token_ids=set())
    assert [r.tokens for r in spec.requests] == [r.tokens for r in ar.requests]
    # the plain decoding the drafter plants is the loop's own greedy output
    assert greedy_continuations(target, PROMPTS, 24) == [r.tokens for r in ar.requests]


def test_planted_acceptance_per_position_is_p():
    target = _target()
    p, k = 0.7, 4
    drafter = PlantedDrafter.create(target, p=p, horizon=400, seed=0)
    res = run(target, drafter, GreedyVerifier(), [Request(q, 360) for q in PROMPTS], k=k, eos_token_ids=set())
    drafted = [sum(r.metrics.drafted_at[d] for r in res.requests) for d in range(k)]
    accepted = [sum(r.metrics.accepted_at[d] for r in res.requests) for d in range(k)]
    reached = [drafted[0]] + accepted[:-1]  # depth d+1 is tested only after depth d was accepted
    rates = [a / n for a, n in zip(accepted, reached)]
    assert drafted[0] > 300
    for rate in rates:  # binomial s.d. at ≥ 150 trials is ≤ 0.04
        assert abs(rate - p) < 0.1, rates


def test_planted_all_or_nothing():
    target = _target()
    for p, expect in ((1.0, 5.0), (0.0, 1.0)):
        res = run(target, PlantedDrafter.create(target, p=p), GreedyVerifier(), [Request([1, 2, 3], 21)], k=4,
                  eos_token_ids=set())
        m = res.requests[0].metrics
        assert m.mean_accepted_length == expect

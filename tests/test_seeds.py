"""A seed pins a sampled request's tokens under `rejection` too, whatever its batch: a policy whose
choices couple rows (the adaptive policy: one block width, shared statistics, measured costs, a
batch-wide skip) leaves seeded sampled rows their whole draft, and the suffix drafter's global tree
drafts for them only when asked to (``global_for_seeded``)."""

from __future__ import annotations

import pytest

import specdec
from specdec.drafters.eagle3.drafter import Eagle3Drafter
from specdec.drafters.suffix.drafter import SuffixDrafter, clear_global_caches
from specdec.policy import AdaptivePolicy, StepCosts
from specdec.sampling import SamplingParams

SEEDED = SamplingParams(temperature=1.0, seed=21)
PROMPT = [1, 2, 3, 4, 5]
OTHERS = [[7, 3, 9, 9], [5, 5, 1], [2, 8, 2, 8, 2, 8]]


def _steep() -> AdaptivePolicy:
    """A block of up to 5 tokens costs one forward, a larger one a hundred: alone, a row verifies
    its whole draft of 4; in a batch of 4 rows, none (the block width is the batch's)."""
    return AdaptivePolicy(costs=StepCosts([1, 5, 6, 64], [1.0, 1.0, 100.0, 1000.0], [1], [0.0]), probe_every=2)


def _run(target, drafter, prompts, sampling, policy):
    return specdec.generate(target, prompts, drafter=drafter, k=4, sampling=sampling, max_new_tokens=16,
                            policy=policy, eos_token_ids=set())


@pytest.mark.parametrize("policy", ["adaptive", "steep"])
def test_a_seeded_row_under_the_adaptive_policy_does_not_depend_on_its_batch(target, policy):
    make = (lambda: "adaptive") if policy == "adaptive" else _steep
    d = Eagle3Drafter.tiny(target)
    alone = _run(target, d, [PROMPT], [SEEDED], make()).tokens[0]
    for others in ([SamplingParams(temperature=1.0)] * 3, [SamplingParams()] * 3,
                   [SamplingParams(temperature=0.9, seed=s) for s in range(3)]):
        batch = _run(target, d, [OTHERS[0], PROMPT, *OTHERS[1:]], [others[0], SEEDED, *others[1:]], make())
        assert batch.tokens[1] == alone


def test_the_adaptive_policy_still_shortens_the_rows_a_seed_does_not_pin(target):
    d = Eagle3Drafter.tiny(target)
    res = _run(target, d, [PROMPT, *OTHERS], [SamplingParams(), SEEDED, SamplingParams(), SamplingParams()], _steep())
    greedy, seeded = (r.metrics for r in res.run.requests[:2])
    assert greedy.drafted < 4 * greedy.steps  # the policy cut the greedy row's drafts
    assert seeded.drafted > greedy.drafted  # ... and left the seeded sampled row its whole draft


def test_seeded_sampled_rows_draft_from_their_own_suffix_tree_unless_asked(target):
    """A second run of the same request finds its first output in the global tree: drafting from it
    would change the row's random numbers, so by default the seeded row keeps to its own tree."""
    clear_global_caches()
    try:
        d = SuffixDrafter.create(target)  # the global tree on
        first = _run(target, d, [PROMPT], [SEEDED], None).tokens[0]
        _run(target, d, OTHERS, [SamplingParams(temperature=1.0)] * 3, None)
        for _ in range(2):  # the global tree now holds this request's earlier outputs
            assert _run(target, d, [PROMPT], [SEEDED], None).tokens[0] == first
        assert _run(target, d, [OTHERS[2], PROMPT], [SamplingParams(), SEEDED], None).tokens[1] == first
        assert SuffixDrafter.create(target, global_for_seeded=True).config.global_for_seeded
        with pytest.raises(TypeError, match="global_for_seeded must be a bool"):
            SuffixDrafter.create(target, global_for_seeded="yes")
    finally:
        clear_global_caches()


@pytest.mark.parametrize("opts", [dict(budget=4), dict(costs=StepCosts([1, 5, 6, 64], [1.0, 1.0, 100.0, 1000.0], [1], [0.0]))])
def test_a_seeded_row_under_dsparks_own_scheduler_does_not_depend_on_its_batch(target, opts):
    """DSpark's ``scheduler=True`` applies the prefix policy inside its own ``propose``: a budget
    shared by the batch, or costs of the batch's block, would move a seeded row's draft length."""
    from specdec.drafters.dspark.drafter import DSparkDrafter

    costs = opts.get("costs", StepCosts([1, 64], [1.0, 1.0], [1], [0.0]))
    d = DSparkDrafter.tiny(target, scheduler=True, costs=costs, budget=opts.get("budget"))
    alone = _run(target, d, [PROMPT], [SEEDED], None).tokens[0]
    for others in ([SamplingParams(temperature=1.0)] * 3, [SamplingParams()] * 3):
        batch = _run(target, d, [OTHERS[0], PROMPT, *OTHERS[1:]], [others[0], SEEDED, *others[1:]], None)
        assert batch.tokens[1] == alone

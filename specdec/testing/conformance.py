"""The conformance suite: every drafter through greedy equivalence, exact goodness-of-fit for
sampled decoding, the q-contract, batch independence and the edge cases. Statistical tests use
fixed seeds and a Bonferroni bound: the family-wise error of each test function is ALPHA.

The tests take two fixtures: ``target`` (a tiny random target) and ``drafter_case`` ((name,
drafter) pairs); the exact tests of sampled decoding also take ``sampled_verifier``, the registered
name of a lossless verifier (:data:`SAMPLED_VERIFIERS`), so every such verifier is held to them. This repository's ``tests/conftest.py`` provides them for every registered
drafter; :mod:`specdec.testing.plugin` provides them for any drafter, so the suite runs from
outside this repository too::

    pytest --pyargs specdec.testing.conformance -p specdec.testing.plugin --specdec-drafter my_pkg.mod:MyDrafter

or, from Python, :func:`specdec.testing.run_conformance`.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specdec
from specdec import SamplingParams
from specdec.loop import LossyVerifierWarning, Request, run
from specdec.policy import AdaptivePolicy, StepCosts
from specdec.registry import verifier_class
from specdec.testing.tools import (Recording, assert_batch_independent, assert_greedy_equivalent, greedy_reference,
                                   q_contract, sampled_gof)
from specdec.verifiers import GreedyVerifier, RejectionVerifier, TypicalVerifier


ALPHA = 1e-3
# The lossless verifiers of sampled decoding, by registered name: the tests that take ``sampled_verifier``
# run each of them (a new lossless verifier is added here). This repository's conftest runs
# ``rejection`` on every case and the others on a few cases of each kind; the plugin runs all on every drafter.
SAMPLED_VERIFIERS = ("rejection", "block", "coupled")
SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=2),  # fewer tokens than a 3-sibling tree: the support runs out
]
SETTING_IDS = ["t1", "t0.7-topk5", "t1.3-topp0.8", "t1-topk2"]
PROMPT = [1, 2, 3, 4]
OTHER = [3, 1, 4, 1, 5]  # its greedy continuation never meets PROMPT's third greedy token (the EOS test)

prompts_st = st.lists(st.lists(st.integers(0, 31), min_size=1, max_size=10), min_size=1, max_size=3)


def adaptive_policy() -> AdaptivePolicy:
    """The adaptive policy with fixed costs, so its choices are reproducible: a block of t tokens
    costs √t, the same trade-off at any batch size (one more node per row pays only when its
    expected gain beats the step's cost growth), so drafters of different acceptance get 0, some
    or all of their drafts verified, plus a probe of the whole draft every few idle steps."""
    tokens = [2 ** i for i in range(16)]
    return AdaptivePolicy(costs=StepCosts(tokens, [t ** 0.5 for t in tokens], [1], [0.0]), probe_every=2)


# --- greedy -----------------------------------------------------------------------------------
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=prompts_st, k=st.integers(1, 5), verifier=st.sampled_from([GreedyVerifier, RejectionVerifier]))
def test_greedy_equals_target_greedy(drafter_case, target, prompts, k, verifier):
    _, drafter = drafter_case
    n = 12
    res = run(target, drafter, verifier(), [Request(p, n) for p in prompts], k=k, eos_token_ids=set())
    for p, r in zip(prompts, res.requests):
        ref, logits = greedy_reference(target.model, p, n)
        assert_greedy_equivalent(r.tokens, ref, logits)


@pytest.mark.parametrize("verifier", [GreedyVerifier, RejectionVerifier])
def test_greedy_equals_target_greedy_with_the_adaptive_policy(drafter_case, target, verifier):
    """Drafts shortened per row and step by the adaptive policy (:mod:`specdec.policy`)."""
    _, drafter = drafter_case
    prompts, n = [[1, 2, 3, 4, 1, 2, 3], [5, 6], [7, 8, 9, 7, 8, 9, 7]], 16
    res = run(target, drafter, verifier(), [Request(p, n) for p in prompts], k=4, eos_token_ids=set(),
              policy=adaptive_policy())
    for p, r in zip(prompts, res.requests):
        ref, logits = greedy_reference(target.model, p, n)
        assert_greedy_equivalent(r.tokens, ref, logits)


def test_autoregressive_equals_target_greedy(target):
    res = run(target, None, GreedyVerifier(), [Request([5, 6, 7], 16)], eos_token_ids=set())
    ref, logits = greedy_reference(target.model, [5, 6, 7], 16)
    assert_greedy_equivalent(res.requests[0].tokens, ref, logits)


# --- sampled ----------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", SETTINGS, ids=SETTING_IDS)
def test_sampled_matches_target_distribution(drafter_case, target, sampling, sampled_verifier):
    _, drafter = drafter_case
    r = sampled_gof(target, drafter, verifier_class(sampled_verifier)(), PROMPT, sampling, n_samples=4000)
    assert len(r.pvalues) >= 3, "too few conditional tests: the suite would prove nothing"
    bound = ALPHA / (len(r.pvalues) * len(SETTINGS))
    worst = min(zip(r.pvalues, r.tests))
    assert worst[0] > bound, f"output is not distributed as the target's: {worst[1]} p={worst[0]:.2e}"


def test_sampled_matches_target_distribution_with_the_adaptive_policy(drafter_case, target, sampled_verifier):
    _, drafter = drafter_case
    r = sampled_gof(target, drafter, verifier_class(sampled_verifier)(), PROMPT, SETTINGS[0], n_samples=4000,
                    policy=adaptive_policy())
    assert len(r.pvalues) >= 3, "too few conditional tests: the suite would prove nothing"
    worst = min(zip(r.pvalues, r.tests))
    assert worst[0] > ALPHA / len(r.pvalues), f"output is not distributed as the target's: {worst[1]} p={worst[0]:.2e}"


def test_goodness_of_fit_catches_a_lossy_verifier(target):
    """The same test must fail for typical acceptance: the suite can tell lossy from lossless."""
    drafter = specdec.make_drafter("draft_model", target, model=target.model, greedy_draft=True)
    with pytest.warns(LossyVerifierWarning, match="typical"):  # the lossy verifier is this test's own, on purpose
        r = sampled_gof(target, drafter, TypicalVerifier(), PROMPT, SamplingParams(temperature=1.0), n_samples=4000)
    assert r.min_p < 1e-6


def test_goodness_of_fit_catches_greedy_in_disguise(target):
    """Sampled verification that silently decodes greedily fails the test."""
    r = sampled_gof(target, None, _ArgmaxVerifier(), PROMPT, SamplingParams(temperature=1.0), n_samples=500,
                    min_group=50)
    assert r.min_p < 1e-6


class _ArgmaxVerifier(RejectionVerifier):
    def verify(self, proposal, logits, rows):
        return GreedyVerifier().verify(proposal, logits, rows)


def test_sampling_is_not_greedy(target):
    res = run(target, None, RejectionVerifier(),
              [Request(PROMPT, 1, SamplingParams(temperature=1.0, seed=s)) for s in range(200)], eos_token_ids=set())
    first = {r.tokens[0] for r in res.requests}
    assert len(first) > 3, f"temperature 1 produced only {first}"


# --- q-contract -------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", SETTINGS, ids=SETTING_IDS)
def test_q_is_the_distribution_sampled_from(drafter_case, target, sampling):
    """Every row drafts from one state (the prefill's argmax is every row's anchor), so node 0's group
    holds all rows: a sampling drafter gets a χ² test of node 0 at least, and q_contract checks that a
    deterministic one (q None) drafts the same tokens in every row."""
    _, drafter = drafter_case
    rec = Recording(drafter)
    r = q_contract(target, rec, PROMPT, sampling, n_samples=4000)
    assert rec.anchors.unique().numel() == 1, "rows start from different states: node 0 would not be tested"
    assert bool(r.pvalues) == (rec.proposals[0].q is not None), r.tests
    assert all(p > ALPHA / (len(r.pvalues) * len(SETTINGS)) for p in r.pvalues), (
        "q is not what was sampled: {1} p={0:.2e}".format(*min(zip(r.pvalues, r.tests))))


def test_q_contract_catches_a_lying_drafter(target):
    """A drafter that samples at temperature 1 but reports q at temperature 0.5 is caught."""
    from specdec.registry import drafter_class

    class Liar(drafter_class("draft_model")):  # type: ignore[misc]
        def propose(self, state, k, rows):
            p = super().propose(state, k, rows)
            p.q = (p.q.clamp(min=1e-30).log() * 2).softmax(-1)
            return p

    liar = Liar(target.model)
    liar.bind(target)
    r = q_contract(target, liar, PROMPT, SamplingParams(temperature=1.0), n_samples=4000)
    assert r.min_p < 1e-6


# --- batch independence and edge cases ----------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_do_not_depend_on_their_batch(drafter_case, target, temperature, sampled_verifier):
    _, drafter = drafter_case
    verifier = verifier_class(sampled_verifier)
    mine = Request([3, 1, 4, 1, 5], 10, SamplingParams(temperature=temperature, seed=7))
    others = [Request([9, 2, 6] * (i + 1), 4 + 3 * i, SamplingParams(temperature=1.0, seed=i)) for i in range(3)]
    alone = run(target, drafter, verifier(), [mine], k=3, eos_token_ids=set()).requests[0].tokens
    batched = run(target, drafter, verifier(), others[:1] + [mine] + others[1:], k=3, eos_token_ids=set())
    assert_batch_independent(alone, batched.requests[1].tokens, row=1, batch=len(others) + 1)


def test_greedy_rows_of_a_sampled_batch_equal_target_greedy(drafter_case, target, sampled_verifier):
    """Temperature-0 rows verified in one batch with temperature-1 rows: the verifier's sampled path
    must give them exactly the argmax rule."""
    _, drafter = drafter_case
    prompts, n = [[1, 2, 3, 4, 1, 2, 3], [5, 6], [7, 8, 9, 7, 8, 9, 7]], 12
    reqs = [Request(p, n, SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, seed=i))
            for i, p in enumerate(prompts + prompts)]
    res = run(target, drafter, verifier_class(sampled_verifier)(), reqs, k=4, eos_token_ids=set())
    for r, req in zip(res.requests, reqs):
        if req.sampling.greedy:
            ref, logits = greedy_reference(target.model, req.prompt, n)
            assert_greedy_equivalent(r.tokens, ref, logits)


def test_eos_mid_draft_stops_only_that_row(target):
    """Everything is accepted (the draft is the target), so EOS arrives inside an accepted draft."""
    drafter = specdec.make_drafter("draft_model", target, model=target.model)
    ref, _ = greedy_reference(target.model, PROMPT, 12)
    eos = ref[2]
    stop = ref.index(eos)
    res = run(target, drafter, GreedyVerifier(), [Request(PROMPT, 12), Request(OTHER, 12)], k=5,
              eos_token_ids={eos})
    assert res.requests[0].tokens == ref[: stop + 1]
    assert res.requests[0].metrics.finish_reason == "eos"
    assert 0 < stop and res.requests[0].metrics.steps == 1  # EOS came inside the first draft, not from the prefill
    other_ref, _ = greedy_reference(target.model, OTHER, 12)
    assert eos not in other_ref  # the other row never meets EOS: it must run to its length
    assert res.requests[1].tokens == other_ref and res.requests[1].metrics.finish_reason == "length"


def test_all_accepted_and_none_accepted(target):
    good = specdec.make_drafter("draft_model", target, model=target.model)
    res = run(target, good, GreedyVerifier(), [Request(PROMPT, 13)], k=4, eos_token_ids=set())
    m = res.requests[0].metrics
    assert m.mean_accepted_length == 5.0 and m.acceptance_at == [1.0] * 4

    class Wrong(specdec.testing.RandomDrafter):
        def propose(self, state, k, rows):  # always a token the target's argmax is not
            p = super().propose(state, k, rows)
            p.tokens = (torch.zeros_like(p.tokens) + 31)
            return p

    target_argmax_never_31 = Wrong.create(target, siblings="deterministic")
    ref, _ = greedy_reference(target.model, PROMPT, 8)
    assert 31 not in ref  # so no draft can be right
    res = run(target, target_argmax_never_31, GreedyVerifier(), [Request(PROMPT, 8)], k=3, eos_token_ids=set())
    assert res.requests[0].tokens == ref
    assert res.requests[0].metrics.accepted == 0 and res.requests[0].metrics.steps == 7


def test_num_valid_shorter_than_n(target):
    """Nodes past num_valid are never accepted, even when they are right."""
    class Truncating(specdec.drafters.DraftModelDrafter):
        def propose(self, state, k, rows):
            p = super().propose(state, k, rows)
            p.num_valid = torch.ones_like(p.num_valid)
            return p

    d = Truncating(target.model)
    d.bind(target)
    res = run(target, d, GreedyVerifier(), [Request(PROMPT, 9)], k=4, eos_token_ids=set())
    ref, logits = greedy_reference(target.model, PROMPT, 9)
    assert_greedy_equivalent(res.requests[0].tokens, ref, logits)
    assert res.requests[0].metrics.mean_accepted_length == 2.0


def test_k_equals_one(drafter_case, target):
    _, drafter = drafter_case
    res = run(target, drafter, GreedyVerifier(), [Request(PROMPT, 6)], k=1, eos_token_ids=set())
    ref, logits = greedy_reference(target.model, PROMPT, 6)
    assert_greedy_equivalent(res.requests[0].tokens, ref, logits)

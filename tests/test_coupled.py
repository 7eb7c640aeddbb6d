"""The coupled verifier: a seeded request emits exactly the tokens of plain seeded sampling,
whatever the drafter, k, policy or batch; lossless by the exact χ² test; drafts that race on the
shared noise are accepted where they agree with the target."""

from __future__ import annotations

import pytest
import torch

import specdec
from specdec.drafters import DraftModelDrafter
from specdec.drafters.dflash.drafter import DFlashDrafter
from specdec.drafters.dspark.drafter import DSparkDrafter
from specdec.drafters.eagle3.drafter import Eagle3Drafter
from specdec.drafters.mtp.drafter import MTPDrafter
from specdec.loop import Request, run
from specdec.policy import AdaptivePolicy, StepCosts
from specdec.sampling import RowSampling, SamplingParams
from specdec.testing import RandomDrafter, sampled_gof
from specdec.verifiers import CoupledVerifier, RejectionVerifier

PROMPTS = [[1, 2, 3, 4], [7, 3, 9], [5, 5, 1, 2, 8]]
SAMPLING = [SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=0.8, top_k=6, seed=12),
            SamplingParams(temperature=1.2, top_p=0.9, seed=13)]
N = 12

DRAFTERS = {
    "ngram": lambda t: "ngram",
    "eagle3": lambda t: Eagle3Drafter.tiny(t),
    "eagle3[static_tree]": lambda t: Eagle3Drafter.tiny(t, tree="static"),
    "dflash": lambda t: DFlashDrafter.tiny(t),
    "dspark": lambda t: DSparkDrafter.tiny(t),
    "mtp": lambda t: MTPDrafter.tiny(t),
    "draft_model[self]": lambda t: DraftModelDrafter.create(t, model=t.model),
    "random[tree]": lambda t: RandomDrafter.create(t, siblings="iid", branching=[2, 2]),
}


def _plain(target, prompts, sampling) -> list[list[int]]:
    """Plain seeded sampling: no drafter, the default verifier."""
    return specdec.generate(target, prompts, drafter=None, verifier="rejection", sampling=sampling,
                            max_new_tokens=N).tokens


def _coupled(target, drafter, prompts, sampling, k, policy=None) -> list[list[int]]:
    return specdec.generate(target, prompts, drafter=drafter, verifier="coupled", sampling=sampling, k=k,
                            max_new_tokens=N, policy=policy).tokens


def _adaptive() -> AdaptivePolicy:
    tokens = [2 ** i for i in range(12)]
    return AdaptivePolicy(costs=StepCosts(tokens, [t ** 0.5 for t in tokens], [1], [0.0]), probe_every=2)


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_a_seeded_request_emits_plain_seeded_samplings_tokens_whatever_the_drafter(target, name):
    ref = _plain(target, PROMPTS, SAMPLING)
    drafter = DRAFTERS[name](target)
    for k in (1, 3):
        assert _coupled(target, drafter, PROMPTS, SAMPLING, k) == ref, (name, k)
    # alone, in another batch order, beside unseeded and greedy rows, under the adaptive policy
    assert _coupled(target, drafter, PROMPTS[1:2], SAMPLING[1:2], 2) == ref[1:2]
    mixed = [PROMPTS[2], [4, 4, 4], PROMPTS[0], [9, 1]]
    others = [SAMPLING[2], SamplingParams(temperature=1.0), SAMPLING[0], SamplingParams()]
    out = _coupled(target, drafter, mixed, others, 4, policy=_adaptive())
    assert (out[0], out[2]) == (ref[2], ref[0])
    assert out[3] == _plain(target, [[9, 1]], [SamplingParams()])[0]  # a greedy row stays greedy


def test_plain_decoding_under_coupled_is_rejections_plain_decoding(target):
    assert _coupled(target, None, PROMPTS, SAMPLING, 1) == _plain(target, PROMPTS, SAMPLING)


def test_measured_costs_and_the_prefix_scheduler_do_not_move_a_seeded_row(target):
    """Policies whose choices depend on timings or on the whole batch still cannot change a row."""
    ref = _plain(target, PROMPTS, SAMPLING)
    drafter = DSparkDrafter.tiny(target, scheduler=True)
    assert _coupled(target, drafter, PROMPTS, SAMPLING, 4, policy="adaptive") == ref
    assert _coupled(target, drafter, PROMPTS[:1], SAMPLING[:1], 4) == ref[:1]


def test_a_drafter_equal_to_the_target_races_on_the_same_noise_and_is_always_accepted(target):
    """The draft model is the target (q = p): its chain draws race on the verifier's noise, so
    every draft is the target's own choice and every step accepts all k (until the length cap)."""
    d = DraftModelDrafter.create(target, model=target.model)
    reqs = [Request(p, 13, s) for p, s in zip(PROMPTS, SAMPLING)]
    for r in run(target, d, CoupledVerifier(), reqs, k=4).requests:
        assert r.metrics.accepted == r.metrics.drafted > 0
    # the same model drafting its argmax (not racing on the noise) agrees with the target's race less
    greedy = DraftModelDrafter.create(target, model=target.model, greedy_draft=True)
    res = run(target, greedy, CoupledVerifier(), reqs, k=4).requests
    assert sum(r.metrics.accepted for r in res) < sum(r.metrics.drafted for r in res)


def test_keyed_noise_is_rejections_plain_decoding_noise():
    """A seeded row's noise at position t is what rejection draws at step t of plain decoding."""
    params = [SamplingParams(temperature=1.0, seed=5)]
    keyed, plain = RowSampling(params), RowSampling(params)
    keyed.key_by_position()
    empty = specdec.types.DraftProposal.empty(1, torch.device("cpu"))
    for _ in range(3):
        _, noise = plain.verify_noise(empty, 40)
        assert torch.equal(keyed.keyed_noise(0, 40), noise)
        keyed.advance([1])


@pytest.mark.parametrize("name", ["eagle3", "dspark", "random[tree]"])
def test_coupled_output_is_distributed_as_the_target(target, name):
    """Exact goodness of fit (χ², Bonferroni over the conditional tests) at two settings."""
    drafter = DRAFTERS[name](target)
    for sampling in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)):
        r = sampled_gof(target, drafter, CoupledVerifier(), [1, 2, 3, 4], sampling, n_samples=3000)
        assert len(r.pvalues) >= 3
        worst = min(zip(r.pvalues, r.tests))
        assert worst[0] > 1e-3 / (2 * len(r.pvalues)), f"{worst[1]} p={worst[0]:.2e}"


def test_coupled_refuses_rows_it_did_not_key(target):
    rows = RowSampling([SamplingParams(temperature=1.0)])
    logits = torch.zeros(1, 1, target.vocab_size)
    with pytest.raises(ValueError, match="keyed by position"):
        CoupledVerifier().verify(specdec.types.DraftProposal.empty(1, torch.device("cpu")), logits, rows)

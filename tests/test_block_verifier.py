"""Block verification (verifiers/block.py) on tiny vocabularies, where everything is enumerable.

- Exactness: the output distribution of one block-verification step, computed exactly by
  enumerating every draft and integrating over the uniforms (P(τ = i | X) = h_i Π_{j>i} (1 − h_j)),
  followed by the target's own sampling, equals the target's distribution of the first k+1
  tokens to 1e-12, with and without q; a lossy variant (τ = the first failing position, the
  mistake a token-wise reading of the rule makes) fails the same check.
- Expected accepted length: exactly ≥ the rejection verifier's, strictly on the paper's
  two-token example (11/9 against 10/9) and on random targets.
- The verifier itself (uniforms, race, num_valid, batching): its emitted blocks follow the
  enumerated distribution (χ²), its mean accepted length is within 5 standard errors of the
  exact one, temperature 0 is the argmax rule and trees go to rejection sampling.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections import Counter

import pytest
import torch

import specdec.sampling
from specdec.kernels import argmax_walk
from specdec.sampling import RowSampling, SamplingParams
from specdec.testing import chi_square
from specdec.types import DraftProposal
from specdec.verifiers import BlockVerifier, RejectionVerifier
from specdec.verifiers.block import block_residual, block_thresholds, expected_accepted

Dist = dict[tuple[int, ...], torch.Tensor]  # prefix -> next-token distribution [V] (float64)


def random_model(V: int, k: int, seed: int, scale: float = 1.5) -> Dist:
    """A context-dependent distribution for every prefix of length ≤ k."""
    g = torch.Generator().manual_seed(seed)
    return {c: (torch.randn(V, generator=g, dtype=torch.float64) * scale).softmax(-1)
            for n in range(k + 1) for c in itertools.product(range(V), repeat=n)}


def drafts(q: Dist | None, p: Dist, V: int, k: int, det_from: Dist | None = None):
    """Every draft X with its probability; with ``q None`` the draft is deterministic: the argmax of
    ``det_from`` at each prefix (probability 1)."""
    if q is None:
        assert det_from is not None
        x: tuple[int, ...] = ()
        for _ in range(k):
            x += (int(det_from[x].argmax()),)
        yield x, 1.0
        return
    for x in itertools.product(range(V), repeat=k):
        yield x, math.prod(float(q[x[:i]][x[i]]) for i in range(k))


def block_law(p: Dist, q: Dist | None, V: int, k: int, det_from: Dist | None = None,
              first_failure: bool = False) -> tuple[float, Dist]:
    """The exact law of one step: (E[τ], P(emitted block = s) for every s), from the verifier's
    thresholds and residuals in float64. ``first_failure`` is the lossy variant τ = min{i: η_i ≥ h_i} − 1."""
    law: dict[tuple[int, ...], float] = {}
    expected = 0.0
    for x, px in drafts(q, p, V, k, det_from):
        probs = torch.stack([p[x[:i]] for i in range(k + 1)]).unsqueeze(0)
        qq = None if q is None else torch.stack([q[x[:i]] for i in range(k)]).unsqueeze(0)
        toks, nv = torch.tensor([x]), torch.tensor([k])
        w, h = block_thresholds(toks, nv, probs, qq)
        hs = h[0].tolist()
        for tau in range(k + 1):
            if first_failure:
                pt = math.prod(hs[:tau]) * (1 - hs[tau] if tau < k else 1.0)
            else:
                pt = (1.0 if tau == 0 else hs[tau - 1]) * math.prod(1 - v for v in hs[tau:])
            if pt == 0:
                continue
            expected += px * pt * tau
            r = block_residual(torch.tensor([tau]), nv, toks, probs, qq, w)[0]
            for y, ry in enumerate((r / r.sum()).tolist()):
                law[x[:tau] + (y,)] = law.get(x[:tau] + (y,), 0.0) + px * pt * ry
    return expected, {s: torch.tensor(v, dtype=torch.float64) for s, v in law.items()}


def rejection_expected(p: Dist, q: Dist, V: int, k: int) -> float:
    """Token-wise verification's exact E[τ]: Σ_X q(X) Σ_i Π_{j≤i} min(1, p(X_j)/q(X_j))."""
    total = 0.0
    for x, px in drafts(q, p, V, k):
        run = 1.0
        for i in range(k):
            run *= min(1.0, float(p[x[:i]][x[i]] / q[x[:i]][x[i]]))
            total += px * run
    return total


def worst_gap(p: Dist, law: Dist, V: int, k: int) -> float:
    """max over sequences s of length 1..k+1 of |P(the first |s| tokens are s) − p(s)|, when the
    step's block is followed by the target's own sampling."""
    worst = 0.0
    for n in range(1, k + 2):
        for s in itertools.product(range(V), repeat=n):
            got = sum(float(v) for o, v in law.items() if len(o) > n and o[:n] == s)
            for j in range(1, n + 1):  # a block of length j ≤ n, then the target's tokens
                got += float(law.get(s[:j], 0.0)) * math.prod(float(p[s[:t]][s[t]]) for t in range(j, n))
            want = math.prod(float(p[s[:t]][s[t]]) for t in range(n))
            worst = max(worst, abs(got - want))
    return worst


# --- exactness, enumerated ----------------------------------------------------------------------
PAPER_P, PAPER_Q = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64), torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)


def paper_models() -> tuple[Dist, Dist]:
    """The paper's motivating example: context-free M_b = (1/3, 2/3), M_s = (2/3, 1/3), k = 2."""
    prefixes = [c for n in range(3) for c in itertools.product(range(2), repeat=n)]
    return {c: PAPER_P for c in prefixes}, {c: PAPER_Q for c in prefixes}


@pytest.mark.parametrize("V,k,seed", [(4, 2, 0), (4, 3, 1), (3, 3, 2), (4, 3, 3)])
def test_block_step_is_exactly_the_target_distribution(V, k, seed):
    p, q = random_model(V, k, seed), random_model(V, k, seed + 100, scale=2.0)
    _, law = block_law(p, q, V, k)
    assert worst_gap(p, law, V, k) < 1e-12


@pytest.mark.parametrize("V,k,seed", [(4, 2, 0), (4, 3, 1)])
def test_block_step_without_q_is_exact(V, k, seed):
    """A deterministic draft (q None: the point mass on the draft, as vLLM's V2 sampler takes it)."""
    p, d = random_model(V, k, seed), random_model(V, k, seed + 100)
    _, law = block_law(p, None, V, k, det_from=d)
    assert worst_gap(p, law, V, k) < 1e-12


def test_the_exactness_check_catches_a_first_failure_variant():
    """Stopping at the first position that fails its threshold is lossy: the check above sees it."""
    p, q = random_model(4, 3, 1), random_model(4, 3, 101, scale=2.0)
    _, law = block_law(p, q, 4, 3, first_failure=True)
    assert worst_gap(p, law, 4, 3) > 1e-3
    pp, pq = paper_models()
    _, law = block_law(pp, pq, 2, 2, first_failure=True)
    assert worst_gap(pp, law, 2, 2) > 1e-3


# --- expected accepted length, exactly -------------------------------------------------------------
def test_the_papers_example_accepts_11_ninths_against_10_ninths():
    p, q = paper_models()
    block, law = block_law(p, q, 2, 2)
    assert block == pytest.approx(11 / 9, abs=1e-12)
    assert rejection_expected(p, q, 2, 2) == pytest.approx(10 / 9, abs=1e-12)
    assert worst_gap(p, law, 2, 2) < 1e-12


@pytest.mark.parametrize("seed", range(6))
def test_expected_accepted_length_is_at_least_rejections(seed):
    V, k = 4, 3
    p, q = random_model(V, k, seed, scale=1.0), random_model(V, k, seed + 50, scale=1.0)
    block, _ = block_law(p, q, V, k)
    assert block >= rejection_expected(p, q, V, k) - 1e-12


def test_expected_accepted_length_is_strictly_higher_on_random_targets():
    """Not only on the paper's hand-picked example: on every one of these random pairs."""
    V, k = 4, 3
    gains = []
    for seed in range(4):
        p, q = random_model(V, k, seed, scale=1.0), random_model(V, k, seed + 50, scale=1.0)
        gains.append(block_law(p, q, V, k)[0] - rejection_expected(p, q, V, k))
    assert min(gains) > 1e-3, gains


# --- the verifier itself ----------------------------------------------------------------------------
def fixed_entropy(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Unseeded rows draw from one generator seeded from fresh entropy: fix it, so the statistical
    tests below are reproducible (seeding 60,000 rows one by one would cost seconds)."""
    monkeypatch.setattr(specdec.sampling.secrets, "randbits", lambda bits: seed)


def table(d: Dist, V: int, n: int) -> torch.Tensor:
    """The distributions after every prefix of length n, in the order of the prefix read as base-V digits. [V^n, V]"""
    return torch.stack([d[c] for c in itertools.product(range(V), repeat=n)]).float()


def prefix_index(toks: torch.Tensor, V: int) -> torch.Tensor:
    """Each row's prefix read as a base-V number (the row of :func:`table`). [rows]"""
    idx = torch.zeros(toks.shape[0], dtype=torch.long)
    for j in range(toks.shape[1]):
        idx = idx * V + toks[:, j]
    return idx


def sampled_step(p: Dist, q: Dist, V: int, k: int, rows: int, seed: int, num_valid: int | None = None):
    """``rows`` independent drafts of (p, q) as one chain proposal, logits = log p (temperature 1)."""
    g = torch.Generator().manual_seed(seed)
    toks = torch.zeros(rows, k, dtype=torch.long)
    qs = torch.zeros(rows, k, V)
    for i in range(k):
        qs[:, i] = table(q, V, i)[prefix_index(toks[:, :i], V)]
        toks[:, i] = torch.multinomial(qs[:, i], 1, generator=g).squeeze(1)
    logits = torch.stack([table(p, V, i)[prefix_index(toks[:, :i], V)] for i in range(k + 1)], 1).log()
    nv = None if num_valid is None else torch.full((rows,), num_valid)
    return DraftProposal.chain(toks, qs, nv), logits, RowSampling([SamplingParams(temperature=1.0)] * rows)


@pytest.mark.parametrize("num_valid", [None, 2])
def test_verify_emits_the_enumerated_law_and_its_mean_accepted_length(num_valid, monkeypatch):
    fixed_entropy(monkeypatch, 11)
    V, k, rows = 3, 3, 60_000
    p, q = random_model(V, k, 7), random_model(V, k, 8, scale=2.0)
    kv = k if num_valid is None else num_valid
    expected, law = block_law(p, q, V, kv)
    proposal, logits, sampling = sampled_step(p, q, V, k, rows, seed=0, num_valid=num_valid)
    out = BlockVerifier().verify(proposal, logits, sampling)
    tau = out.num_accepted
    assert int(tau.max()) <= kv
    se = float(tau.double().std()) / rows ** 0.5
    assert abs(float(tau.double().mean()) - expected) < 5 * se
    blocks = Counter(tuple(t[: a + 1]) for t, a in zip(out.tokens.tolist(), tau.tolist()))
    keys = sorted(law)
    assert set(blocks) <= set(keys), "a block of probability 0 was emitted"
    counts = torch.tensor([blocks.get(s, 0) for s in keys], dtype=torch.float64)
    assert chi_square(counts, torch.stack([law[s] for s in keys])) > 1e-3


def test_verify_accepts_more_than_rejection_on_the_same_drafts(monkeypatch):
    """Both verifiers on the same drafts and target: block's mean accepted length is higher by more than
    the noise (5 standard errors of the difference), and each sits on its exact value."""
    fixed_entropy(monkeypatch, 12)
    V, k, rows = 2, 2, 60_000
    p, q = paper_models()
    proposal, logits, sampling = sampled_step(p, q, V, k, rows, seed=1)
    block = BlockVerifier().verify(proposal, logits, sampling).num_accepted.double()
    rej = RejectionVerifier().verify(proposal, logits, RowSampling([SamplingParams(temperature=1.0)] * rows))
    tok = rej.num_accepted.double()
    se = ((block.var() + tok.var()) / rows) ** 0.5
    assert float(block.mean() - tok.mean()) > 5 * float(se)
    assert abs(float(block.mean()) - 11 / 9) < 5 * float(block.std()) / rows ** 0.5
    assert abs(float(tok.mean()) - 10 / 9) < 5 * float(tok.std()) / rows ** 0.5


def test_temperature_zero_is_the_argmax_rule():
    """The thresholds on a one-hot target: τ is the matched prefix whatever q and the uniforms."""
    V, B, n = 5, 64, 4
    g = torch.Generator().manual_seed(0)
    best = torch.randint(0, V, (B, n + 1), generator=g)
    tokens = torch.where(torch.rand(B, n, generator=g) < 0.7, best[:, :n], torch.randint(0, V, (B, n), generator=g))
    probs = torch.zeros(B, n + 1, V).scatter_(-1, best.unsqueeze(-1), 1.0)
    q = torch.rand(B, n, V, generator=g).softmax(-1)
    nv = torch.randint(0, n + 1, (B,), generator=g)
    _, h = block_thresholds(tokens, nv, probs, q)
    tau = torch.where(torch.rand(B, n, generator=g) < h, torch.arange(1, n + 1), 0).max(1).values
    logits = probs.log().clamp(min=-100.0)
    ref = argmax_walk(tokens, DraftProposal.chain(tokens).parents, nv, logits)
    assert tau.tolist() == ref.num_accepted.tolist()
    # and the verifier on a batch mixing greedy and sampled rows gives its greedy rows the argmax walk
    rows = RowSampling([SamplingParams(temperature=0.0 if b % 2 else 1.0, seed=b) for b in range(B)])
    out = BlockVerifier().verify(DraftProposal.chain(tokens, q, nv), logits, rows)
    odd = torch.arange(B) % 2 == 1
    assert out.tokens[odd].tolist() == ref.tokens[odd].tolist()


def test_trees_fall_back_to_rejection_sampling_and_say_so():
    V, B = 6, 32
    g = torch.Generator().manual_seed(0)
    parents = torch.tensor([-1, -1, 0, 0]).expand(B, 4).clone()
    tokens = torch.randint(0, V, (B, 4), generator=g)
    q = torch.rand(B, 4, V, generator=g).softmax(-1)
    logits = torch.randn(B, 5, V, generator=g)
    seeded = lambda: RowSampling([SamplingParams(temperature=1.0, seed=b) for b in range(B)])  # noqa: E731
    verifier = BlockVerifier()
    with pytest.warns(UserWarning, match="token-wise"):
        got = verifier.verify(DraftProposal(tokens, parents, q), logits, seeded())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        verifier.verify(DraftProposal(tokens, parents, q), logits, seeded())
    want = RejectionVerifier().verify(DraftProposal(tokens, parents, q), logits, seeded())
    assert got.tokens.tolist() == want.tokens.tolist()
    assert verifier.tree_fallback_steps == 2


def test_a_chain_given_by_parents_is_verified_as_a_block():
    """A chain built without DraftProposal.chain (parents written out) is still a chain."""
    V, k = 2, 2
    p, q = paper_models()
    proposal, logits, sampling = sampled_step(p, q, V, k, 2000, seed=3)
    plain = DraftProposal(proposal.tokens, proposal.parents.clone(), proposal.q)
    verifier = BlockVerifier()
    verifier.verify(plain, logits, sampling)
    assert verifier.tree_fallback_steps == 0


@pytest.mark.parametrize("case", ["paper", "random"])
def test_expected_accepted_is_the_enumerated_expectation(case):
    """The paired measurement's per-draft expectations, averaged over the drafts, are the exact ones."""
    V, k = (2, 2) if case == "paper" else (4, 3)
    p, q = paper_models() if case == "paper" else (random_model(V, k, 5, scale=1.0), random_model(V, k, 55, scale=1.0))
    xs = list(drafts(q, p, V, k))
    toks = torch.tensor([x for x, _ in xs])
    probs = torch.stack([torch.stack([p[x[:i]] for i in range(k + 1)]) for x, _ in xs])
    qs = torch.stack([torch.stack([q[x[:i]] for i in range(k)]) for x, _ in xs])
    weight = torch.tensor([w for _, w in xs], dtype=torch.float64)
    block, token_wise = expected_accepted(toks, torch.full((len(xs),), k), probs, qs)
    assert float((weight * block).sum()) == pytest.approx(block_law(p, q, V, k)[0], abs=1e-12)
    assert float((weight * token_wise).sum()) == pytest.approx(rejection_expected(p, q, V, k), abs=1e-12)


def test_the_verifier_sums_the_paired_expectations_of_its_sampled_rows():
    p, q = paper_models()
    proposal, logits, sampling = sampled_step(p, q, 2, 2, 500, seed=4)
    verifier = BlockVerifier(compare=True)
    verifier.verify(proposal, logits, sampling)
    c = verifier.compared
    assert c["rows"] == 500 and c["block"] > c["token_wise"] > 0
    block, token_wise = expected_accepted(proposal.tokens, proposal.num_valid, logits.softmax(-1), proposal.q)
    assert c["block"] == pytest.approx(float(block.sum()), rel=1e-5)


def test_the_acceptance_bench_compares_block_with_rejection_on_the_same_drafts(target):
    """experiments/benchmarks/acceptance.py --temperature 1 --compare-block: every row carries both
    verifiers' expected accepted lengths on the drafts of its steps (block's never tree-fallen)."""
    import importlib.util
    from pathlib import Path

    from specdec.testing.tiny import tiny_model

    path = Path(__file__).resolve().parents[1] / "experiments" / "benchmarks" / "acceptance.py"
    spec = importlib.util.spec_from_file_location("specdec_experiments_acceptance_block", path)
    acc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(acc)
    draft = tiny_model("llama", vocab_size=target.vocab_size, init_scale=0.3, seed=5)  # q differs from p
    prompts = [[3, 5, 7, 3, 5, 7, 3, 5], [9, 9, 2, 9, 9, 2, 9, 9, 2], [1, 2, 3]]
    rows = acc.acceptance(target, {"draft": ("draft_model", {"model": draft}), "ngram": ("ngram", {})}, prompts, [3],
                          12, temperature=1.0, compare_block=True)
    assert [r["method"] for r in rows] == ["draft", "ngram"]
    for r in rows:
        assert r["identical"] is None and r["tree_fallback_steps"] == 0 and r["compared_rows"] >= len(prompts)
        assert 1.0 <= r["expected_token_wise"] <= r["k"] + 1 and 1.0 <= r["expected_block"] <= r["k"] + 1
    assert "| draft | draft_model | 3 |" in acc.markdown(rows, "header")

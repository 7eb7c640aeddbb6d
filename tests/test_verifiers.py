"""Verifiers on hand-made distributions: exact rules for greedy, and goodness-of-fit of the
emitted tokens for rejection sampling on chains and on trees with every sibling mode, many
independent rows in one call (each row has its own seeded generator)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.kernels import argmax_walk, rejection_sample_reference
from specdec.sampling import RowSampling, SamplingParams, warp
from specdec.testing import chi_square
from specdec.types import DraftProposal
from specdec.verifiers import VERIFIERS, GreedyVerifier, RejectionVerifier, TypicalVerifier

V = 7


def logits_with_argmax(ids: list[list[int]]) -> torch.Tensor:
    """[B, n+1, V] logits whose argmax at each position is the given id (±100, explicit)."""
    t = torch.tensor(ids)
    return torch.full((*t.shape, V), -100.0).scatter_(-1, t.unsqueeze(-1), 100.0)


def greedy_rows(b: int) -> RowSampling:
    return RowSampling([SamplingParams()] * b)


# --- greedy -----------------------------------------------------------------------------------
@pytest.mark.parametrize("verifier", [GreedyVerifier(), RejectionVerifier()], ids=["greedy", "rejection"])
def test_greedy_perfect_match_early_mismatch_and_padding(verifier):
    proposal = DraftProposal.chain(torch.tensor([[1, 2, 3], [1, 5, 3], [4, 4, 4]]), num_valid=torch.tensor([3, 3, 1]))
    logits = logits_with_argmax([[1, 2, 3, 6], [1, 2, 3, 6], [4, 4, 4, 6]])
    v = verifier.verify(proposal, logits, greedy_rows(3))
    assert v.num_accepted.tolist() == [3, 1, 1]
    assert v.tokens.tolist() == [[1, 2, 3, 6], [1, 2, -1, -1], [4, 4, -1, -1]]


def test_greedy_tree_descends_into_the_matching_child():
    # root children: node0=5, node1=2 (right); node1's children: node2=0, node3=3 (right)
    proposal = DraftProposal(torch.tensor([[5, 2, 0, 3]]), torch.tensor([[-1, -1, 1, 1]]))
    logits = logits_with_argmax([[2, 6, 3, 6, 1]])
    v = GreedyVerifier().verify(proposal, logits, greedy_rows(1))
    assert v.path[0, :2].tolist() == [1, 3]
    assert v.tokens[0].tolist()[:3] == [2, 3, 1]


def test_greedy_verifier_refuses_sampling():
    with pytest.raises(ValueError, match="temperature 0"):
        GreedyVerifier().check(RowSampling([SamplingParams(temperature=0.8)]))


def test_every_verifier_states_lossless():
    assert {n: c.lossless for n, c in VERIFIERS.items()} == {"greedy": True, "rejection": True, "typical": False,
                                                                  "block": True, "coupled": True}


# --- sampled: exact distribution of the emitted tokens -------------------------------------------
N = 6000


def _random_dists(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, V, generator=g) * 1.5).softmax(-1)


def _first_and_second(v, proposal) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Emitted token 1, token 2 (or -1) and, for token 2, the node it is conditioned on."""
    first = v.tokens[:, 0]
    second = torch.where(v.num_accepted >= 1, v.tokens[:, 1], -1)
    return first, second, v.path[:, 0]


@pytest.mark.parametrize("verifier", [RejectionVerifier(), RejectionVerifier(in_kernel_temperature=True)],
                         ids=["warped_probs", "in_kernel_temperature"])
@pytest.mark.parametrize("mode", ["chain", "iid", "without_replacement", "deterministic"])
def test_rejection_sampling_is_exact(mode, verifier):
    """Token 1 ~ p_root; token 2 given node j accepted ~ p_j. Trees: 3 root children."""
    g = torch.Generator().manual_seed(11)
    p = _random_dists(1, (V + 1,))  # p[0] at the root; p[1 + x] after root-child token x (see below)
    q_root = _random_dists(2, ())
    if mode == "chain":
        parents = [-1, 0]
    else:
        parents = [-1, -1, -1]
    n = len(parents)
    tokens = torch.zeros(N, n, dtype=torch.long)
    q = torch.zeros(N, n, V)
    removed = torch.zeros(N, V, dtype=torch.bool)
    for j, par in enumerate(parents):
        if par == -1:
            qj = q_root.expand(N, V).clone()
            if mode in ("without_replacement", "deterministic"):
                qj = qj.masked_fill(removed, 0.0)
                qj = qj / qj.sum(-1, keepdim=True)
        else:  # chain second node: q depends on its parent token
            qj = _random_dists(3, (V,))[tokens[:, par]]
        if mode == "deterministic":
            x = qj.argmax(-1)
        else:
            x = torch.multinomial(qj, 1, generator=g).squeeze(1)
        removed[torch.arange(N), x] = True
        tokens[:, j], q[:, j] = x, qj
    # target: p at root; after node j, a distribution that depends on node j's token
    logits = torch.empty(N, n + 1, V)
    logits[:, 0] = p[0].log()
    for j in range(n):
        logits[:, j + 1] = p[1 + tokens[:, j]].log()
    proposal = DraftProposal(tokens, torch.tensor(parents).expand(N, n).clone(), None if mode == "deterministic" else q)
    rows = RowSampling([SamplingParams(temperature=1.0, seed=s) for s in range(N)])
    v = verifier.verify(proposal, logits, rows)
    first, second, node = _first_and_second(v, proposal)
    pvals = [chi_square(torch.bincount(first, minlength=V), p[0])]
    for x in range(V):
        sel = (second >= 0) & (first == x)
        if int(sel.sum()) >= 300:
            pvals.append(chi_square(torch.bincount(second[sel], minlength=V), p[1 + x]))
    assert len(pvals) >= 2
    assert min(pvals) > 1e-3 / len(pvals), pvals


def test_typical_acceptance_is_detectably_lossy():
    p = _random_dists(5, ())
    x = p.argmax().item()
    tokens = torch.full((N, 1), x)
    logits = torch.stack([p.log(), p.log()]).expand(N, 2, V)
    rows = RowSampling([SamplingParams(temperature=1.0, seed=s) for s in range(N)])
    v = TypicalVerifier().verify(DraftProposal.chain(tokens), logits, rows)
    assert chi_square(torch.bincount(v.tokens[:, 0], minlength=V), p) < 1e-6


def test_typical_acceptance_walks_the_tree_by_its_threshold():
    """The shared tree walk with the typical rule: a node is accepted iff its token's target
    probability clears the threshold at its parent, whatever q and u; after a rejected sibling the
    next one is tested against the same p (no residual)."""
    # entropy ~0.76, so the threshold is eps = 0.09: tokens 0 and 1 fall below it, token 2 clears it.
    # A residual after rejecting token 0 would lift token 1 to 0.085 / 0.92 > 0.09.
    root = torch.tensor([0.08, 0.085, 0.8, 0.00875, 0.00875, 0.00875, 0.00875])
    after_2 = torch.tensor([0.02, 0.02, 0.02, 0.9, 0.02, 0.01, 0.01])
    flat = torch.full((V,), 1.0 / V)
    # root children: node 0 = token 0, node 1 = token 1, node 2 = token 2; node 3 = token 3 under node 2
    proposal = DraftProposal(torch.tensor([[0, 1, 2, 3]]), torch.tensor([[-1, -1, -1, 2]]))
    logits = torch.stack([root, flat, flat, after_2, flat]).log()[None]
    v = TypicalVerifier().verify(proposal, logits, RowSampling([SamplingParams(temperature=1.0, seed=0)]))
    assert v.path[0].tolist() == [2, 3, -1, -1] and v.num_accepted.tolist() == [2]
    assert v.tokens[0, :2].tolist() == [2, 3] and 0 <= int(v.tokens[0, 2]) < V


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 4), n=st.integers(0, 7), V=st.integers(2, 6),
       dense=st.booleans())
def test_the_argmax_walk_is_the_rejection_walk_at_temperature_zero(seed, B, n, V, dense):
    """The greedy shortcut against the specification: random trees, ties in the logits (integer
    values over a small vocabulary), drafts that often match, padding, any u and any q."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-2, 3, (B, n + 1, V), generator=g).float()
    parents = torch.stack([torch.tensor([int(torch.randint(-1, j, (), generator=g)) for j in range(n)],
                                        dtype=torch.long) for _ in range(B)]) if n else torch.zeros(B, 0, dtype=torch.long)
    tokens = torch.randint(0, V, (B, n), generator=g)
    num_valid = torch.randint(0, n + 1, (B,), generator=g)
    u = torch.rand(B, n, generator=g)
    q = torch.rand(B, n, V, generator=g).softmax(-1) if dense else None
    walk = argmax_walk(tokens, parents, num_valid, logits)
    zero = torch.zeros(B)
    for spec in (rejection_sample_reference(tokens, parents, num_valid, u, None, q, logits=logits, temperature=zero),
                 rejection_sample_reference(tokens, parents, num_valid, u, torch.ones(B, V), q,
                                            probs=warp(logits, zero, zero.long(), torch.ones(B)))):
        assert torch.equal(walk.tokens, spec.tokens), (walk.tokens, spec.tokens)
        assert torch.equal(walk.path, spec.path) and torch.equal(walk.num_accepted, spec.num_accepted)


def test_an_all_greedy_batch_reads_no_probabilities_and_draws_nothing(monkeypatch):
    """The rejection verifier hands an all-greedy batch to the argmax walk: warp() and the noise
    are never made, and the result is the greedy verifier's."""
    import specdec.sampling as sampling

    def refuse(*a, **k):
        raise AssertionError("an all-greedy batch warped or drew noise")

    monkeypatch.setattr(sampling, "warp", refuse)
    monkeypatch.setattr(RowSampling, "verify_noise", refuse)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 9, generator=g)
    miss = (logits[1, 1].argmax() + 1) % 9  # row 1: its second draft is not the target's
    tokens = torch.stack([logits[0, :3].argmax(-1), torch.stack([logits[1, 0].argmax(), miss, miss])])
    proposal = DraftProposal(tokens, torch.tensor([[-1, 0, 1]] * 2), None)
    rows = RowSampling([SamplingParams()] * 2)
    got = RejectionVerifier().verify(proposal, logits, rows)
    want = GreedyVerifier().verify(proposal, logits, rows)
    assert torch.equal(got.tokens, want.tokens) and got.num_accepted.tolist() == [3, 1]

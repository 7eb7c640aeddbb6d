"""Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025,
arXiv 2403.10444, Algorithm 2): a drafted chain verified jointly instead of token by token.

Lossless like rejection sampling, and never worse in expectation: it accepts the longest prefix
that a coupling of the whole block allows, so the expected accepted length is at least the
token-wise verifier's for every draft and target distribution (tests/test_block_verifier.py
measures both exactly). Notation, for a chain of ``m`` verified nodes ``X_1..X_m`` with target
distributions ``M_b(·|X^i)`` (block position ``i``) and draft distributions ``M_s(·|X^i)``
(``q[:, i]``), both after the same temperature / top-k / top-p:

- weights ``p_0 = 1``, ``p_i = min(1, p_{i-1} · M_b(X_i|X^{i-1}) / M_s(X_i|X^{i-1}))``;
- residual at ``i``: ``max(0, p_i · M_b(·|X^i) − M_s(·|X^i))``, of mass ``ρ_i``;
- acceptance thresholds ``h_i = ρ_i / (ρ_i + 1 − p_i)`` for ``i < m`` (1 when both are 0) and ``h_m = p_m``;
- with one uniform ``η_i`` per node, the accepted length is ``τ = max{i : η_i < h_i}`` (0 if none):
  the *last* position that passes, not the first that fails;
- the emitted token comes from the normalised residual at ``τ`` (``p_0 = 1`` makes it the usual
  ``norm(max(0, p − q))`` when nothing is accepted), or from ``M_b(·|X^m)`` when ``τ = m``.

This is the rule of vLLM's model runner V2 (``rejection_sample_method="block"``, PR #46781:
``vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py``, the ``USE_BLOCK_VERIFICATION``
branches of ``_rejection_kernel`` and ``_resample_kernel``), which we READ, not ran: cumulative
``min(log p + log M_b − log M_s, 0)``, ``h = ρ/(ρ + 1 − p)`` with ``h = 1`` at a zero denominator,
``h = p`` at the last node, ``accepted_length = i + 1`` overwritten whenever ``u ≤ h``, and the
residual scaled by ``p_τ``. An implementation that stops at the first failing position, or keeps
token-wise acceptance with the block residual, is lossy; that is what vllm-ascend #7808 fixed.
The exact enumeration test in tests/test_block_verifier.py and the conformance suite's
goodness-of-fit tests are what would catch it here.

**Drafts without q** (ngram, suffix: ``q is None``): as vLLM's V2 sampler, ``M_s`` is the point
mass on the drafted token, which block verification allows as any other draft distribution (a
deterministic draft is drawn from it): ``p_i`` is the product of the target's probabilities of
the drafts, ``ρ_i = p_i (1 − M_b(X_{i+1}|X^i))``, and the residual is ``M_b`` with ``X_{i+1}``
removed. No gain over token-wise verification is possible there (the block's best coupling is the
same product), and none is lost. (vllm-ascend instead switches block verification off without
draft probabilities, #7603, after its first version got this case wrong.)

**Trees** fall back to token-wise (recursive) rejection sampling, which is lossless for them: the
paper's algorithm is defined on one chain. The verifier warns once and counts the steps in
``tree_fallback_steps``. **Temperature-0 rows** take the argmax walk, which is what the rule above
reduces to for a one-hot ``M_b`` (``p_i`` is 1 while the drafts match the argmax and 0 after,
so ``τ`` is the matched length; tested). ``num_valid`` shortens each row's block to its first
``num_valid`` nodes. Random numbers are the rejection verifier's (:meth:`RowSampling.verify_noise`:
one uniform per node and the exponential race for the emitted token), so a seeded row's tokens do
not depend on its batch.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from specdec.kernels.rejection import argmax_walk, race
from specdec.sampling import RowSampling
from specdec.types import DraftProposal, Verification, chain_parents
from specdec.verifier import Verifier
from specdec.verifiers.greedy import greedy_walk
from specdec.verifiers.rejection import RejectionVerifier

__all__ = ["BlockVerifier", "block_thresholds", "block_residual", "block_sample", "expected_accepted"]


def block_thresholds(tokens: Tensor, num_valid: Tensor, probs: Tensor, q: Tensor | None) -> tuple[Tensor, Tensor]:
    """The weights ``p_0..p_n`` and the thresholds ``h_1..h_n`` of each row's chain.

    tokens [B, n] (in [0, V)); num_valid [B]; probs [B, n+1, V] the target's warped distributions
    (block position 0 the root); q [B, n, V] the draft's, or None (point masses on the drafts).
    Returns (weights [B, n+1], h [B, n]); ``h[:, i-1]`` is ``h_i``, 0 past a row's ``num_valid``.
    Computed in the dtype of ``probs`` (the tests enumerate in float64)."""
    B, n = tokens.shape
    dt = probs.dtype
    x = tokens.unsqueeze(-1)
    mb_x = probs[:, :n].gather(-1, x).squeeze(-1)  # M_b(X_i | X^{i-1})  [B, n]
    ms_x = torch.ones_like(mb_x) if q is None else q.to(dt).gather(-1, x).squeeze(-1)
    ratio = mb_x / ms_x.clamp(min=torch.finfo(dt).tiny)  # validated proposals have M_s(X_i) > 0
    weights = [torch.ones(B, dtype=dt, device=probs.device)]
    for i in range(n):
        weights.append(torch.clamp(weights[-1] * ratio[:, i], max=1.0))
    w = torch.stack(weights, 1)  # [B, n+1]
    if n == 0:
        return w, torch.zeros(B, 0, dtype=dt, device=probs.device)
    # ρ_i for i = 1..n-1: the residual mass one position ahead of node i
    wi = w[:, 1:n]
    if q is None:
        rho = wi * (1 - probs[:, 1:n].gather(-1, tokens[:, 1:n].unsqueeze(-1)).squeeze(-1))
    else:
        rho = (wi.unsqueeze(-1) * probs[:, 1:n] - q[:, 1:n].to(dt)).clamp(min=0).sum(-1)
    denom = rho + (1 - wi)
    h_mid = torch.where(denom > 0, rho / denom.clamp(min=torch.finfo(dt).tiny), torch.ones_like(rho))
    h = torch.cat([h_mid, w[:, n:]], 1)  # [B, n]: h_n = p_n when every node is verified
    i = torch.arange(1, n + 1, device=probs.device).unsqueeze(0)
    m = num_valid.to(probs.device).unsqueeze(1)
    h = torch.where(i == m, w[:, 1:], h)  # h_m = p_m at each row's last verified node
    return w, torch.where(i <= m, h, torch.zeros_like(h))


def block_residual(tau: Tensor, num_valid: Tensor, tokens: Tensor, probs: Tensor, q: Tensor | None,
                   weights: Tensor) -> Tensor:
    """The unnormalised distribution of the emitted token after ``tau`` [B] accepted nodes: the
    target's at ``tau`` when the whole block was accepted, else ``max(0, p_τ M_b(·|X^τ) − M_s(·|X^τ))``.
    A residual of zero mass (impossible in exact arithmetic, see the module docstring) falls back to
    ``M_b(·|X^τ)``. [B, V]"""
    B = tau.shape[0]
    rows = torch.arange(B, device=probs.device)
    mb = probs[rows, tau]  # [B, V]
    full = tau >= num_valid.to(tau.device)
    if tokens.shape[1] == 0:
        return mb
    j = tau.clamp(max=tokens.shape[1] - 1)  # the first rejected node (meaningless where full)
    if q is None:
        resid = mb.scatter(1, tokens[rows, j].unsqueeze(1), 0.0)  # p_τ cancels under normalisation
    else:
        resid = (weights[rows, tau].unsqueeze(1) * mb - q[rows, j].to(mb.dtype)).clamp(min=0)
    keep = full.unsqueeze(1) | ~(resid > 0).any(-1, keepdim=True)
    return torch.where(keep, mb, resid)


def block_sample(tokens: Tensor, num_valid: Tensor, probs: Tensor, q: Tensor | None, u: Tensor,
                 noise: Tensor) -> tuple[Tensor, Tensor]:
    """Block verification of every row's chain: (accepted length τ [B], emitted token [B]).
    u [B, n] one uniform per node; noise [B, V] Exp(1) for the race that draws the emitted token."""
    n = tokens.shape[1]
    w, h = block_thresholds(tokens, num_valid, probs, q)
    passed = u.to(h.dtype) < h  # [B, n]
    idx = torch.arange(1, n + 1, device=probs.device)
    tau = torch.where(passed, idx, torch.zeros_like(idx)).max(1).values if n else \
        torch.zeros(tokens.shape[0], dtype=torch.long, device=probs.device)
    return tau, race(block_residual(tau, num_valid, tokens, probs, q, w).float(), noise)


def expected_accepted(tokens: Tensor, num_valid: Tensor, probs: Tensor, q: Tensor | None) -> tuple[Tensor, Tensor]:
    """Exact expected accepted lengths of one step on these drafts (no random numbers drawn): under
    block verification ``Σ_i i·h_i·Π_{j>i}(1 − h_j)``, and under token-wise verification
    ``Σ_i Π_{j≤i} min(1, M_b(X_j)/M_s(X_j))``, each row's first ``num_valid`` nodes. Comparing
    the two on the same drafts removes the verifiers' own sampling noise. ([B], [B])"""
    n = tokens.shape[1]
    _, h = block_thresholds(tokens, num_valid, probs, q)
    later_fail = torch.flip(torch.cumprod(torch.flip(1 - h, [1]), 1), [1])  # Π_{j≥i}(1 − h_j)  [B, n]
    after = torch.cat([later_fail[:, 1:], torch.ones_like(h[:, :1])], 1)  # Π_{j>i}(1 − h_j)
    idx = torch.arange(1, n + 1, device=probs.device, dtype=h.dtype)
    block = (idx * h * after).sum(1)
    x = tokens.unsqueeze(-1)
    mb_x = probs[:, :n].gather(-1, x).squeeze(-1)
    ms_x = torch.ones_like(mb_x) if q is None else q.to(probs.dtype).gather(-1, x).squeeze(-1)
    ratio = (mb_x / ms_x.clamp(min=torch.finfo(probs.dtype).tiny)).clamp(max=1.0)
    valid = torch.arange(n, device=probs.device).unsqueeze(0) < num_valid.to(probs.device).unsqueeze(1)
    token_wise = torch.cumprod(torch.where(valid, ratio, torch.zeros_like(ratio)), 1).sum(1)
    return block, token_wise


def _verification(tokens: Tensor, tau: Tensor, final: Tensor) -> Verification:
    """The first ``tau`` drafts of each chain followed by ``final``."""
    B, n = tokens.shape
    idx = torch.arange(n, device=tokens.device).expand(B, n)
    accepted = idx < tau.unsqueeze(1)
    out = torch.full((B, n + 1), -1, dtype=torch.long, device=tokens.device)
    out[:, :n] = torch.where(accepted, tokens, -1)
    out[torch.arange(B, device=tokens.device), tau] = final
    return Verification(path=torch.where(accepted, idx, -1), num_accepted=tau, tokens=out)


class BlockVerifier(Verifier):
    """``compare=True`` also sums, over every sampled row of every chain step, the exact expected
    accepted lengths of block and of token-wise verification on that step's drafts
    (:func:`expected_accepted`) into ``compared = {"rows", "block", "token_wise"}``: the paired
    measurement of experiments/benchmarks/acceptance.py. It reads the device once more per step."""

    name = "block"
    lossless = True

    def __init__(self, compare: bool = False) -> None:
        self.tree_fallback_steps = 0  # steps handed to token-wise verification because the draft was a tree
        self._token_wise = RejectionVerifier()
        self.compare = compare
        self.compared = {"rows": 0, "block": 0.0, "token_wise": 0.0}

    def verify(self, proposal: DraftProposal, logits: Tensor, rows: RowSampling) -> Verification:
        if rows.all_greedy:  # temperature 0 everywhere: the argmax walk, as for rejection
            return greedy_walk(proposal, logits)
        if not _is_chain(proposal):
            self.tree_fallback_steps += 1
            if self.tree_fallback_steps == 1:
                warnings.warn("block verification is defined on chains: tree drafts are verified token-wise"
                              " (recursive rejection sampling) instead", stacklevel=2)
            return self._token_wise.verify(proposal, logits, rows)
        assert proposal.num_valid is not None
        u, noise = rows.verify_noise(proposal, logits.shape[-1])
        V = logits.shape[-1]
        tokens = proposal.tokens.clamp(0, V - 1)
        probs = rows.probs(logits)
        tau, final = block_sample(tokens, proposal.num_valid, probs, proposal.q, u, noise)
        if self.compare:
            block, token_wise = expected_accepted(tokens, proposal.num_valid, probs, proposal.q)
            sampled = ~rows.greedy_rows
            self.compared["rows"] += int(sampled.sum())
            self.compared["block"] += float(block[sampled].sum())
            self.compared["token_wise"] += float(token_wise[sampled].sum())
        out = _verification(tokens, tau, final)
        greedy = rows.greedy_rows
        if bool(greedy.any()):  # temperature-0 rows of a mixed batch: the rule's one-hot limit, exactly
            g = argmax_walk(proposal.tokens, proposal.parents, proposal.num_valid, logits)
            out = Verification(path=torch.where(greedy.unsqueeze(1), g.path, out.path),
                               num_accepted=torch.where(greedy, g.num_accepted, out.num_accepted),
                               tokens=torch.where(greedy.unsqueeze(1), g.tokens, out.tokens))
        return out


def _is_chain(proposal: DraftProposal) -> bool:
    """Whether every row's parents are a chain's (a host flag when the drafter built it with ``chain()``)."""
    if proposal.is_chain or proposal.n <= 1:
        return True
    return bool((proposal.parents == chain_parents(proposal.n, proposal.tokens.shape[0],
                                                   proposal.parents.device)).all())

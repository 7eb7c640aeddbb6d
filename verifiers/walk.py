"""The tree walk, in plain torch: the readable statement of the rule every verifier follows.

The typical verifier runs it as written. The rejection and greedy verifiers run the same walk in
:mod:`specdec.kernels.rejection` (a fused kernel and its torch reference), which keeps the
distribution unnormalised and draws the emitted token by an exponential race instead of the
inverse CDF used here.

Nodes are visited in index order (parents before children, siblings in the order they were
drawn). A row tests node ``j`` only if ``j``'s parent is the row's current node. On acceptance
the row descends to ``j`` and its target distribution becomes the target's at ``j``; on
rejection the distribution becomes the residual ``norm(max(0, p - q_j))`` (recursive rejection
sampling, Jeon et al. 2024, "Recursive Speculative Decoding"), which is exactly lossless when
``q_j`` is the distribution ``j`` was drawn from given its parent and earlier siblings: the same q
for i.i.d. siblings, renormalised for siblings drawn without replacement, one-hot for
deterministic ones. A chain is the special case with one child per node, where the rule is the
standard speculative-sampling rule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from specdec.sampling import sample_from
from specdec.types import DraftProposal, Verification

__all__ = ["walk", "AcceptRule"]

# accept(dist [B, V], x [B], qx [B], u [B]) -> bool [B]
AcceptRule = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def rejection_accept(dist: Tensor, x: Tensor, qx: Tensor, u: Tensor) -> Tensor:
    """Accept with probability min(1, p(x) / q(x)), written without a division."""
    px = dist.gather(1, x.unsqueeze(1)).squeeze(1)
    return u * qx < px


def walk(p: Tensor, proposal: DraftProposal, u: Tensor, u_final: Tensor,
         accept: AcceptRule = rejection_accept, residual: bool = True) -> Verification:
    """p [B, n+1, V] target probabilities (root first); u [B, n] one uniform per node;
    u_final [B] samples the emitted token. Returns the accepted path and the emitted tokens."""
    B, n = proposal.tokens.shape
    assert proposal.num_valid is not None
    rows = torch.arange(B, device=p.device)
    cur = torch.full((B,), -1, dtype=torch.long, device=p.device)
    dist = p[:, 0]
    path = torch.full((B, n), -1, dtype=torch.long, device=p.device)
    acc = torch.zeros(B, dtype=torch.long, device=p.device)
    for j in range(n):
        cand = (proposal.parents[:, j] == cur) & (proposal.num_valid > j)
        if not bool(cand.any()):
            continue
        x = proposal.tokens[:, j]
        if proposal.q is None:
            qj = torch.zeros_like(dist).scatter_(1, x.unsqueeze(1), 1.0)
        else:
            qj = proposal.q[:, j].float()
        qx = qj.gather(1, x.unsqueeze(1)).squeeze(1)
        ok = cand & accept(dist, x, qx, u[:, j].to(dist.dtype))
        rejected = cand & ~ok
        if residual and bool(rejected.any()):
            resid = (dist - qj).clamp(min=0)
            mass = resid.sum(-1, keepdim=True)
            # mass == 0 only if p == q, where acceptance is certain: reachable by rounding alone.
            resid = torch.where(mass > 0, resid / mass.clamp(min=1e-30), dist)
            dist = torch.where(rejected.unsqueeze(1), resid, dist)
        dist = torch.where(ok.unsqueeze(1), p[:, j + 1], dist)
        path[rows[ok], acc[ok]] = j
        acc = acc + ok.long()
        cur = torch.where(ok, j, cur)
    final = sample_from(dist, u_final)
    tokens = torch.full((B, n + 1), -1, dtype=torch.long, device=p.device)
    if n:
        accepted_tokens = proposal.tokens.gather(1, path.clamp(min=0))
        tokens[:, :n] = torch.where(path >= 0, accepted_tokens, -1)
    tokens[rows, acc] = final
    return Verification(path=path, num_accepted=acc, tokens=tokens)

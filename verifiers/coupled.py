"""Coupled verification: the randomness of output position ``t`` is keyed by ``(seed, t)``, shared
by drafter and target, so a seeded request emits exactly the tokens of plain seeded sampling.

**The rule.** Row ``b``'s token at output position ``t`` is the exponential race (Gumbel-max)
``y_t = argmax_i p_t(i) / E_t(i)`` on noise ``E_t ~ Exp(1)^V`` drawn from ``(key_b, t)``
(:meth:`specdec.sampling.RowSampling.keyed_noise`; the key is the request's seed, or fresh entropy
when it set none). A step computes ``y`` at the root and at every draft node (a node at depth
``d`` reads the noise of position ``t0 + d``, ``t0`` the root's), then walks the proposal as greedy
verification walks it with ``y`` in place of the argmax: a draft is accepted iff it equals its
parent's ``y``, and the walk emits ``y`` where it stops (the bonus after a fully accepted draft,
the target's own choice at the first mismatch).

**Lossless, and pinned.** Every emitted token is ``y_t`` computed from the target's distribution
given the tokens emitted before it: the drafts only decide how many positions one step settles,
never which token a position gets. So the output is a fixed function of the noise ``(E_t)_t``,
whatever the drafter, ``k``, policy or batch, and since ``E_t`` is ``Exp(1)`` noise independent of
the prefix, ``y_t`` is an exact sample of ``p_t`` (the exponential race). With ``drafter=None`` the
rule is plain sampling; a seeded row's ``E_t`` is the noise the ``rejection`` verifier draws at
step ``t`` of plain decoding, so its tokens are exactly ``rejection``'s plain seeded sampling.
This holds for any proposal, however it was drawn, so the verifier needs nothing from a drafter to
be lossless.

**What drafters give for acceptance.** A draft is accepted only where it equals the target's
race, so drafts should race on the same noise: a draft at depth ``d`` is
``argmax_i q(i) / E_{t0+d-1}(i)``. :meth:`RowSampling.draw` and :meth:`RowSampling.sample` do this
under this verifier (it keys the rows in :meth:`check`) for chains drawn one position per call or
one block at a time: then a draft is accepted with probability ``Σ_i min(p_i, q_i)``-like overlap
of the two races, and always where ``q = p``. Drafters that draw from their own uniforms (tree
siblings, DSpark's Markov walk, n-gram and other deterministic drafts) stay lossless under it,
with lower acceptance: a sampled draft then agrees with the target's race only by chance.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.kernels.rejection import argmax_walk
from specdec.sampling import RowSampling, argmax
from specdec.types import DraftProposal, Verification, node_depths
from specdec.verifier import Verifier

__all__ = ["CoupledVerifier"]


class CoupledVerifier(Verifier):
    name = "coupled"
    lossless = True

    def check(self, rows: RowSampling) -> None:
        """Keys the rows' random numbers by output position (drafter and verifier share them)."""
        rows.key_by_position()

    def verify(self, proposal: DraftProposal, logits: Tensor, rows: RowSampling) -> Verification:
        if not rows.keyed:
            raise ValueError("the coupled verifier needs rows keyed by position: call check(rows) first"
                             " (specdec.loop.run does)")
        B, n = proposal.tokens.shape
        V = logits.shape[-1]
        depth = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=logits.device),
                           node_depths(proposal.parents).to(logits.device)], 1)  # [B, n+1], root 0
        if rows.all_greedy:
            choice = argmax(logits)  # [B, n+1]
        else:
            probs = rows.probs(logits)  # [B, n+1, V]
            noise = torch.stack([rows.keyed_noise(d, V) for d in range(int(depth.max()) + 1)], 1)
            noise = noise.gather(1, depth.unsqueeze(-1).expand(-1, -1, V))
            choice = argmax(torch.where(probs > 0, probs / noise, torch.full_like(noise, -1.0)))
        best = torch.zeros(B, n + 1, V, dtype=torch.float32, device=logits.device).scatter_(-1, choice.unsqueeze(-1), 1.0)
        ver = argmax_walk(proposal.tokens, proposal.parents, proposal.num_valid, best)
        rows.advance((ver.num_accepted + 1).tolist())
        return ver

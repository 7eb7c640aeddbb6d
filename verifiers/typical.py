"""Typical acceptance (Medusa, Cai et al. 2024, arXiv 2401.10774). **Lossy.**

A node is accepted when the target gives it probability above min(eps, alpha * exp(-H(p)))
at its parent, whatever the draft's q; a rejection leaves p as it was (no residual), and the
emitted token after the accepted path is sampled from p. The walk is the rejection verifier's
(:func:`specdec.kernels.rejection.tree_walk`) with this acceptance rule. Output is *not*
distributed as the target's: kept only to measure what relaxed acceptance buys, and used by the
tests to show that the goodness-of-fit suite catches a lossy verifier.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.kernels.rejection import tree_walk
from specdec.sampling import RowSampling, sample_from
from specdec.types import DraftProposal, Verification
from specdec.verifier import Verifier

__all__ = ["TypicalVerifier"]


class TypicalVerifier(Verifier):
    name = "typical"
    lossless = False

    def __init__(self, eps: float = 0.09, alpha: float = 0.3):
        self.eps, self.alpha = eps, alpha

    def _accept(self, r: Tensor, mass: Tensor, x: Tensor, qx: Tensor, u: Tensor) -> Tensor:
        """p(x) above the entropy-dependent threshold, p = r / mass [B, V]; q and u unused."""
        p = r / mass.unsqueeze(1)
        entropy = -(p * p.clamp(min=1e-30).log()).sum(-1)
        threshold = torch.minimum(torch.full_like(entropy, self.eps), self.alpha * torch.exp(-entropy))
        return p.gather(1, x.unsqueeze(1)).squeeze(1) > threshold

    def verify(self, proposal: DraftProposal, logits: Tensor, rows: RowSampling) -> Verification:
        assert proposal.num_valid is not None
        p = rows.probs(logits)  # [B, n+1, V]
        u, u_final = rows.verify_uniforms(proposal)
        w = tree_walk(proposal.tokens, proposal.parents, proposal.num_valid, p, p.new_ones(p.shape[:2]), u,
                      proposal.q, accept=self._accept, residual=False)
        return w.verification(sample_from(w.r, u_final))

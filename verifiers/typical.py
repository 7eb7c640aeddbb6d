"""Typical acceptance (Medusa, Cai et al. 2024, arXiv 2401.10774). **Lossy.**

A node is accepted when the target gives it probability above min(eps, alpha * exp(-H(p))),
whatever the draft's q; the emitted token after the accepted path is sampled from p. Output is
*not* distributed as the target's: kept only to measure what relaxed acceptance buys, and used
by the tests to show that the goodness-of-fit suite catches a lossy verifier.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.sampling import RowSampling
from specdec.types import DraftProposal, Verification
from specdec.verifier import Verifier
from specdec.verifiers.walk import walk

__all__ = ["TypicalVerifier"]


class TypicalVerifier(Verifier):
    name = "typical"
    lossless = False

    def __init__(self, eps: float = 0.09, alpha: float = 0.3):
        self.eps, self.alpha = eps, alpha

    def _accept(self, dist: Tensor, x: Tensor, qx: Tensor, u: Tensor) -> Tensor:
        entropy = -(dist * dist.clamp(min=1e-30).log()).sum(-1)
        threshold = torch.minimum(torch.full_like(entropy, self.eps), self.alpha * torch.exp(-entropy))
        return dist.gather(1, x.unsqueeze(1)).squeeze(1) > threshold

    def verify(self, proposal: DraftProposal, logits: Tensor, rows: RowSampling) -> Verification:
        p = rows.probs(logits)
        u, u_final = rows.verify_uniforms(proposal)
        return walk(p, proposal, u, u_final, accept=self._accept, residual=False)

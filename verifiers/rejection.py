"""Lossless speculative sampling for chains and trees.

Chains: accept draft x with probability min(1, p(x)/q(x)); at the first rejection emit a token
from norm(max(0, p - q)); if every draft is accepted emit a bonus token from p (Leviathan et
al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318). Trees: recursive rejection
sampling over each node's children (see :mod:`specdec.verifiers.walk`). p and q are both after
the request's temperature / top-k / top-p; temperature-0 rows reduce to exact argmax matching.
"""

from __future__ import annotations

from torch import Tensor

from specdec.sampling import RowSampling
from specdec.types import DraftProposal, Verification
from specdec.verifier import Verifier
from specdec.verifiers.walk import walk

__all__ = ["RejectionVerifier"]


class RejectionVerifier(Verifier):
    name = "rejection"
    lossless = True

    def verify(self, proposal: DraftProposal, logits: Tensor, rows: RowSampling) -> Verification:
        p = rows.probs(logits)
        u, u_final = rows.verify_uniforms(proposal)
        return walk(p, proposal, u, u_final)

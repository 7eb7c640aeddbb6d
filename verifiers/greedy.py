"""Greedy verification: accept a node iff it is the target's argmax; emit the argmax after.

Uses no random numbers. Lossless for temperature 0 only, so it refuses sampled requests. The walk
runs in :func:`specdec.kernels.rejection_sample` on the raw logits at temperature 0: the argmax
is taken in the kernel and no probabilities are formed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.kernels.rejection import rejection_sample
from specdec.sampling import RowSampling
from specdec.types import DraftProposal, Verification
from specdec.verifier import Verifier

__all__ = ["GreedyVerifier", "greedy_walk"]


class GreedyVerifier(Verifier):
    name = "greedy"
    lossless = True

    def check(self, rows: RowSampling) -> None:
        if not rows.all_greedy:
            raise ValueError("the greedy verifier is lossless only at temperature 0; use 'rejection' for sampling")

    def verify(self, proposal: DraftProposal, logits: Tensor, rows: RowSampling) -> Verification:
        return greedy_walk(proposal, logits)


def greedy_walk(proposal: DraftProposal, logits: Tensor) -> Verification:
    """The walk at temperature 0 on the raw logits: no uniforms, no noise, no q (the rejection
    verifier takes it too when every row is greedy)."""
    B = logits.shape[0]
    u = torch.zeros(B, proposal.n, dtype=torch.float32, device=logits.device)
    zero = torch.zeros(B, dtype=torch.float32, device=logits.device)
    return rejection_sample(proposal.tokens, proposal.parents, proposal.num_valid, u, None, None,
                            logits=logits, temperature=zero)

"""Greedy verification: accept a node iff it is the target's argmax; emit the argmax after.

Uses no random numbers. Lossless for temperature 0 only, so it refuses sampled requests.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.sampling import RowSampling
from specdec.types import DraftProposal, Verification
from specdec.verifier import Verifier
from specdec.verifiers.walk import walk

__all__ = ["GreedyVerifier"]


class GreedyVerifier(Verifier):
    name = "greedy"
    lossless = True

    def check(self, rows: RowSampling) -> None:
        if not rows.all_greedy:
            raise ValueError("the greedy verifier is lossless only at temperature 0; use 'rejection' for sampling")

    def verify(self, proposal: DraftProposal, logits: Tensor, rows: RowSampling) -> Verification:
        p = torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        u = torch.zeros(logits.shape[0], proposal.n + 1, dtype=torch.float64, device=logits.device)
        return walk(p, proposal, u[:, :-1], u[:, -1])

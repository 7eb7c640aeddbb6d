"""Lossless speculative sampling for chains and trees.

Chains: accept draft x with probability min(1, p(x)/q(x)); at the first rejection emit a token
from norm(max(0, p - q)); if every draft is accepted emit a bonus token from p (Leviathan et
al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318). Trees: recursive rejection
sampling over each node's children (see :func:`specdec.kernels.rejection.tree_walk`). p and q are
both after the request's temperature / top-k / top-p; temperature-0 rows reduce to exact argmax
matching.

The walk runs in :func:`specdec.kernels.rejection_sample` (a fused Triton kernel on a GPU, its
torch reference elsewhere); the emitted token is drawn by an exponential race. By default the
target's probabilities come from :func:`specdec.sampling.warp`, exact for every sampling
setting. ``in_kernel_temperature=True`` hands the kernel raw logits and temperatures instead
when no row uses top-k or top-p, so the probabilities are never written to memory; it is the
same distribution, but its normaliser is summed in the kernel's order, so it is not bit-for-bit
the warped path, and which path a step takes depends on every row's settings. A batch whose rows
are all greedy takes the logits path at temperature 0 (no probabilities, no noise): argmax
matching, identical to the warped one-hot by construction.
"""

from __future__ import annotations

from torch import Tensor

from specdec.kernels.rejection import rejection_sample
from specdec.sampling import RowSampling
from specdec.types import DraftProposal, Verification
from specdec.verifier import Verifier
from specdec.verifiers.greedy import greedy_walk

__all__ = ["RejectionVerifier"]


class RejectionVerifier(Verifier):
    name = "rejection"
    lossless = True

    def __init__(self, in_kernel_temperature: bool = False):
        self.in_kernel_temperature = in_kernel_temperature

    def verify(self, proposal: DraftProposal, logits: Tensor, rows: RowSampling) -> Verification:
        if rows.all_greedy:  # temperature 0 everywhere: the walk is argmax matching, q and uniforms play no part
            return greedy_walk(proposal, logits)
        u, noise = rows.verify_noise(proposal, logits.shape[-1])
        args = (proposal.tokens, proposal.parents, proposal.num_valid, u, noise, proposal.q)
        if self.in_kernel_temperature and not (rows.uses_top_k or rows.uses_top_p):
            return rejection_sample(*args, logits=logits, temperature=rows.temperature)
        return rejection_sample(*args, probs=rows.probs(logits))

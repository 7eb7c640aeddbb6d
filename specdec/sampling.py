"""Sampling parameters and the one function that turns logits into probabilities.

Target and drafter must warp logits identically (temperature, then top-k, then top-p), or
rejection sampling verifies against the wrong distribution. Both sides call :func:`warp`.
Temperature 0 means greedy: the "distribution" is one-hot on the argmax (first index on ties),
so the lossless rejection rule reduces to exact argmax matching.

Every row has two seeded generators, one for the drafter and one for the verifier, so a row's
tokens do not depend on the other rows of its batch or on how much the drafter drew.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.types import DraftProposal
from specdec.validate import as_float, as_int

__all__ = ["SamplingParams", "RowSampling", "warp", "sample_from"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None = fresh entropy

    def __post_init__(self) -> None:
        # normalised through the one validation place: numpy/tensor scalars become Python numbers
        object.__setattr__(self, "temperature", as_float("temperature", self.temperature, minimum=0.0))
        object.__setattr__(self, "top_k", as_int("top_k (0 = off)", self.top_k, minimum=0))
        object.__setattr__(self, "top_p", as_float("top_p", self.top_p, minimum=0.0, maximum=1.0, open_minimum=True))
        if self.seed is not None:
            object.__setattr__(self, "seed", as_int("seed", self.seed, minimum=0, maximum=(1 << 63) - 1))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Probabilities after temperature, top-k and top-p, per row.

    logits [B, ..., V]; temperature, top_k, top_p [B]. Returns float32 [B, ..., V].
    Rows with temperature 0 get the one-hot argmax. Ties at the top-k or top-p boundary are all
    kept, so the result is a deterministic function of the logits on both sides.
    """
    logits = logits.float()
    B, V = logits.shape[0], logits.shape[-1]
    view = (B,) + (1,) * (logits.dim() - 1)
    greedy = (temperature == 0).view(view)
    one_hot = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if bool(greedy.all()):
        return one_hot
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).view(view).float()
    scaled = logits / t
    keep = torch.ones_like(scaled, dtype=torch.bool)
    use_top_k, use_top_p = bool((top_k > 0).any()), bool((top_p < 1).any())
    if use_top_k or use_top_p:
        sorted_logits = scaled.sort(dim=-1, descending=True).values
        k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V)).view(view)
        kth = sorted_logits.gather(-1, (k - 1).expand(*scaled.shape[:-1], 1))
        keep = scaled >= kth
        if use_top_p:
            # on the top-k-filtered distribution: keep the smallest prefix with mass >= top_p
            sorted_kept = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
            sorted_probs = sorted_kept.softmax(-1)
            mass_before = sorted_probs.cumsum(-1) - sorted_probs
            n_keep = (mass_before < top_p.view(view).float()).sum(-1, keepdim=True).clamp(min=1)
            keep = keep & (scaled >= sorted_kept.gather(-1, n_keep - 1))
    probs = scaled.masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.where(greedy, one_hot, probs)


def sample_from(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sample: one token per distribution from one uniform in [0, 1).

    probs [..., V] (need not be normalised), u [...] → int64 [...]. A zero-probability token is
    never returned.
    """
    cdf = probs.double().cumsum(-1)  # float64: the CDF of a 150k vocabulary stays exact enough
    target = (u.double() * cdf[..., -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)
    last_positive = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.minimum(idx, last_positive)


class RowSampling:
    """Per-row sampling parameters as tensors, and per-row seeded generators."""

    def __init__(self, params: list[SamplingParams], device: torch.device | str = "cpu"):
        if not params:
            raise ValueError("at least one request is needed")
        self.params = params
        self.device = torch.device(device)
        self.temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        self.top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        self.seeds = [p.seed if p.seed is not None else secrets.randbits(62) for p in params]
        self._verify = [torch.Generator().manual_seed(s) for s in self.seeds]
        self._draft = [torch.Generator().manual_seed(s ^ 0x5EED_D4AF7) for s in self.seeds]

    @property
    def batch(self) -> int:
        return len(self.params)

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())

    def probs(self, logits: Tensor) -> Tensor:
        """Warped target or draft probabilities for every row. [B, ..., V]"""
        return warp(logits, self.temperature, self.top_k, self.top_p)

    def select(self, rows: Tensor) -> RowSampling:
        """The same rows' parameters and generators (shared, not copied) for a sub-batch."""
        sub = RowSampling.__new__(RowSampling)
        idx = rows.tolist()
        sub.params = [self.params[i] for i in idx]
        sub.device = self.device
        sub.temperature, sub.top_k, sub.top_p = self.temperature[rows], self.top_k[rows], self.top_p[rows]
        sub.seeds = [self.seeds[i] for i in idx]
        sub._verify = [self._verify[i] for i in idx]
        sub._draft = [self._draft[i] for i in idx]
        return sub

    def verify_uniforms(self, proposal: DraftProposal) -> tuple[Tensor, Tensor]:
        """One uniform per valid node and one for the emitted token, from each row's verifier
        generator. Each row draws ``num_valid + 1`` numbers, a count that depends on that row
        alone, so a row's tokens never depend on its batch. Returns ([B, n], [B])."""
        assert proposal.num_valid is not None
        B, n = proposal.tokens.shape
        u = torch.zeros(B, n, dtype=torch.float64)
        u_final = torch.zeros(B, dtype=torch.float64)
        for b, (g, c) in enumerate(zip(self._verify, proposal.num_valid.tolist())):
            draw = torch.rand(c + 1, generator=g, dtype=torch.float64)
            u[b, :c], u_final[b] = draw[:c], draw[c]
        return u.to(self.device), u_final.to(self.device)

    def verify_noise(self, proposal: DraftProposal, vocab_size: int) -> tuple[Tensor, Tensor]:
        """The random numbers of the exponential-race verifier, from each row's verifier
        generator: one uniform per valid node, then one seed for the row's ``Exp(1)`` noise over
        the vocabulary, drawn on the device by a generator seeded with it (``V`` numbers per row
        would be slow to draw on the host). Greedy rows draw nothing and get noise 1 (their race
        is an argmax). Counts depend on the row alone, so a row never depends on its batch.
        Returns (u [B, n] float32, noise [B, V] float32)."""
        assert proposal.num_valid is not None
        B, n = proposal.tokens.shape
        u = torch.zeros(B, n, dtype=torch.float64)
        noise = torch.ones(B, vocab_size, dtype=torch.float32, device=self.device)
        greedy = (self.temperature == 0).tolist()
        for b, (g, c) in enumerate(zip(self._verify, proposal.num_valid.tolist())):
            if greedy[b]:
                continue
            u[b, :c] = torch.rand(c, generator=g, dtype=torch.float64)
            seed = int(torch.randint(0, 2**62, (1,), generator=g))
            noise[b].exponential_(generator=torch.Generator(device=self.device).manual_seed(seed))
        return u.float().to(self.device), noise

    def draft_uniform(self, *shape: int) -> Tensor:
        """Uniforms in [0, 1) from each row's drafter generator. [B, *shape]"""
        return self._uniform(self._draft, shape)

    def _uniform(self, gens: list[torch.Generator], shape: tuple[int, ...]) -> Tensor:
        u = torch.stack([torch.rand(shape, generator=g, dtype=torch.float64) for g in gens])
        return u.to(self.device)

    def sample(self, probs: Tensor) -> Tensor:
        """Draw one token per row from the drafter generators. probs [B, V] → [B]"""
        return sample_from(probs, self.draft_uniform())

    def draw(self, logits: Tensor, greedy: bool = False) -> tuple[Tensor, Tensor | None]:
        """Draft tokens from draft logits [B, ..., V] (one per row, or one per position of a
        block drafted at once) and the q they were drawn from: samples of the warped distribution,
        or the argmaxes with q None (deterministic) when ``greedy``. Returns ([B, ...], q | None)."""
        if greedy:
            return logits.argmax(-1), None
        q = self.probs(logits)
        return sample_from(q, self.draft_uniform(*q.shape[1:-1])), q

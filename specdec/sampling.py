"""Sampling parameters and the one function that turns logits into probabilities.

Target and drafter must warp logits identically (temperature, then top-k, then top-p), or
rejection sampling verifies against the wrong distribution. Both sides call :func:`warp`.
Temperature 0 means greedy: the "distribution" is one-hot on the argmax (first index on ties),
so the lossless rejection rule reduces to exact argmax matching.

Random numbers are drawn on the device, batched: rows without a seed share one generator and
draw in one call; a row that sets a seed has its own generators (one for the drafter, one for the
verifier), so its tokens do not depend on the other rows of its batch or on how much the drafter
drew (:class:`RowSampling`). Under the ``coupled`` verifier the rows' numbers are keyed by output
position instead (:meth:`RowSampling.key_by_position`), shared by drafter and verifier.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.types import DraftProposal
from specdec.validate import as_float, as_int

__all__ = ["SamplingParams", "RowSampling", "argmax", "warp", "sample_from"]


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


def argmax(x: Tensor) -> Tensor:
    """``x.argmax(-1)``: the first index of the maximum on ties, as both document. On a CPU
    ``max(dim)`` is vectorised and ``argmax`` is not, a 3x difference over a 49k vocabulary
    that every verification step reads."""
    return x.max(-1).indices


def warp(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, *, all_greedy: bool | None = None,
         use_top_k: bool | None = None, use_top_p: bool | None = None) -> Tensor:
    """Probabilities after temperature, top-k and top-p, per row.

    logits [B, ..., V]; temperature, top_k, top_p [B]. Returns float32 [B, ..., V].
    Rows with temperature 0 get the one-hot argmax. Ties at the top-k or top-p boundary are all
    kept, so the result is a deterministic function of the logits on both sides.
    ``all_greedy`` / ``use_top_k`` / ``use_top_p``: the same facts as host flags
    (:meth:`RowSampling.probs` passes them), which skip reading them back from the device.
    """
    logits = logits.float()
    B, V = logits.shape[0], logits.shape[-1]
    view = (B,) + (1,) * (logits.dim() - 1)
    greedy = (temperature == 0).view(view)
    one_hot = torch.zeros_like(logits).scatter_(-1, argmax(logits).unsqueeze(-1), 1.0)
    if bool(greedy.all()) if all_greedy is None else all_greedy:
        return one_hot
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).view(view).float()
    scaled = logits / t
    keep = torch.ones_like(scaled, dtype=torch.bool)
    use_top_k = bool((top_k > 0).any()) if use_top_k is None else use_top_k
    use_top_p = bool((top_p < 1).any()) if use_top_p is None else use_top_p
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


def _uniform(x: Tensor, g: torch.Generator) -> None:
    x.uniform_(generator=g)


def _exponential(x: Tensor, g: torch.Generator) -> None:
    x.exponential_(generator=g)


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


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64's finaliser over each in turn): per-step seeds of a
    seeded row, made on the host."""
    h = 0
    for v in values:
        h = (h ^ v) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h >> 1


class _Seeded:
    """The random state of one row that set a seed: a persistent drafter generator and a verifier
    generator re-seeded from ``(seed, step)`` every verification, so the numbers a step draws
    never shift the next step's (a row's step count is its own, whatever its batch)."""

    def __init__(self, seed: int, device: torch.device):
        self.seed, self.step = seed, 0
        self.draft = torch.Generator(device).manual_seed(seed ^ 0x5EED_D4AF7)
        self.verify = torch.Generator(device)

    def verify_stream(self, stream: int) -> torch.Generator:
        """The verifier generator for this step's ``stream`` (0 uniforms, 1 noise, 2 final uniform)."""
        return self.verify.manual_seed(_mix(self.seed, self.step, stream))


class _Keyed:
    """The random state of one row under position-keyed noise (:meth:`RowSampling.key_by_position`,
    the ``coupled`` verifier): the row's key (its seed, or fresh entropy when it set none), how many
    tokens it has emitted, the noise of the positions this step has read, and how many positions
    the drafter has drawn this step."""

    def __init__(self, key: int):
        self.key, self.emitted, self.drawn = key, 0, 0
        self.cache: dict[int, Tensor] = {}  # position -> Exp(1) noise [V]


class RowSampling:
    """Per-row sampling parameters as tensors (and as host flags, so no step reads them back),
    and the rows' random numbers, drawn on the device.

    Rows without a seed draw together, in one call per tensor, from one generator seeded from
    fresh entropy; a row that sets a seed draws from its own generators (the only per-row loop,
    as vLLM v1 does), so its tokens do not depend on its batch.
    """

    def __init__(self, params: list[SamplingParams], device: torch.device | str = "cpu"):
        if not params:
            raise ValueError("at least one request is needed")
        self.params = params
        self.device = torch.device(device)
        self.temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        self.top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        self.greedy_rows = self.temperature == 0  # [B] bool
        self._seeded = [None if p.seed is None else _Seeded(p.seed, self.device) for p in params]
        self._shared = torch.Generator(self.device).manual_seed(secrets.randbits(62))  # the unseeded rows'
        self._keyed: list[_Keyed] | None = None  # position-keyed noise, once key_by_position() is called

    @property
    def batch(self) -> int:
        return len(self.params)

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    @property
    def uses_top_k(self) -> bool:
        return any(p.top_k > 0 for p in self.params)

    @property
    def uses_top_p(self) -> bool:
        return any(p.top_p < 1 for p in self.params)

    def probs(self, logits: Tensor) -> Tensor:
        """Warped target or draft probabilities for every row. [B, ..., V]"""
        return warp(logits, self.temperature, self.top_k, self.top_p, all_greedy=self.all_greedy,
                    use_top_k=self.uses_top_k, use_top_p=self.uses_top_p)

    def select(self, rows: Tensor | list[int]) -> RowSampling:
        """The same rows' parameters and generators (shared, not copied) for a sub-batch."""
        sub = RowSampling.__new__(RowSampling)
        idx = rows if isinstance(rows, list) else rows.tolist()
        sub.params = [self.params[i] for i in idx]
        sub.device, sub._shared = self.device, self._shared
        rows = torch.tensor(idx, dtype=torch.long, device=self.device)
        sub.temperature, sub.top_k, sub.top_p = self.temperature[rows], self.top_k[rows], self.top_p[rows]
        sub.greedy_rows = self.greedy_rows[rows]
        sub._seeded = [self._seeded[i] for i in idx]
        sub._keyed = None if self._keyed is None else [self._keyed[i] for i in idx]
        return sub

    def joined(self, other: RowSampling) -> RowSampling:
        """These rows, then ``other``'s (requests admitted into a running batch). Each row keeps its
        own generators, so a seeded row's tokens stay what they are in any batch; unseeded rows
        draw from this batch's shared generator. Both sides keyed by position, or neither."""
        if (self._keyed is None) != (other._keyed is None):
            raise ValueError("joined(): one side's noise is keyed by position and the other's is not")
        sub = RowSampling.__new__(RowSampling)
        sub.params, sub.device, sub._shared = self.params + other.params, self.device, self._shared
        other_dev = {k: getattr(other, k).to(self.device) for k in ("temperature", "top_k", "top_p", "greedy_rows")}
        for k, v in other_dev.items():
            setattr(sub, k, torch.cat([getattr(self, k), v]))
        sub._seeded = self._seeded + other._seeded
        sub._keyed = None if self._keyed is None else self._keyed + other._keyed
        return sub

    def _draw(self, shape: tuple[int, ...], fill: Callable[[Tensor, torch.Generator], None], stream: int | None,
              dtype: torch.dtype = torch.float64) -> Tensor:
        """[B, *shape] from ``fill(tensor, generator)``: one call for every unseeded row, then one
        per seeded row from its own generator (the verifier's ``stream`` of this step, or the
        drafter's generator when ``stream`` is None)."""
        out = torch.empty(self.batch, *shape, dtype=dtype, device=self.device)
        if any(s is None for s in self._seeded):
            fill(out, self._shared)
        for b, s in enumerate(self._seeded):
            if s is not None:
                fill(out[b], s.draft if stream is None else s.verify_stream(stream))
        return out

    def _end_step(self) -> None:
        for s in self._seeded:
            if s is not None:
                s.step += 1

    def verify_uniforms(self, proposal: DraftProposal) -> tuple[Tensor, Tensor]:
        """One uniform per node and one for the emitted token. A seeded row draws them from
        generators seeded by ``(seed, step)``, in index order, so node ``j`` gets the same number
        whatever the block's width: a row's tokens never depend on its batch. Returns ([B, n], [B])."""
        n = proposal.tokens.shape[1]
        u = self._draw((n,), _uniform, 0)
        u_final = self._draw((), _uniform, 2)
        self._end_step()
        return u, u_final

    def verify_noise(self, proposal: DraftProposal, vocab_size: int) -> tuple[Tensor, Tensor]:
        """The random numbers of the exponential-race verifier: one uniform per node and the
        row's ``Exp(1)`` noise over the vocabulary, drawn on the device (seeded rows as in
        :meth:`verify_uniforms`). Greedy rows get noise 1 (their race is an argmax); an all-greedy
        batch draws nothing. Returns (u [B, n] float32, noise [B, V] float32)."""
        B, n = proposal.tokens.shape
        if self.all_greedy:
            return (torch.zeros(B, n, dtype=torch.float32, device=self.device),
                    torch.ones(B, vocab_size, dtype=torch.float32, device=self.device))
        noise = self._draw((vocab_size,), _exponential, 1, torch.float32)
        u = self._draw((n,), _uniform, 0).float()
        self._end_step()
        return u, torch.where(self.greedy_rows.unsqueeze(1), 1.0, noise)

    # --- position-keyed noise (the coupled verifier) ----------------------------------------------
    def key_by_position(self) -> None:
        """Key every row's random numbers by its output position: the token at position ``t`` of
        a row is ``argmax_i p_i / E_i`` with ``E ~ Exp(1)^V`` drawn from ``(key, t)`` (the key is
        the row's seed, or fresh entropy), and a drafter's chain draws (:meth:`draw`,
        :meth:`sample`) race on the same noise. A seeded row's ``E`` at position ``t`` is what the
        ``rejection`` verifier draws at step ``t`` of plain decoding, so both sample the same tokens."""
        if self._keyed is None:
            self._keyed = [_Keyed(p.seed if p.seed is not None else secrets.randbits(62)) for p in self.params]

    @property
    def keyed(self) -> bool:
        return self._keyed is not None

    def keyed_noise(self, offset: int, vocab_size: int) -> Tensor:
        """``Exp(1)`` noise [B, V] float32 of each row's position ``emitted + offset`` (1 for
        greedy rows: their race is the argmax), drawn once per step and position."""
        assert self._keyed is not None, "key_by_position() first"
        out = torch.ones(self.batch, vocab_size, dtype=torch.float32, device=self.device)
        for b, (kd, p) in enumerate(zip(self._keyed, self.params)):
            if p.greedy:
                continue
            t = kd.emitted + offset
            if t not in kd.cache:
                g = torch.Generator(self.device).manual_seed(_mix(kd.key, t, 1))
                kd.cache[t] = torch.empty(vocab_size, dtype=torch.float32, device=self.device).exponential_(generator=g)
            out[b] = kd.cache[t]
        return out

    def advance(self, num_emitted: list[int]) -> None:
        """After a keyed verification: each row's position moves past the tokens it emitted."""
        assert self._keyed is not None
        for kd, n in zip(self._keyed, num_emitted):
            kd.emitted, kd.drawn = kd.emitted + n, 0
            kd.cache.clear()

    def _keyed_draw(self, probs: Tensor) -> Tensor:
        """Draft tokens [B] or [B, m] from probs [B, V] (the next position drafted this step) or
        [B, m, V] (m positions at once): the race on each position's keyed noise."""
        assert self._keyed is not None
        block = probs.dim() == 3
        p = probs if block else probs.unsqueeze(1)
        start = self._keyed[0].drawn if self._keyed else 0
        noise = torch.stack([self.keyed_noise(start + i, p.shape[-1]) for i in range(p.shape[1])], 1)
        for kd in self._keyed:
            kd.drawn += p.shape[1]
        x = argmax(torch.where(p > 0, p.float() / noise, torch.full_like(noise, -1.0)))
        return x if block else x[:, 0]

    def draft_uniform(self, *shape: int) -> Tensor:
        """Uniforms in [0, 1) for the drafter (a seeded row's from its own persistent drafter
        generator, which advances by the same count whatever the batch). [B, *shape] float64"""
        return self._draw(shape, _uniform, None)


    def sample(self, probs: Tensor) -> Tensor:
        """Draw one token per row from the drafter generators (or, keyed, on the next drafted
        position's noise). probs [B, V] → [B]"""
        if self._keyed is not None:
            return self._keyed_draw(probs)
        return sample_from(probs, self.draft_uniform())

    def draw(self, logits: Tensor, greedy: bool = False) -> tuple[Tensor, Tensor | None]:
        """Draft tokens from draft logits [B, ..., V] (one per row, or one per position of a
        block drafted at once) and the q they were drawn from: samples of the warped distribution,
        or the argmaxes with q None (deterministic) when ``greedy``. Returns ([B, ...], q | None)."""
        if greedy:
            return argmax(logits), None
        q = self.probs(logits)
        if self._keyed is not None and q.dim() <= 3:
            return self._keyed_draw(q), q
        return sample_from(q, self.draft_uniform(*q.shape[1:-1])), q

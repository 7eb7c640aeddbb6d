"""DSpark's two small heads: the causal-correction Markov head and the confidence head.

**Markov head.** The block backbone gives base logits ``U_k`` for every draft position at once,
each blind to the tokens drafted before it. The head adds a low-rank bias from the previous draft
token, and tokens are then drawn left to right:

    logits_k = U_k + B_k,    B_k = W1[x_{k−1}] @ W2ᵀ      (x_0 = the anchor)

``W1`` is ``markov_w1.weight [V, r]`` (an embedding), ``W2`` is ``markov_w2.weight [V, r]`` (a
``Linear(r, V)``). ``gated`` scales ``W1[x_{k−1}]`` by ``σ(gate_proj([h_k; W1[x_{k−1}]]))``; ``rnn``
carries a GRU-like state ``s_k`` (``joint_proj: [s_{k−1}; W1[x_{k−1}]; h_k] → [gate; cand; out]``,
bias ``W2·tanh(out)``), so position ``k`` sees the whole drafted prefix.

**Confidence head.** ``c_k = σ(proj([h_k; W1[x_{k−1}]]) / T_k)``: the probability that draft ``k``
is accepted given the ones before it were. ``T_k`` come from post-hoc sequential temperature
scaling (:func:`calibrate_temperatures`); ``Π_{i≤k} c_i`` is then a calibrated survival
probability, what the prefix scheduler (:class:`specdec.policy.PrefixPolicy`) trades on.

Drafts are drawn by the one Markov sampler, :func:`specdec.kernels.markov.markov_chain`, with
the bias :meth:`MarkovHead.sampler_bias` gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.kernels.markov import BiasFn

__all__ = ["MarkovHead", "ConfidenceHead", "build_markov_head", "expected_calibration_error",
           "calibrate_temperatures"]


class MarkovHead(nn.Module):
    """``vanilla``, ``gated`` or ``rnn``; parameter names are DeepSpec's (``markov_head.*``)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, kind: str = "vanilla"):
        super().__init__()
        if rank <= 0:
            raise ValueError(f"markov rank must be > 0, got {rank}")
        if kind not in ("vanilla", "gated", "rnn"):
            raise ValueError(f"markov head kind must be vanilla, gated or rnn, got {kind!r}")
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def prev_embed(self, tokens: Tensor) -> Tensor:
        return self.markov_w1(tokens.long())

    def sampler_bias(self, hidden: Tensor | None) -> BiasFn:
        """The bias [B, V] of each block position in turn from the previous token [B], for
        left-to-right sampling with the block's hidden states [B, γ, d] (read by gated / rnn
        heads); the rnn state [B, r] is carried from call to call."""
        state: Tensor | None = None

        def bias(k: int, prev: Tensor) -> Tensor:
            nonlocal state
            latent, state = self._latent(prev, None if hidden is None else hidden[:, k], state)
            return self.markov_w2(latent)  # [B, V]

        return bias

    def _latent(self, prev: Tensor, h: Tensor | None, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The rank-r vector W2 maps to the bias, and the rnn state."""
        e = self.prev_embed(prev)
        if self.kind == "vanilla":
            return e, None
        assert h is not None, f"the {self.kind} markov head needs the backbone hidden states"
        e = e.to(h.dtype)
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([h, e], -1))) * e, None
        s = torch.zeros_like(e) if state is None else state
        gate, cand, out = self.joint_proj(torch.cat([s, e, h], -1)).chunk(3, -1)
        gate = torch.sigmoid(gate)
        return torch.tanh(out), gate * s + (1 - gate) * torch.tanh(cand)

    def block_bias(self, prev: Tensor, h: Tensor | None, vocab: Tensor | None = None) -> Tensor:
        """Teacher-forced biases for a whole block: prev [..., γ] tokens x_{k−1}, h [..., γ, d]
        → [..., γ, V] (or only the ``vocab`` columns [..., γ, S], for training)."""
        w2 = self.markov_w2.weight if vocab is None else self.markov_w2.weight[vocab]
        if self.kind != "rnn":
            return F.linear(self._latent(prev, h, None)[0], w2)
        assert h is not None
        state, out = None, []
        for k in range(prev.shape[-1]):
            latent, state = self._latent(prev[..., k], h[..., k, :], state)
            out.append(latent)
        return F.linear(torch.stack(out, -2), w2)


def build_markov_head(vocab_size: int, rank: int, hidden_size: int, kind: str) -> MarkovHead | None:
    """None for rank 0 (DFlash: no causal correction)."""
    return MarkovHead(vocab_size, rank, hidden_size, kind) if rank > 0 else None


class ConfidenceHead(nn.Module):
    """``proj: Linear(d + r → 1)`` (``d`` alone without markov features); returns logits."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)

    def forward(self, h: Tensor, prev_embed: Tensor | None) -> Tensor:
        x = h if prev_embed is None else torch.cat([h, prev_embed.to(h.dtype)], -1)
        return self.proj(x).squeeze(-1).float()


def expected_calibration_error(pred: Tensor, target: Tensor, bins: int = 10) -> float:
    """Equal-width-bin ECE of predictions [N] in [0, 1] against (soft) outcomes [N]."""
    idx = (pred.clamp(0, 1) * bins).long().clamp(max=bins - 1)
    dev = pred.device
    count = torch.zeros(bins, dtype=torch.float64, device=dev).index_add_(0, idx, torch.ones_like(pred, dtype=torch.float64))
    p = torch.zeros(bins, dtype=torch.float64, device=dev).index_add_(0, idx, pred.double())
    t = torch.zeros(bins, dtype=torch.float64, device=dev).index_add_(0, idx, target.double())
    n = max(float(count.sum()), 1.0)
    return float(((p - t).abs()).sum() / n)


def calibrate_temperatures(logits: Tensor, targets: Tensor, grid: Tensor | None = None,
                           bins: int = 10) -> list[float]:
    """Sequential temperature scaling: for k = 1..γ in turn (earlier temperatures fixed), the
    ``T_k`` on ``grid`` minimising the ECE of the survival product ``Π_{i≤k} σ(z_i/T_i)`` against
    the realised product of acceptances ``Π_{i≤k} c*_i``. logits, targets [N, γ]."""
    if grid is None:  # on the host: the temperatures are read as Python floats, the same on any device
        grid = torch.exp(torch.linspace(-1.5, 1.5, 61, device="cpu"))
    logits, targets = logits.double(), targets.double()
    surv_target = targets.cumprod(-1)
    prefix = torch.ones(logits.shape[0], dtype=torch.float64, device=logits.device)
    temps: list[float] = []
    for k in range(logits.shape[1]):
        errs = [expected_calibration_error(prefix * torch.sigmoid(logits[:, k] / t), surv_target[:, k], bins)
                for t in grid.tolist()]
        t_best = float(grid[int(torch.tensor(errs, device="cpu").argmin())])
        temps.append(t_best)
        prefix = prefix * torch.sigmoid(logits[:, k] / t_best)
    return temps

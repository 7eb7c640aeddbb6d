"""DSpark's Markov draft sampler: γ tokens in sequence, each biased by the one before.

:func:`markov_chain` is the one sampler, for any bias and any warp: for ``k = 1..γ``,
``logits_k = U_k + bias_k(x_{k−1})``, ``q_k = warp(logits_k)`` and ``x_k = sample_from(q_k, u_k)``
(inverse CDF, one uniform per position, as every drafter samples); without a warp, ``x_k`` is
the argmax and no ``q`` is formed. ``x_0`` is the anchor (the last committed token). The returned
``q`` is exactly what each token was drawn from. DSpark's drafter runs it with its Markov head's
bias (vanilla, gated or rnn) and the request's warp.

The kernel fuses the vanilla head with a temperature-only warp: ``bias_k(x) = W1[x] @ W2ᵀ`` (a
rank-``r`` bigram bias: ``W1 [V, r]`` are embedding rows, ``W2 [V, r]`` the weight of
``nn.Linear(r, V)``) and ``q_k = warp(logits_k, T)``. Its specification,
:func:`markov_sample_reference`, is :func:`markov_chain` with that bias and warp; temperature 0
gives the argmax with ``q = None`` when every row is greedy (greedy rows among sampled ones get a
one-hot q).

The kernel runs one program per row and keeps everything but ``q`` on chip: per position one
online-softmax pass, one pass that writes ``q`` and its float64 total, one inverse-CDF pass.
Its integers equal the reference's except where a different summation order (the rank-``r``
bias, the softmax normaliser, the CDF) moves a value across a uniform's boundary: probability
~1e-7 per token. ``q`` agrees within ``atol = 1e-6``. Tests: ``tests/test_kernels.py``.

Shapes: ``B`` rows, ``γ`` draft positions, ``V`` vocabulary, ``r`` Markov rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from specdec.kernels import choice
from specdec.kernels.choice import pow2
from specdec.sampling import sample_from, warp

__all__ = ["BiasFn", "ProbsFn", "markov_chain", "markov_sample", "markov_sample_reference"]

BiasFn = Callable[[int, Tensor], Tensor]  # (position k, previous tokens x_{k−1} [B]) → bias [B, V]
ProbsFn = Callable[[Tensor], Tensor]  # the warp: logits [B, V] → probabilities [B, V]


def markov_chain(U: Tensor, x0: Tensor, bias: BiasFn | None, probs: ProbsFn | None,
                 u: Tensor) -> tuple[Tensor, Tensor | None]:
    """Left-to-right sampling of γ tokens. U [B, γ, V] base logits; x0 [B] anchors; ``bias``
    called for k = 0..γ−1 in turn (so a stateful head may carry its state); ``probs`` the warp,
    None for greedy (argmax, no q); u [B, γ] uniforms. Returns (tokens [B, γ] int64,
    q [B, γ, V] float32 | None)."""
    prev, tokens, qs = x0.long(), [], []
    for k in range(U.shape[1]):
        logits = U[:, k].float()  # [B, V]
        if bias is not None:
            logits = logits + bias(k, prev).float()
        if probs is None:
            prev = logits.argmax(-1)
        else:
            q = probs(logits)
            prev = sample_from(q, u[:, k])
            qs.append(q)
        tokens.append(prev)
    return torch.stack(tokens, 1), (None if probs is None else torch.stack(qs, 1))


def _temperature(temperature: Tensor | float, B: int, device: torch.device) -> Tensor:
    if isinstance(temperature, Tensor):
        return temperature.float().to(device).expand(B).contiguous()
    return torch.full((B,), float(temperature), device=device)


def markov_sample_reference(U: Tensor, x0: Tensor, W1: Tensor, W2: Tensor, temperature: Tensor | float,
                            u: Tensor) -> tuple[Tensor, Tensor | None]:
    """The specification: :func:`markov_chain` with the vanilla bias and a temperature-only warp.
    U [B, γ, V]; x0 [B]; W1, W2 [V, r]; temperature [B] or a float; u [B, γ] uniforms.
    Returns (tokens [B, γ] int64, q [B, γ, V] float32 | None)."""
    B, _, V = U.shape
    t = _temperature(temperature, B, U.device)
    zeros, ones = torch.zeros(B, dtype=torch.long, device=U.device), torch.ones(B, device=U.device)
    probs = None if bool((t == 0).all()) else (lambda logits: warp(logits, t, zeros, ones))
    return markov_chain(U, x0.long().clamp(0, V - 1), lambda k, x: W1[x].float() @ W2.float().T, probs, u)


def markov_sample(U: Tensor, x0: Tensor, W1: Tensor, W2: Tensor, temperature: Tensor | float,
                  u: Tensor) -> tuple[Tensor, Tensor | None]:
    """:func:`markov_sample_reference`, fused in one Triton kernel on a GPU where that measured
    faster (:mod:`specdec.kernels.choice`)."""
    B, G, V = U.shape
    if x0.shape != (B,) or u.shape != (B, G):
        raise ValueError(f"x0 must be [{B}] and u [{B}, {G}], got {tuple(x0.shape)} and {tuple(u.shape)}")
    if W1.dim() != 2 or W1.shape[0] != V or W2.shape != W1.shape:
        raise ValueError(f"W1 and W2 must both be [V={V}, r], got {tuple(W1.shape)} and {tuple(W2.shape)}")
    def fused() -> tuple[Tensor, Tensor | None]:
        from specdec.kernels.markov_triton import markov_sample_triton

        return markov_sample_triton(U, x0, W1, W2, _temperature(temperature, B, U.device), u)

    return choice.call("markov", {"B": pow2(B), "G": G, "V": V, "R": W1.shape[1]}, (U,),
                       lambda: markov_sample_reference(U, x0, W1, W2, temperature, u), fused)

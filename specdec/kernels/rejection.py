"""Speculative rejection sampling for chains and trees, as one call per verify step.

**The tree walk** (:func:`tree_walk`, the one statement of the rule every verifier follows).
Per row, nodes are visited in index order (parents before children, siblings in the order they
were drawn); node ``j`` is a candidate when its parent is the row's current node and
``j < num_valid``. Its token ``x`` is accepted when ``u_j·q_j(x) < p(x)`` (probability
``min(1, p/q)``, Leviathan et al. 2023, arXiv 2211.17192); acceptance descends to ``j`` and the
target distribution becomes the target's at ``j``; rejection replaces ``p`` by the residual
``norm(max(0, p − q_j))`` (recursive rejection sampling, Jeon et al. 2024, "Recursive
Speculative Decoding"), which is exactly lossless when ``q_j`` is the distribution ``j`` was
drawn from given its parent and earlier siblings: the same q for i.i.d. siblings, renormalised
for siblings drawn without replacement, one-hot for deterministic ones. A chain is the special
case with one child per node, where the rule is the standard speculative-sampling rule. The
typical verifier walks the same tree with its own acceptance rule and no residual.

The emitted token after the walk is drawn from the final distribution by an **exponential
race**: ``argmax_i r_i / E_i`` over ``r_i > 0`` with ``E_i ~ Exp(1)``, which picks ``i`` with
probability ``r_i / Σr``. The race needs no normalisation and no prefix sum, so the kernel
samples in the same single pass over the vocabulary that computes the residual.

**The distribution is kept unnormalised**, ``p = r / mass``, and every test is written without
a division: accept iff ``(u·q(x))·mass < r(x)``; a residual is ``max(0, r − q·mass)`` with mass
``Σ`` of it. Two sources of ``r``:

- ``probs`` ``[B, n+1, V]``: already-warped probabilities (``warp()``: temperature, top-k,
  top-p), ``mass = 1``. Exact for every sampling setting.
- ``logits`` + ``temperature [B]``: ``r = exp(l/T − max)``, ``mass = Σ r`` computed in-kernel, so
  the probabilities are never written; temperature-0 rows get the one-hot argmax (first index on
  ties). Valid only without top-k / top-p.

**Identical integers.** Given the same ``u`` and noise, kernel and reference make the same float32
operations in the same order, except where a sum over the vocabulary enters: ``mass`` in the
logits mode and after a tree sibling's rejection, which a kernel reduces in another order
(and ``exp``, whose last bit differs between libraries). Those change a decision only when a
uniform falls within float32 rounding of its boundary (probability ~1e-7 per decision);
on chains in probs mode, and for every greedy row, the outputs are identical by construction. Draft ids are clamped
into ``[0, V)`` before they are read or emitted (validated proposals never need it).

Shapes: ``B`` rows, ``n`` nodes, ``V`` vocabulary. Tests: ``tests/test_kernels.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.kernels import choice
from specdec.kernels.choice import pow2
from specdec.sampling import argmax
from specdec.types import Verification

__all__ = ["rejection_sample", "rejection_sample_reference", "argmax_walk", "race", "tree_walk", "Walk",
           "AcceptRule", "rejection_accept"]

# accept(r [B, V] unnormalised target distribution, mass [B] its sum, x [B] draft tokens,
#        qx [B] = q_j(x), u [B] uniforms) → bool [B]
AcceptRule = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def rejection_accept(r: Tensor, mass: Tensor, x: Tensor, qx: Tensor, u: Tensor) -> Tensor:
    """Accept with probability ``min(1, p(x)/q(x))``, ``p = r/mass``, written without a division."""
    return (u * qx) * mass < r.gather(1, x.unsqueeze(1)).squeeze(1)


def race(r: Tensor, noise: Tensor | None) -> Tensor:
    """``argmax_i r_i / E_i`` over ``r_i > 0`` (first index on ties); ``noise None`` = argmax r.
    r, noise [B, V] → int64 [B]. An all-zero row gives 0, still a valid token id."""
    score = r if noise is None else r / noise
    return argmax(torch.where(r > 0, score, torch.full_like(score, -1.0)))


def _base(probs: Tensor | None, logits: Tensor | None, temperature: Tensor | None) -> tuple[Tensor, Tensor]:
    """Unnormalised target distributions at every block position and their masses:
    ([B, n+1, V] float32, [B, n+1] float32)."""
    if probs is not None:
        r = probs.float()
        return r, torch.ones(r.shape[:2], dtype=torch.float32, device=r.device)
    assert logits is not None and temperature is not None
    t = temperature.float().view(-1, 1, 1)
    ones = torch.ones(logits.shape[:2], dtype=torch.float32, device=logits.device)
    if not bool((t > 0).any()):  # all greedy (the greedy verifier): no exponentials to take
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(
            -1, argmax(logits.float()).unsqueeze(-1), 1.0), ones
    s = logits.float() / torch.where(t > 0, t, torch.ones_like(t))
    r = torch.exp(s - s.max(-1, keepdim=True).values)
    mass = r.sum(-1)
    greedy = (t == 0)
    one_hot = torch.zeros_like(r).scatter_(-1, argmax(s).unsqueeze(-1), 1.0)
    return torch.where(greedy, one_hot, r), torch.where(greedy.view(-1, 1), torch.ones_like(mass), mass)


def _residual(R: Tensor, mass: Tensor, q: Tensor | None, j: int, x: Tensor) -> Tensor:
    """``max(0, R − q_j·mass)``, or ``R`` with ``x`` zeroed for a deterministic node. [B, V]"""
    if q is None:
        return R.scatter(1, x.unsqueeze(1), 0.0)
    return (R - q[:, j].float() * mass.unsqueeze(1)).clamp(min=0)


@dataclass
class Walk:
    """Where the walk of every row ended."""

    tokens: Tensor  # [B, n] the draft tokens, clamped into [0, V)
    path: Tensor  # [B, n] accepted node indices in order, -1 after
    num_accepted: Tensor  # [B]
    r: Tensor  # [B, V] the unnormalised distribution at the end (the accepted node's, or a residual)
    mass: Tensor  # [B] its sum
    pending: Tensor  # [B] the rejected node whose residual the emitted token comes from, -1 for none

    def verification(self, final: Tensor) -> Verification:
        """The accepted drafts followed by the emitted token ``final`` [B]."""
        return _verification(self.tokens, self.path, self.num_accepted, final)


def _verification(tokens: Tensor, path: Tensor, num_accepted: Tensor, final: Tensor) -> Verification:
    """tokens [B, n] (clamped), path [B, n] accepted node indices then -1, num_accepted [B] and the
    emitted token final [B] → the accepted drafts followed by ``final``, -1 after."""
    B, n = tokens.shape
    out = torch.full((B, n + 1), -1, dtype=torch.long, device=tokens.device)
    if n:
        out[:, :n] = torch.where(path >= 0, tokens.gather(1, path.clamp(min=0)), -1)
    out[torch.arange(B, device=out.device), num_accepted] = final
    return Verification(path=path, num_accepted=num_accepted, tokens=out)


def tree_walk(tokens: Tensor, parents: Tensor, num_valid: Tensor, rbase: Tensor, mbase: Tensor, u: Tensor,
              q: Tensor | None, accept: AcceptRule = rejection_accept, residual: bool = True) -> Walk:
    """The walk of every row down its proposal. tokens, parents [B, n]; num_valid [B];
    rbase [B, n+1, V] unnormalised target distributions (root first) and mbase [B, n+1] their
    sums; u [B, n]; q [B, n, V] or None (deterministic drafts). ``residual=False`` keeps ``p``
    after a rejection (the typical verifier)."""
    B, n = tokens.shape
    V = rbase.shape[-1]
    dev = rbase.device
    rows = torch.arange(B, device=dev)
    x_all = tokens.clamp(0, V - 1)
    cur = torch.full((B,), -1, dtype=torch.long, device=dev)
    R, mass = rbase[:, 0].clone(), mbase[:, 0].clone()
    pending = torch.full((B,), -1, dtype=torch.long, device=dev)  # a rejection whose residual is sampled at the end
    path = torch.full((B, n), -1, dtype=torch.long, device=dev)
    acc = torch.zeros(B, dtype=torch.long, device=dev)
    valid = torch.arange(n, device=dev).unsqueeze(0) < num_valid.unsqueeze(1)  # [B, n]
    for j in range(n):
        cand = (parents[:, j] == cur) & valid[:, j]
        if not bool(cand.any()):
            continue
        x = x_all[:, j]
        qx = torch.ones(B, device=dev) if q is None else q[:, j].float().gather(1, x.unsqueeze(1)).squeeze(1)
        ok = cand & accept(R, mass, x, qx, u[:, j].float())
        rejected = cand & ~ok
        if residual:
            sibling_follows = ((parents[:, j + 1:] == cur.unsqueeze(1)) & valid[:, j + 1:]).any(1)
            now = rejected & sibling_follows
            if bool(now.any()):
                resid = _residual(R, mass, q, j, x)
                rmass = resid.sum(-1)
                take = now & (rmass > 0)  # rmass == 0 only if p == q_j: acceptance was certain
                R = torch.where(take.unsqueeze(1), resid, R)
                mass = torch.where(take, rmass, mass)
            pending = torch.where(rejected & ~sibling_follows, j, pending)
        R = torch.where(ok.unsqueeze(1), rbase[:, j + 1], R)
        mass = torch.where(ok, mbase[:, j + 1], mass)
        path[rows[ok], acc[ok]] = j
        acc = acc + ok.long()
        cur = torch.where(ok, j, cur)
    return Walk(x_all, path, acc, R, mass, pending)


def rejection_sample_reference(tokens: Tensor, parents: Tensor, num_valid: Tensor, u: Tensor,
                               noise: Tensor | None, q: Tensor | None = None, *, probs: Tensor | None = None,
                               logits: Tensor | None = None, temperature: Tensor | None = None) -> Verification:
    """The specification, in torch. tokens, parents [B, n]; num_valid [B]; u [B, n] float32;
    noise [B, V] Exp(1) or None (argmax, for greedy); q [B, n, V] or None (deterministic)."""
    rbase, mbase = _base(probs, logits, temperature)
    w = tree_walk(tokens, parents, num_valid, rbase, mbase, u, q)
    final = race(w.r, noise)
    if bool((w.pending >= 0).any()):
        pj = w.pending.clamp(min=0)
        if q is None:
            resid = w.r.scatter(1, w.tokens.gather(1, pj.unsqueeze(1)), 0.0)
        else:
            qp = q.float()[torch.arange(q.shape[0], device=q.device), pj]
            resid = (w.r - qp * w.mass.unsqueeze(1)).clamp(min=0)
        resid_token = race(resid, noise)
        use = (w.pending >= 0) & (resid > 0).any(-1)
        final = torch.where(use, resid_token, final)
    return w.verification(final)


def argmax_walk(tokens: Tensor, parents: Tensor, num_valid: Tensor, logits: Tensor) -> Verification:
    """The walk when every row is greedy, on token ids alone: a node is accepted iff it is its
    parent's argmax, and the emitted token is the argmax where the walk ends (first index on ties).

    What :func:`rejection_sample_reference` returns for temperature-0 logits, whatever ``u`` and
    ``q``: the one-hot ``p`` accepts ``x`` iff ``p(x) = 1``, and every residual keeps the argmax.
    It reads the vocabulary once (the argmax of each position) instead of once per node and per
    operation, which on a CPU is most of a greedy step's verification.
    tokens, parents [B, n]; num_valid [B]; logits [B, n+1, V] (position 0 the root)."""
    B, n = tokens.shape
    dev = logits.device
    best = argmax(logits)  # [B, n+1] the target's token after each position
    x = tokens.clamp(0, logits.shape[-1] - 1)
    cur = torch.full((B,), -1, dtype=torch.long, device=dev)
    path = torch.full((B, n), -1, dtype=torch.long, device=dev)
    acc = torch.zeros(B, dtype=torch.long, device=dev)
    rows = torch.arange(B, device=dev)
    for j in range(n):
        ok = (parents[:, j] == cur) & (j < num_valid) & (x[:, j] == best.gather(1, (cur + 1).unsqueeze(1)).squeeze(1))
        path[rows, acc] = torch.where(ok, j, path[rows, acc])
        acc = acc + ok.long()
        cur = torch.where(ok, j, cur)
    return _verification(x, path, acc, best.gather(1, (cur + 1).unsqueeze(1)).squeeze(1))


def rejection_sample(tokens: Tensor, parents: Tensor, num_valid: Tensor, u: Tensor, noise: Tensor | None,
                     q: Tensor | None = None, *, probs: Tensor | None = None, logits: Tensor | None = None,
                     temperature: Tensor | None = None) -> Verification:
    """Verify one step: give ``probs`` (warped, any sampling setting) or ``logits`` and
    ``temperature`` (no top-k / top-p), ``[B, n+1, V]`` with position 0 the root. Dispatches to
    the Triton kernel on a GPU where it measured faster (:mod:`specdec.kernels.choice`), else to
    :func:`rejection_sample_reference`, or to :func:`argmax_walk` when every row is temperature-0
    logits."""
    if (probs is None) == (logits is None):
        raise ValueError("give exactly one of probs and logits")
    if logits is not None and temperature is None:
        raise ValueError("logits need a temperature per row (0 = greedy)")
    src = probs if probs is not None else logits
    assert src is not None
    B, n = tokens.shape
    if src.dim() != 3 or src.shape[:2] != (B, n + 1):
        raise ValueError(f"target scores must be [B, n+1, V] = [{B}, {n + 1}, V], got {tuple(src.shape)}")
    if q is not None and q.shape != (B, n, src.shape[-1]):
        raise ValueError(f"q shape {tuple(q.shape)} != {(B, n, src.shape[-1])}")
    def reference() -> Verification:
        if logits is not None and temperature is not None and not bool((temperature > 0).any()):
            return argmax_walk(tokens, parents, num_valid, logits)  # the same walk, without the vocabulary passes
        return rejection_sample_reference(tokens, parents, num_valid, u, noise, q, probs=probs, logits=logits,
                                          temperature=temperature)

    def fused() -> Verification:
        from specdec.kernels.rejection_triton import rejection_sample_triton

        return rejection_sample_triton(tokens, parents, num_valid, u, noise, q, probs=probs, logits=logits,
                                       temperature=temperature)

    shape = {"B": pow2(B), "n": pow2(n), "V": src.shape[-1], "scores": "probs" if probs is not None else "logits",
             "q": q is not None, "noise": noise is not None}
    return choice.call("rejection", shape, (src,), reference, fused)

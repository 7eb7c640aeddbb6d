"""The Triton kernel of :mod:`specdec.kernels.rejection`: one program per row.

A chain in probs mode reads two scalars per node (``p(x)``, ``q(x)``) and then makes one pass
over the vocabulary, which computes the residual and runs the exponential race at once. The
logits mode adds one online-softmax pass (max, ``Σ exp``, argmax) per position the walk reaches.
A tree makes one more pass per rejected node that has a later sibling, writing its residual to a
scratch row (the only intermediate ever written). Noise comes in as a tensor, so token ids match
the reference's (see the module docstring there for when they can differ). Divisions are
``div_rn`` (IEEE, as torch; a plain ``/`` is approximate on NVIDIA) and the tuning configs turn
off FMA contraction, so each elementwise operation rounds as torch's does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from specdec.kernels.dispatch import interpreting
from specdec.kernels.tuning import row_configs
from specdec.types import Verification

__all__ = ["rejection_sample_triton", "INTERPRET_BLOCK"]

INTERPRET_BLOCK = 16  # small on purpose: the tests' vocabularies are not multiples of it


@triton.jit
def _stats(src_ptr, V, t, BLOCK: tl.constexpr):
    """Online softmax of one logits row at temperature t (t = 1 stands in for greedy):
    (max of l/t, Σ exp(l/t − max), first argmax)."""
    m = tl.full((), float("-inf"), tl.float32)
    z = tl.full((), 0.0, tl.float32)
    amax = tl.full((), 0, tl.int64)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        s = tl.math.div_rn(tl.load(src_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32), t)
        m, z, amax = _online_softmax(s, offs, V, m, z, amax)
    return m, z, amax


@triton.jit
def _online_softmax(s, offs, V, m, z, amax):
    """Fold one block of scaled logits ``s`` at ``offs`` (−inf where masked) into the running
    (max, Σ exp(s − max), first argmax)."""
    bm = tl.max(s, 0)
    bi = tl.min(tl.where(s == bm, offs, V), 0)
    amax = tl.where(bm > m, bi, amax)  # strict: an earlier block keeps a tie
    new_m = tl.maximum(m, bm)
    z = _rescaled(z, m, new_m) + tl.sum(_exp_shifted(s, new_m), 0)
    return new_m, z, amax


@triton.jit
def _finite(m):
    """m, or 0 while every logit seen is −inf (so that −inf − m is −inf, never NaN)."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _exp_shifted(s, m):
    """exp(s − m) of one block; 0 for s = −inf, even when the whole block so far is −inf."""
    return tl.exp(s - _finite(m))


@triton.jit
def _rescaled(z, m, new_m):
    """z · exp(m − new_m), the online softmax's rescaling; z stays 0 until a finite logit."""
    return z * tl.exp(m - _finite(new_m))


@triton.jit
def _r(src_ptr, offs, msk, t, greedy, m, amax, FROM_LOGITS: tl.constexpr):
    """Unnormalised target probabilities of one position at ``offs``."""
    if FROM_LOGITS:
        s = tl.math.div_rn(tl.load(src_ptr + offs, mask=msk, other=float("-inf")).to(tl.float32), t)
        r = tl.exp(s - m)
        r = tl.where(greedy, tl.where(offs == amax, 1.0, 0.0), r)
    else:
        r = tl.load(src_ptr + offs, mask=msk, other=0.0).to(tl.float32)
    return tl.where(msk, r, 0.0)


@triton.jit
def _base_tile(scratch, in_scratch, src_ptr, offs, msk, t, greedy, m, amax, FROM_LOGITS: tl.constexpr):
    """The row's current (unnormalised) distribution on one tile: the scratch row once a
    rejection wrote a residual there, else the target's own row."""
    if in_scratch == 1:
        R = tl.load(scratch + offs, mask=msk, other=0.0)
    else:
        R = _r(src_ptr, offs, msk, t, greedy, m, amax, FROM_LOGITS)
    return R


@triton.jit
def _residual_tile(R, q_row, j, V, mass, x, offs, msk, HAS_Q: tl.constexpr):
    """``max(0, R − q_j·mass)`` on one tile, or ``R`` with ``x`` zeroed for a deterministic node."""
    if HAS_Q:
        qj = tl.load(q_row + j * V + offs, mask=msk, other=0.0).to(tl.float32)
        res = tl.maximum(R - qj * mass, 0.0)
    else:
        res = tl.where(offs == x, 0.0, R)
    return res


# n (the draft length) changes from step to step: not specialised, so no recompilation per k
@triton.jit(do_not_specialize=["n"])
def _rejection_kernel(
    src_ptr,  # [B, n+1, V] probs, or logits when FROM_LOGITS
    temp_ptr,  # [B] float32 (FROM_LOGITS only)
    q_ptr,  # [B, n, V] (HAS_Q only)
    tokens_ptr,  # [B, n] int64
    parents_ptr,  # [B, n] int64
    num_valid_ptr,  # [B] int64
    u_ptr,  # [B, n] float32
    noise_ptr,  # [B, V] float32 Exp(1) (HAS_NOISE only)
    scratch_ptr,  # [B, V] float32: a tree's residual after a rejected sibling
    path_ptr,  # [B, n] int64, pre-filled with -1
    out_ptr,  # [B, n+1] int64, pre-filled with -1
    acc_ptr,  # [B] int64
    n, V,
    FROM_LOGITS: tl.constexpr, HAS_Q: tl.constexpr, HAS_NOISE: tl.constexpr,
    N_POW2: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    src_row = src_ptr + b * (n + 1) * V
    q_row = q_ptr + b * n * V
    scratch = scratch_ptr + b * V
    nv = tl.load(num_valid_ptr + b)
    node = tl.arange(0, N_POW2).to(tl.int64)
    parents = tl.load(parents_ptr + b * n + node, mask=node < n, other=-2)
    valid = node < nv

    t = tl.full((), 1.0, tl.float32)
    greedy = False
    m = tl.full((), 0.0, tl.float32)
    amax = tl.full((), 0, tl.int64)
    mass = tl.full((), 1.0, tl.float32)
    if FROM_LOGITS:
        temp = tl.load(temp_ptr + b).to(tl.float32)
        greedy = temp == 0
        t = tl.where(greedy, 1.0, temp)
        m, z, amax = _stats(src_row, V, t, BLOCK)
        mass = tl.where(greedy, 1.0, z)

    cur = tl.full((), -1, tl.int64)
    acc = tl.full((), 0, tl.int64)
    in_scratch = tl.full((), 0, tl.int32)  # 1: the row's distribution is the scratch row
    pending = tl.full((), -1, tl.int64)  # a rejected node whose residual is sampled at the end
    for j in range(0, n):
        parent = tl.load(parents_ptr + b * n + j)
        if (parent == cur) & (j < nv):
            x = tl.minimum(tl.maximum(tl.load(tokens_ptr + b * n + j), 0), V - 1)
            qx = tl.full((), 1.0, tl.float32)
            if HAS_Q:
                qx = tl.load(q_row + j * V + x).to(tl.float32)
            pos_row = src_row + (cur + 1) * V
            if in_scratch == 1:
                rx = tl.load(scratch + x)
            else:
                rx = tl.sum(_r(pos_row, x + tl.arange(0, 1), x + tl.arange(0, 1) < V, t, greedy, m, amax,
                               FROM_LOGITS), 0)
            uj = tl.load(u_ptr + b * n + j)
            if (uj * qx) * mass < rx:
                tl.store(path_ptr + b * n + acc, j)
                tl.store(out_ptr + b * (n + 1) + acc, x)
                acc += 1
                cur = cur * 0 + j
                in_scratch = tl.full((), 0, tl.int32)
                mass = tl.full((), 1.0, tl.float32)
                if FROM_LOGITS:
                    m, z, amax = _stats(src_row + (j + 1) * V, V, t, BLOCK)
                    mass = tl.where(greedy, 1.0, z)
            else:
                follows = tl.sum(((parents == cur) & valid & (node > j)).to(tl.int32), 0) > 0
                if follows:
                    # the residual's mass first; the scratch row is overwritten only if it is > 0
                    rmass = tl.full((), 0.0, tl.float32)
                    for start in range(0, V, BLOCK):
                        offs = start + tl.arange(0, BLOCK).to(tl.int64)
                        msk = offs < V
                        R = _base_tile(scratch, in_scratch, pos_row, offs, msk, t, greedy, m, amax, FROM_LOGITS)
                        res = _residual_tile(R, q_row, j, V, mass, x, offs, msk, HAS_Q)
                        rmass += tl.sum(res, 0)
                    if rmass > 0:
                        for start in range(0, V, BLOCK):
                            offs = start + tl.arange(0, BLOCK).to(tl.int64)
                            msk = offs < V
                            R = _base_tile(scratch, in_scratch, pos_row, offs, msk, t, greedy, m, amax, FROM_LOGITS)
                            res = _residual_tile(R, q_row, j, V, mass, x, offs, msk, HAS_Q)
                            tl.store(scratch + offs, res, mask=msk)
                        # every thread's part of the residual lands before any thread reads it
                        # back: the next node's scalar p(x) is an element another thread stored
                        tl.debug_barrier()
                        in_scratch = tl.full((), 1, tl.int32)
                        mass = rmass
                else:
                    pending = pending * 0 + j

    # the emitted token: one pass, racing the residual of `pending` and, as its fallback, R itself
    pos_row = src_row + (cur + 1) * V
    px = tl.minimum(tl.maximum(tl.load(tokens_ptr + b * n + tl.maximum(pending, 0), mask=pending >= 0,
                                       other=0), 0), V - 1)
    best = tl.full((), -1.0, tl.float32)
    best_i = tl.full((), 0, tl.int64)
    fb = tl.full((), -1.0, tl.float32)
    fb_i = tl.full((), 0, tl.int64)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        msk = offs < V
        R = _base_tile(scratch, in_scratch, pos_row, offs, msk, t, greedy, m, amax, FROM_LOGITS)
        res = R
        if pending >= 0:
            res = _residual_tile(R, q_row, pending, V, mass, px, offs, msk, HAS_Q)
        if HAS_NOISE:
            e = tl.load(noise_ptr + b * V + offs, mask=msk, other=1.0)
            score = tl.where(res > 0, tl.math.div_rn(res, e), -1.0)
            fscore = tl.where(R > 0, tl.math.div_rn(R, e), -1.0)
        else:
            score = tl.where(res > 0, res, -1.0)
            fscore = tl.where(R > 0, R, -1.0)
        bm = tl.max(score, 0)
        bi = tl.min(tl.where(score == bm, offs, V), 0)
        best_i = tl.where(bm > best, bi, best_i)
        best = tl.maximum(best, bm)
        fm = tl.max(fscore, 0)
        fi = tl.min(tl.where(fscore == fm, offs, V), 0)
        fb_i = tl.where(fm > fb, fi, fb_i)
        fb = tl.maximum(fb, fm)
    final = tl.where(best > -1.0, best_i, fb_i)
    final = tl.minimum(tl.maximum(final, 0), V - 1)  # an all-NaN row must still give a real token id
    tl.store(out_ptr + b * (n + 1) + acc, final)
    tl.store(acc_ptr + b, acc)


_tuned = None


def _launch(grid: tuple[int], *args: object, **meta: object) -> None:
    """The interpreter's single small block, or the autotuned kernel (built on first launch)."""
    global _tuned
    if interpreting():
        _rejection_kernel[grid](*args, **meta, BLOCK=INTERPRET_BLOCK)
        return
    if _tuned is None:
        # key on V and the variant; n varies every step and is not a key (no retuning per k)
        _tuned = triton.autotune(configs=row_configs(), key=["V", "FROM_LOGITS", "HAS_Q"])(_rejection_kernel)
    _tuned[grid](*args, **meta)


def tuned_kernel():
    """The autotuned kernel object (its ``best_config`` names the winner), or None before a launch."""
    return _tuned


def rejection_sample_triton(tokens: Tensor, parents: Tensor, num_valid: Tensor, u: Tensor, noise: Tensor | None,
                            q: Tensor | None = None, *, probs: Tensor | None = None, logits: Tensor | None = None,
                            temperature: Tensor | None = None) -> Verification:
    src = (probs if probs is not None else logits)
    assert src is not None
    B, n = tokens.shape
    V = src.shape[-1]
    dev = src.device
    src = src.contiguous()
    path = torch.full((B, n), -1, dtype=torch.long, device=dev)
    out = torch.full((B, n + 1), -1, dtype=torch.long, device=dev)
    acc = torch.zeros(B, dtype=torch.long, device=dev)
    scratch = torch.empty(B, V, dtype=torch.float32, device=dev)
    temp = temperature.float().contiguous() if temperature is not None else scratch
    noise_t = noise.float().contiguous() if noise is not None else scratch
    q_t = q.contiguous() if q is not None else scratch
    _launch((B,), src, temp, q_t, tokens.long().contiguous(), parents.long().contiguous(),
            num_valid.long().contiguous(), u.float().contiguous(), noise_t, scratch, path, out, acc, n, V,
            FROM_LOGITS=logits is not None, HAS_Q=q is not None, HAS_NOISE=noise is not None,
            N_POW2=max(1, triton.next_power_of_2(max(n, 1))))
    return Verification(path=path, num_accepted=acc, tokens=out)

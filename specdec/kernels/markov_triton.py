"""The Triton kernel of :mod:`specdec.kernels.markov`: one program per row, γ positions in turn.

The bias ``W1[x] @ W2ᵀ`` is recomputed block by block in every pass (``r`` multiply-adds per
vocabulary entry, with ``W1[x]`` held in registers), so no ``[V]`` logits row is ever written;
only ``q`` is, because the verifier needs it. Divisions are IEEE (``div_rn``), as torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from specdec.kernels.dispatch import interpreting
from specdec.kernels.rejection_triton import _online_softmax
from specdec.kernels.tuning import fits_markov_tile, markov_configs

__all__ = ["markov_sample_triton"]

INTERPRET_BLOCK = 16


@triton.jit
def _scaled(U_row, W2_ptr, h, offs, msk, t, R, R_POW2: tl.constexpr):
    """(U + W1[x] @ W2ᵀ) / t at ``offs``, float32; masked entries are -inf."""
    rr = tl.arange(0, R_POW2)
    w2 = tl.load(W2_ptr + offs[:, None] * R + rr[None, :], mask=msk[:, None] & (rr[None, :] < R), other=0.0)
    bias = tl.sum(w2.to(tl.float32) * h[None, :], 1)
    s = tl.math.div_rn(tl.load(U_row + offs, mask=msk, other=0.0).to(tl.float32) + bias, t)
    return tl.where(msk, s, float("-inf"))


@triton.jit(do_not_specialize=["G"])  # γ may change per step (DSpark's scheduler)
def _markov_kernel(
    U_ptr,  # [B, γ, V]
    x0_ptr,  # [B] int64
    W1_ptr, W2_ptr,  # [V, r]
    temp_ptr,  # [B] float32
    u_ptr,  # [B, γ] float64
    tokens_ptr,  # [B, γ] int64
    q_ptr,  # [B, γ, V] float32 (WRITE_Q only)
    G, V, R,
    WRITE_Q: tl.constexpr, R_POW2: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    temp = tl.load(temp_ptr + b)
    greedy = temp == 0
    t = tl.where(greedy, 1.0, temp)
    x = tl.minimum(tl.maximum(tl.load(x0_ptr + b), 0), V - 1)
    rr = tl.arange(0, R_POW2)
    for k in range(0, G):
        U_row = U_ptr + (b * G + k) * V
        h = tl.load(W1_ptr + x * R + rr, mask=rr < R, other=0.0).to(tl.float32)
        # pass 1: max, Σ exp and first argmax of the scaled logits
        m = tl.full((), float("-inf"), tl.float32)
        z = tl.full((), 0.0, tl.float32)
        amax = tl.full((), 0, tl.int64)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK).to(tl.int64)
            s = _scaled(U_row, W2_ptr, h, offs, offs < V, t, R, R_POW2)
            m, z, amax = _online_softmax(s, offs, V, m, z, amax)
        x = amax
        if WRITE_Q:
            # pass 2: q (one-hot for a greedy row) and its float64 total, as the inverse CDF sums it
            total = tl.full((), 0.0, tl.float64)
            last = tl.full((), 0, tl.int64)
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK).to(tl.int64)
                msk = offs < V
                s = _scaled(U_row, W2_ptr, h, offs, msk, t, R, R_POW2)
                q = tl.where(greedy, tl.where(offs == amax, 1.0, 0.0), tl.math.div_rn(tl.exp(s - m), z))
                q = tl.where(msk, q, 0.0)
                tl.store(q_ptr + (b * G + k) * V + offs, q, mask=msk)
                total += tl.sum(q.to(tl.float64), 0)
                last = tl.maximum(last, tl.max(tl.where(q > 0, offs, 0), 0))
            # pass 3 reads q back, elements other threads stored: every store lands first
            tl.debug_barrier()
            # pass 3: the inverse CDF, counting the entries of the CDF at or below u·total
            target = tl.load(u_ptr + b * G + k) * total
            run = tl.full((), 0.0, tl.float64)
            count = tl.full((), 0, tl.int64)
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK).to(tl.int64)
                msk = offs < V
                q = tl.load(q_ptr + (b * G + k) * V + offs, mask=msk, other=0.0).to(tl.float64)
                cdf = tl.cumsum(q, 0) + run
                count += tl.sum((msk & (cdf <= target)).to(tl.int64), 0)
                run += tl.sum(q, 0)
            x = tl.minimum(count, last)
        tl.store(tokens_ptr + b * G + k, x)


def markov_sample_triton(U: Tensor, x0: Tensor, W1: Tensor, W2: Tensor, temperature: Tensor,
                         u: Tensor) -> tuple[Tensor, Tensor | None]:
    B, G, V = U.shape
    R = W1.shape[1]
    write_q = not bool((temperature == 0).all())
    tokens = torch.empty(B, G, dtype=torch.long, device=U.device)
    q = torch.empty(B, G, V, dtype=torch.float32, device=U.device) if write_q else tokens
    args = (U.contiguous(), x0.long().contiguous(), W1.contiguous(), W2.contiguous(), temperature.contiguous(),
            u.double().contiguous(), tokens, q, G, V, R)
    meta = dict(WRITE_Q=write_q, R_POW2=triton.next_power_of_2(R))
    if interpreting():
        _markov_kernel[(B,)](*args, **meta, BLOCK=INTERPRET_BLOCK)
    else:
        global _tuned
        if _tuned is None:
            _tuned = triton.autotune(configs=markov_configs(), key=["V", "R", "WRITE_Q"],
                                     prune_configs_by={"early_config_prune": fits_markov_tile})(_markov_kernel)
        _tuned[(B,)](*args, **meta)
    return tokens, (q if write_q else None)


_tuned = None

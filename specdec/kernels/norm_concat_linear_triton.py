"""The Triton path of :mod:`specdec.kernels.norm_concat_linear`: a tiled GEMM whose A operand is
built on the fly from up to three inputs, each RMS-normalised while it is loaded.

Output tile ``[BLOCK_M, BLOCK_N]`` accumulates ``Σ_i norm(x_i)[:, k] @ W[:, off_i + k]ᵀ`` over
each input's columns in turn, so the concatenation is implicit in the weight's column offset.
Each input's reciprocal RMS ``[M]`` (float32) is computed first by torch: a reduction that is
``M·D`` reads, against the ``N·ΣD`` reads of the weight that dominate at decode.

The autotuner keys on ``M_BUCKET = min(next_pow2(M), 256)``, not on ``M``: M (draft tokens) changes
every decoding step, and keying on it re-tuned (~0.5 s) inside timed runs for each new value.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from specdec.kernels.dispatch import interpreting
from specdec.kernels.tuning import gemm_configs

__all__ = ["norm_concat_linear_triton"]

INTERPRET_TILES = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}


@triton.jit
def _accumulate(acc, x_ptr, rstd_ptr, nw_ptr, w_ptr, offs_m, offs_n, M, N, D, col_off, stride_w,
                NORM: tl.constexpr, IEEE: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += norm(x)[offs_m, :] @ W[offs_n, col_off : col_off + D]ᵀ"""
    rstd = tl.load(rstd_ptr + offs_m, mask=offs_m < M, other=0.0)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        km = offs_k < D
        a = tl.load(x_ptr + offs_m[:, None] * D + offs_k[None, :], mask=(offs_m[:, None] < M) & km[None, :],
                    other=0.0)
        if NORM:
            # as the reference: normalise in float32, round to the input dtype, scale, round again
            nw = tl.load(nw_ptr + offs_k, mask=km, other=0.0).to(tl.float32)
            a = (a.to(tl.float32) * rstd[:, None]).to(a.dtype)
            a = (a.to(tl.float32) * nw[None, :]).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + offs_n[None, :] * stride_w + (col_off + offs_k)[:, None],
                    mask=(offs_n[None, :] < N) & km[:, None], other=0.0)
        if IEEE:  # float32 (and the interpreter, whose bf16 dot is wrong in triton 3.9): no silent TF32
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    return acc


@triton.jit(do_not_specialize=["M_BUCKET"])  # only the autotuner reads it: no compile per value
def _norm_concat_linear_kernel(
    x0_ptr, x1_ptr, x2_ptr,  # [M, D_i]
    r0_ptr, r1_ptr, r2_ptr,  # [M] float32 reciprocal RMS
    w0_ptr, w1_ptr, w2_ptr,  # [D_i] norm weights
    w_ptr,  # [N, ΣD_i]
    bias_ptr,  # [N]
    out_ptr,  # [M, N]
    M, N, D0, D1, D2, stride_w,
    M_BUCKET,  # the autotune key standing for M; unused in the body
    NUM_INPUTS: tl.constexpr, NORM0: tl.constexpr, NORM1: tl.constexpr, NORM2: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _accumulate(acc, x0_ptr, r0_ptr, w0_ptr, w_ptr, offs_m, offs_n, M, N, D0, 0, stride_w, NORM0, IEEE, BLOCK_K)
    if NUM_INPUTS > 1:
        acc = _accumulate(acc, x1_ptr, r1_ptr, w1_ptr, w_ptr, offs_m, offs_n, M, N, D1, D0, stride_w, NORM1, IEEE,
                          BLOCK_K)
    if NUM_INPUTS > 2:
        acc = _accumulate(acc, x2_ptr, r2_ptr, w2_ptr, w_ptr, offs_m, offs_n, M, N, D2, D0 + D1, stride_w, NORM2,
                          IEEE, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


_tuned = None
M_BUCKET_CAP = 256  # past it one tile shape serves every M


def m_bucket(M: int) -> int:
    """The autotune key for ``M`` rows: a power of two, at most :data:`M_BUCKET_CAP`, so the
    number of tuning runs is bounded however M varies."""
    return min(triton.next_power_of_2(max(M, 1)), M_BUCKET_CAP)


def tuned_kernel():
    """The autotuned kernel object (its ``best_config`` names the winner), or None before a launch."""
    return _tuned


def norm_concat_linear_triton(xs: Sequence[Tensor], norm_weights: Sequence[Tensor | None], weight: Tensor,
                              eps: float, bias: Tensor | None) -> Tensor:
    global _tuned
    lead = xs[0].shape[:-1]
    flat = [x.reshape(-1, x.shape[-1]).contiguous() for x in xs]
    M, N = flat[0].shape[0], weight.shape[0]
    dtype = torch.result_type(flat[0], weight)
    out = torch.empty(M, N, dtype=dtype, device=weight.device)
    rstd = [torch.rsqrt(x.float().pow(2).mean(-1) + eps) for x in flat]
    nws = [w.contiguous() if w is not None else rstd[i] for i, w in enumerate(norm_weights)]
    while len(flat) < 3:  # unused slots: any valid pointer, never read
        flat.append(flat[0])
        rstd.append(rstd[0])
        nws.append(nws[0])
    norms = [w is not None for w in norm_weights] + [False] * (3 - len(norm_weights))
    dims = [x.shape[-1] for x in xs] + [0] * (3 - len(xs))
    w = weight.contiguous()
    args = (*flat, *rstd, *nws, w, bias if bias is not None else w, out, M, N, *dims, w.stride(0), m_bucket(M))
    meta = dict(NUM_INPUTS=len(xs), NORM0=norms[0], NORM1=norms[1], NORM2=norms[2], HAS_BIAS=bias is not None,
                IEEE=dtype == torch.float32 or interpreting())
    if interpreting():
        tiles = INTERPRET_TILES
        grid = (triton.cdiv(M, tiles["BLOCK_M"]), triton.cdiv(N, tiles["BLOCK_N"]))
        _norm_concat_linear_kernel[grid](*args, **meta, **tiles)
    else:
        if _tuned is None:
            _tuned = triton.autotune(configs=gemm_configs(), key=["M_BUCKET", "N", "D0", "D1", "D2"])(
                _norm_concat_linear_kernel)
        grid = lambda META: (triton.cdiv(M, META["BLOCK_M"]), triton.cdiv(N, META["BLOCK_N"]))  # noqa: E731
        _tuned[grid](*args, **meta)
    return out.reshape(*lead, N)

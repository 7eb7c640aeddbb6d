"""The Triton kernel of :mod:`specdec.kernels.compaction`: one program per (row, head, slot
block) copies ``BLOCK_S`` slots of ``D`` contiguous elements each; reads and writes are
coalesced along ``D``, and any input strides are accepted (a store's layer is a view over its buffer)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from specdec.kernels.dispatch import interpreting

__all__ = ["gather_slots_triton"]


@triton.jit
def _gather_kernel(
    x_ptr,  # [B, H, S, D], any strides
    order_ptr,  # [B, S'] int64
    out_ptr,  # [B, H, S', D] contiguous
    H, S, S_out, D,
    sxb, sxh, sxs, sxd,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    sm = offs_s < S_out
    src = tl.load(order_ptr + b * S_out + offs_s, mask=sm, other=0)
    src = tl.minimum(tl.maximum(src, 0), S - 1)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
        msk = sm[:, None] & (offs_d[None, :] < D)
        v = tl.load(x_ptr + b * sxb + h * sxh + src[:, None] * sxs + offs_d[None, :] * sxd, mask=msk)
        tl.store(out_ptr + ((bh * S_out) + offs_s[:, None]) * D + offs_d[None, :], v, mask=msk)


def gather_slots_triton(x: Tensor, order: Tensor) -> Tensor:
    B, H, S, D = x.shape
    S_out = order.shape[1]
    out = torch.empty(B, H, S_out, D, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    # a copy has nothing to tune: 16 slots × up to 128 elements per tile keeps loads wide
    block_s = 4 if interpreting() else 16
    block_d = min(128, triton.next_power_of_2(D)) if not interpreting() else 8
    grid = (B * H, triton.cdiv(S_out, block_s))
    _gather_kernel[grid](x, order.long().contiguous(), out, H, S, S_out, D, *x.stride(),
                         BLOCK_S=block_s, BLOCK_D=block_d)
    return out

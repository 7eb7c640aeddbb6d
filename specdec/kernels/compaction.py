"""Accepted-path KV compaction: gather each row's kept cache slots into contiguous slots.

After tree verification a row keeps the accepted path and drops the siblings, and after many
chain steps rejected slots pile up as holes. :meth:`specdec.kv.KVStore.compact` computes,
per row, the slot order that puts the kept slots first (``order [B, S']``) and gathers every
layer's keys and values with it: ``out[b, h, s] = x[b, h, order[b, s]]``. A pure copy, so the
Triton path equals the reference exactly. Slot ids are clamped into ``[0, S)``.

Shapes: ``x [B, H, S, D]`` (a cache layer's keys or values), ``order [B, S']`` int64.
"""

from __future__ import annotations

from torch import Tensor

from specdec.kernels import choice
from specdec.kernels.choice import pow2

__all__ = ["gather_slots", "gather_slots_reference"]


def gather_slots_reference(x: Tensor, order: Tensor) -> Tensor:
    """The specification: ``x.gather`` along the slot dimension. [B, H, S', D]"""
    idx = order.clamp(0, x.shape[2] - 1)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
    return x.gather(2, idx)


def gather_slots(x: Tensor, order: Tensor) -> Tensor:
    """``out[b, h, s] = x[b, h, order[b, s]]``; a Triton copy kernel on a GPU where it measured faster."""
    if x.dim() != 4 or order.dim() != 2 or order.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [B, H, S, D] and order [B, S'], got {tuple(x.shape)} and {tuple(order.shape)}")
    def fused() -> Tensor:
        from specdec.kernels.compaction_triton import gather_slots_triton

        return gather_slots_triton(x, order)

    B, H, _, D = x.shape
    shape = {"B": pow2(B), "H": H, "S": pow2(order.shape[1]), "D": D, "dtype": str(x.dtype).removeprefix("torch.")}
    return choice.call("gather_slots", shape, (x,), lambda: gather_slots_reference(x, order), fused)

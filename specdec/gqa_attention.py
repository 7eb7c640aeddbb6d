"""Grouped-query attention without copying the KV cache, each KV head's queries as one block of rows, on a CPU.

Verifying a block of ``m > 1`` tokens against a cache needs a mask (a chain's causal block after
the context, or a tree's). Given a mask on a CPU, transformers' SDPA attention repeats every key and
value head to the number of query heads (``repeat_kv``) before calling SDPA: for SmolLM2-135M
(9 query heads over 3 KV heads) at long contexts that copy is larger than the weights a forward
reads. ``F.scaled_dot_product_attention(..., enable_gqa=True)`` computes the same values from the
unrepeated heads. Better still, the query heads that share a KV head can be one block of rows over
it (``group × m`` queries, the mask repeated per head): SDPA then reads each KV head once for the
whole group and multiplies taller blocks, as flash-decoding kernels pack a GQA group. What each
saves is measured by the roofline question (``library_gqa`` beside ``library``; its table and
command: docs/roofline.md).

:func:`install` wraps the ``"sdpa"`` entry of transformers' attention registry (its public
``AttentionInterface``) once per process: inside :func:`grouped` (the target's own forward enters
it) attention over fewer KV heads than query heads, on a CPU, takes the packed rows (one query, or
a block under a mask the heads share) or ``enable_gqa`` (per-head masks); every other call, and
every call outside the block (transformers' ``generate``, training, a model nobody wrapped), goes
to the function it wrapped, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

__all__ = ["install", "grouped", "packed_rows"]

_ACTIVE: ContextVar[bool] = ContextVar("specdec_grouped_attention", default=False)
_ROWS: ContextVar[bool] = ContextVar("specdec_grouped_rows", default=True)
_UNSUPPORTED = ("softcap", "position_bias", "s_aux", "sinks")  # what only the wrapped function knows how to apply


class _GroupedSDPA:
    """The registry's ``"sdpa"`` function: each KV head's query group as rows where it applies
    (:meth:`route`), ``enable_gqa`` where only that does, ``inner`` otherwise."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                 **kwargs: Any) -> tuple[Tensor, None]:
        how = self.route(query, key, value, attention_mask, dropout, kwargs)
        if how is None:
            return self.inner(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                              is_causal=is_causal, **kwargs)
        if how == "gqa":
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                                 enable_gqa=True)
            return out.transpose(1, 2).contiguous(), None  # [B, m, H, D], as transformers' attention returns
        B, H, m, d = query.shape
        group = H // key.shape[1]  # query head h reads KV head h // group (transformers' repeat_kv)
        rows = query.reshape(B, key.shape[1], group * m, d)  # row j·m + p: query head (kv·group + j) at p
        mask = None if attention_mask is None else attention_mask.repeat(1, 1, group, 1)
        out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)
        return out.view(B, H, m, value.shape[-1]).transpose(1, 2).contiguous(), None

    @staticmethod
    def route(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, dropout: float,
              kwargs: dict[str, Any]) -> str | None:
        """Inside :func:`grouped`, on a CPU, fewer KV heads than query heads (a whole multiple) and
        nothing else to apply: ``"packed"`` for one query without a mask or a block under a 4-D mask
        shared by the heads, over exactly the keys; ``"gqa"`` under per-head masks;
        None (the wrapped function) otherwise."""
        if not (not torch.compiler.is_compiling() and _ACTIVE.get() and query.device.type == "cpu" and not dropout
                and key.shape[1] < query.shape[1] and query.shape[1] % key.shape[1] == 0
                and key.shape[-1] == value.shape[-1] and all(kwargs.get(k) is None for k in _UNSUPPORTED)):
            return None
        m = query.shape[2]
        rows = _ROWS.get()
        if mask is None:
            return "packed" if m == 1 and rows else None  # a block without a mask is transformers' own causal path
        if mask.dim() != 4 or mask.shape[-1] != key.shape[-2] or mask.shape[-2] != m:
            return None
        if mask.shape[1] == 1 and rows:
            return "packed"
        return "gqa" if m > 1 or mask.shape[1] > 1 else None


def install() -> None:
    """Wrap the registry's ``"sdpa"`` function (once: a second call changes nothing)."""
    current = AttentionInterface().get("sdpa")  # a fresh instance reads the class-wide entry
    if current is not None and not isinstance(current, _GroupedSDPA):
        AttentionInterface.register("sdpa", _GroupedSDPA(current))


@contextmanager
def grouped() -> Iterator[None]:
    """Within this block, grouped-query SDPA attention on a CPU reads the KV heads unrepeated."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextmanager
def packed_rows(on: bool) -> Iterator[None]:
    """Within this block, ``on=False`` keeps every head a head of its own (``enable_gqa`` for a masked
    block, the wrapped function for one query): what the packed rows save, measured beside them
    (the roofline's ``library_gqa``)."""
    token = _ROWS.set(on)
    try:
        yield
    finally:
        _ROWS.reset(token)

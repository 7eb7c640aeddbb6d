"""Grouped-query attention over a masked block without copying the KV cache, on a CPU.

Verifying a block of ``m > 1`` tokens against a cache needs a mask (a chain's causal block after
the context, or a tree's). Given a mask on a CPU, transformers' SDPA attention repeats every key and
value head to the number of query heads (``repeat_kv``) before calling SDPA: for SmolLM2-135M
(9 query heads over 3 KV heads) at 4k tokens of context that copies 0.57 GB per forward, more
than the weights it reads. ``F.scaled_dot_product_attention(..., enable_gqa=True)`` computes the
same values from the unrepeated heads (a 5-token forward there: 176 → 143 ms; docs/roofline.md).

:func:`install` wraps the ``"sdpa"`` entry of transformers' attention registry (its public
``AttentionInterface``) once per process: inside :func:`grouped` (the target's own forward enters
it) a masked block of several queries over fewer KV heads, on a CPU, takes ``enable_gqa``; every
other call, and every call outside the block (transformers' ``generate``, training, a model nobody
wrapped), goes to the function it wrapped, unchanged.
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

__all__ = ["install", "grouped"]

_ACTIVE: ContextVar[bool] = ContextVar("specdec_grouped_attention", default=False)
_UNSUPPORTED = ("softcap", "position_bias", "s_aux", "sinks")  # what only the wrapped function knows how to apply


class _GroupedSDPA:
    """The registry's ``"sdpa"`` function: ``enable_gqa`` where it applies, ``inner`` otherwise."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                 **kwargs: Any) -> tuple[Tensor, None]:
        if not self.applies(query, key, value, attention_mask, dropout, kwargs):
            return self.inner(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                              is_causal=is_causal, **kwargs)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None  # [B, m, H, D], as transformers' attention returns

    @staticmethod
    def applies(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, dropout: float,
                kwargs: dict[str, Any]) -> bool:
        """Inside :func:`grouped`, on a CPU, several queries, fewer KV heads than query heads (a
        whole multiple), a 4-D mask over exactly the keys, and nothing else to apply."""
        return (query.shape[2] > 1 and mask is not None and _ACTIVE.get() and not torch.compiler.is_compiling()
                and query.device.type == "cpu" and mask.dim() == 4 and mask.shape[-1] == key.shape[-2] and not dropout
                and key.shape[1] < query.shape[1] and query.shape[1] % key.shape[1] == 0
                and key.shape[-1] == value.shape[-1] and all(kwargs.get(k) is None for k in _UNSUPPORTED))


def install() -> None:
    """Wrap the registry's ``"sdpa"`` function (once: a second call changes nothing)."""
    current = AttentionInterface().get("sdpa")  # a fresh instance reads the class-wide entry
    if current is not None and not isinstance(current, _GroupedSDPA):
        AttentionInterface.register("sdpa", _GroupedSDPA(current))


@contextmanager
def grouped() -> Iterator[None]:
    """Within this block, masked multi-query SDPA attention on a CPU reads the KV heads unrepeated."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)

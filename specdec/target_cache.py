"""The one place that knows transformers' cache classes: a :class:`~specdec.kv.KVStore` dressed as
a ``transformers.cache_utils.Cache``.

A transformers attention layer calls ``cache.update(k, v, layer_idx)`` and attends to what it
returns; here that writes the block's K/V into the store's preallocated buffers and returns views
over the used slots plus the block. Masks and positions never come from the cache: the target
passes the store's own additive masks (:meth:`~specdec.kv.KVStore.plan`), which transformers takes
as they are, so every layer reports itself as a plain full-attention layer whatever its type.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from specdec.kv import KVStore
from specdec.transformers_versions import CacheLayer

__all__ = ["StoreCache"]


class _StoreLayer(CacheLayer):
    """Layer ``index`` of a store, as a transformers cache layer."""

    is_sliding = False  # the window is in the store's mask, never in the cache

    def __init__(self, store: KVStore, index: int):
        super().__init__()
        self.store, self.index = store, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass  # the store allocates on its first write

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return self.store.write(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.store.num_slots + query_length, 0

    def get_seq_length(self) -> int:
        return self.store.num_slots


class _EagerWritesLayer(_StoreLayer):
    """A store layer for a compiled target (``Target(compile=True)``): its writes run in eager, the
    store's buffers being inference tensors. Only there: the guard costs a little on every call."""

    @torch.compiler.disable
    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return self.store.write(self.index, key_states, value_states)


class StoreCache(Cache):
    """A transformers ``Cache`` over every layer of ``store`` (``compiled``: for a compiled decoder)."""

    def __init__(self, store: KVStore, compiled: bool = False):
        layer = _EagerWritesLayer if compiled else _StoreLayer
        super().__init__(layers=[layer(store, i) for i in range(store.num_layers)])

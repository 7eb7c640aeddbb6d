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


class _StaticLayer(_StoreLayer):
    """A store layer for a captured step: the block's K/V go to the slots a tensor holds and
    attention reads the whole buffers (:meth:`~specdec.kv.KVStore.write_static`), so nothing about
    the step depends on how many slots are in use."""

    def __init__(self, store: KVStore, index: int, slots: Tensor):
        super().__init__(store, index)
        self.slots = slots

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return self.store.write_static(self.index, key_states, value_states, self.slots)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.store.capacity, 0

    def get_seq_length(self) -> int:
        return self.store.capacity - self.slots.shape[0]  # static: the model is always given its positions


class StoreCache(Cache):
    """A transformers ``Cache`` over every layer of ``store`` (``compiled``: for a compiled decoder;
    ``slots`` [m]: the static form a captured step records, writing the block at those slots)."""

    def __init__(self, store: KVStore, compiled: bool = False, slots: Tensor | None = None):
        if slots is not None:
            layers: list[_StoreLayer] = [_StaticLayer(store, i, slots) for i in range(store.num_layers)]
        else:
            layer = _EagerWritesLayer if compiled else _StoreLayer
            layers = [layer(store, i) for i in range(store.num_layers)]
        super().__init__(layers=layers)

"""GPU memory ordering inside one Triton program, emulated in Triton's CPU interpreter.

The interpreter runs a program as whole-block numpy operations, so a value stored to global memory
is visible to the very next load. A GPU runs the same program as many threads in independent
warps: a thread's store reaches another thread's load only after a barrier (``tl.debug_barrier()``,
CUDA's ``__syncthreads``), and Triton chooses which thread owns which element, so no kernel may
assume that the thread which loads an element is the one that stored it. A load of global memory
the program stored without a barrier in between is a race the interpreter cannot show.

:func:`weak_memory` makes it show. Inside the block, every store a program makes is held back until
the program's next barrier or its end, and every load that touches an address stored since the
last barrier is recorded as a :class:`Hazard` (and reads what was there before the store, as a
lagging warp would). A kernel that passes its tests under it and records no hazard does not read
its own unsynchronised writes. Element addresses are compared, which is exact for a kernel that
reads a buffer with the element type it writes it with (the kernels here do).

Needs ``TRITON_INTERPRET=1`` set before triton is imported; patches the interpreter's builder for the
duration of the block only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Hazard", "MemoryLog", "weak_memory"]


@dataclass(frozen=True)
class Hazard:
    """A load of global memory that the same program stored without a barrier in between."""

    program: tuple[int, int, int]
    addresses: int  # how many element addresses the load shared with pending stores


@dataclass
class MemoryLog:
    """What :func:`weak_memory` saw: the hazards and how many barriers were crossed."""

    hazards: list[Hazard] = field(default_factory=list)
    barriers: int = 0
    _pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    _addresses: set[int] = field(default_factory=set)

    def _flush(self, store) -> None:
        for ptrs, value, mask in self._pending:
            store(ptrs, value, mask)
        self._pending.clear()
        self._addresses.clear()


@contextlib.contextmanager
def weak_memory() -> Iterator[MemoryLog]:
    """Run interpreted kernels with stores visible only after a barrier; yields the :class:`MemoryLog`."""
    from triton.runtime import interpreter as it

    builder = it.interpreter_builder
    log = MemoryLog()
    orig_load, orig_store = builder.create_masked_load, builder.create_masked_store
    orig_barrier, orig_grid = builder.create_barrier, builder.set_grid_idx
    orig_restore = it.GridExecutor._restore_args_dev

    def raw_store(ptrs, value, mask):
        it._interpreter.store(ptrs, value, mask)

    def load(ptrs, mask, *rest, **kwargs):  # the cache and volatility arguments vary across Triton versions
        if log._addresses:
            touched = np.asarray(ptrs.data)[np.asarray(mask.data, dtype=bool)].ravel().tolist()
            shared = sum(1 for a in touched if a in log._addresses)
            if shared:
                log.hazards.append(Hazard(tuple(builder.grid_idx), shared))
        return orig_load(ptrs, mask, *rest, **kwargs)

    def store(ptrs, value, mask, *rest, **kwargs):
        p, v, m = (np.array(x.data, copy=True) for x in (ptrs, value, mask))
        log._pending.append((p, v, m))
        log._addresses.update(p[m.astype(bool)].ravel().tolist())

    def barrier():
        log.barriers += 1
        log._flush(raw_store)

    def set_grid_idx(x, y, z):
        log._flush(raw_store)  # the previous program ended: its stores land
        orig_grid(x, y, z)

    def restore(self, *args, **kwargs):
        log._flush(raw_store)  # the last program ended: its stores land before the copy back
        return orig_restore(self, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = load, store
    builder.create_barrier, builder.set_grid_idx = barrier, set_grid_idx
    it.GridExecutor._restore_args_dev = restore
    try:
        yield log
    finally:
        builder.create_masked_load, builder.create_masked_store = orig_load, orig_store
        builder.create_barrier, builder.set_grid_idx = orig_barrier, orig_grid
        it.GridExecutor._restore_args_dev = orig_restore

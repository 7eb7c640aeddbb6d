"""Linear layers over a few rows computed as ``(W @ xᵀ)ᵀ`` on a CPU.

Verifying k + 1 tokens multiplies every weight of the target by a few rows. On a CPU, ``F.linear``
(``x @ Wᵀ``) over 2–5 rows takes a GEMM path that costs up to twice its one-row product, although
the weights are read once either way; the same product written ``W @ xᵀ`` reaches another kernel
of the same BLAS and costs much less (SmolLM2-135M, one thread: a 2-token forward 1.71× a 1-token
one with ``F.linear``, 1.26× this way; on two threads 0.93×, as its GEMV-like kernel uses both cores;
docs/roofline.md). Only the rounding differs.

:func:`install` gives every float32 ``nn.Linear`` of a model a forward that takes this path while
:func:`few_rows` is in effect (the target's own forward) and behaves as ``F.linear`` otherwise, so
the same model called elsewhere (transformers' ``generate``, a training step) is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FEW_ROWS", "install", "few_rows"]

FEW_ROWS = 5
"""Rows up to which ``W @ xᵀ`` is taken. SmolLM2-135M's forward (MKL, 128 tokens of context) took
0.74–0.87x the time of ``F.linear``'s at 2 to 5 rows (batch × block), 0.98–1.04x at 6, and
1.06–1.15x at 7 and 8 on one thread; 0.55–0.70x at 2 to 5 rows and 0.94–1.02x at 6 to 9 on two.
With two threads one row, padded with a zero row, took 0.85–0.90x (a decoding step: 46.6–48.2 ms
against 51.6–56.9); with one, 3.8x."""

_MAX_ROWS: ContextVar[int] = ContextVar("specdec_few_rows", default=0)


class _FewRowForward:
    """The forward of one ``nn.Linear``: ``W @ xᵀ`` for 2 to the current limit of rows of a
    float32 input on the CPU (from 1 row with more than one thread), ``F.linear`` for anything else."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Linear):
        self.module = module

    def __call__(self, x: Tensor) -> Tensor:
        w, b = self.module.weight, self.module.bias
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        fewest = 1 if torch.get_num_threads() > 1 else 2
        if (not fewest <= rows <= _MAX_ROWS.get() or w.device.type != "cpu"
                or w.dtype != torch.float32 or x.dtype != torch.float32):
            return F.linear(x, w, b)
        flat = x.reshape(rows, x.shape[-1])
        if rows == 1:  # one row runs on one thread (a GEMV); padded to two it uses them all
            flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
        y = torch.mm(w, flat.T).T[:rows].contiguous()  # contiguous: what follows expects it
        if b is not None:
            y += b
        return y.view(*x.shape[:-1], w.shape[0])


def install(model: nn.Module) -> int:
    """Route every plain ``nn.Linear`` of ``model`` through :class:`_FewRowForward` (an instance
    attribute: the classes are untouched; a second call changes nothing). Returns how many are."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            if not isinstance(module.__dict__.get("forward"), _FewRowForward):
                module.forward = _FewRowForward(module)
            n += 1
    return n


@contextmanager
def few_rows(max_rows: int = FEW_ROWS) -> Iterator[None]:
    """Within this block, installed linear layers over 2..``max_rows`` rows take ``W @ xᵀ``."""
    token = _MAX_ROWS.set(max_rows)
    try:
        yield
    finally:
        _MAX_ROWS.reset(token)

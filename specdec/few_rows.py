"""Linear layers over a few rows computed as ``(W @ xᵀ)ᵀ`` on a CPU, where this machine says it is faster.

Verifying k + 1 tokens multiplies every weight of the target by a few rows. On a CPU, ``F.linear``
(``x @ Wᵀ``) and the same product written ``W @ xᵀ`` reach different kernels of the BLAS, and which
is faster over 1–5 rows depends on the CPU: on an AMD EPYC a SmolLM2-135M forward over 2 tokens
took 1.71× a 1-token one with ``F.linear`` and 1.26× the other way; on an Intel Xeon with AMX
``F.linear`` is flat up to 3 rows and ``W @ xᵀ`` costs twice as much (docs/roofline.md). Only the
rounding differs.

So the choice is measured, not assumed: :func:`rows_for` times one pass over the model's own
float32 linear layers both ways for each row count up to :data:`FEW_ROWS` (at the current number
of threads, once per model and thread count: 1–2 seconds for SmolLM2 on one thread) and keeps the
row counts where ``W @ xᵀ`` is at least :data:`MARGIN` faster; :func:`pin` fixes the choice
instead (tests, or a user who measured). One row is padded with a zero row to two (a GEMV may run
on one thread).

:func:`install` gives every float32 ``nn.Linear`` of a model a forward that takes this path for
the row counts :func:`few_rows` names (the target's own forward enters it, and installs it only
once some row count was chosen) and behaves as ``F.linear`` otherwise, so the same model called
elsewhere (transformers' ``generate``, a training step) is unchanged.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FEW_ROWS", "MARGIN", "install", "few_rows", "measure", "rows_for", "pin"]

FEW_ROWS = 5
"""Row counts up to which ``W @ xᵀ`` is considered. Past 5 rows it was slower on both CPUs measured."""

MARGIN = 0.1
"""``W @ xᵀ`` is taken for a row count only when a pass takes at most ``1 - MARGIN`` of
``F.linear``'s, so that timing noise rarely flips the choice (and with it the rounding) between runs."""

_ROWS: ContextVar[frozenset[int]] = ContextVar("specdec_few_rows", default=frozenset())
_CHOSEN: weakref.WeakKeyDictionary[nn.Module, dict[int, frozenset[int]]] = weakref.WeakKeyDictionary()


class _FewRowForward:
    """The forward of one ``nn.Linear``: ``W @ xᵀ`` for the row counts in effect, of a float32
    input on the CPU; ``F.linear`` for anything else."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Linear):
        self.module = module

    def __call__(self, x: Tensor) -> Tensor:
        w, b = self.module.weight, self.module.bias
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (rows not in _ROWS.get() or w.device.type != "cpu"
                or w.dtype != torch.float32 or x.dtype != torch.float32):
            return F.linear(x, w, b)
        return _product(x.reshape(rows, x.shape[-1]), w, b).view(*x.shape[:-1], w.shape[0])


def _product(flat: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """``(W @ flatᵀ)ᵀ`` [rows, out], contiguous (what follows expects it); one row padded to two."""
    rows = flat.shape[0]
    if rows == 1:
        flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    y = torch.mm(w, flat.T).T[:rows].contiguous()
    if b is not None:
        y += b
    return y


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


def _cpu_float32_weights(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear
            and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]


@torch.inference_mode()
def measure(model: nn.Module, max_rows: int = FEW_ROWS, reps: int = 2) -> dict[int, tuple[float, float]]:
    """Seconds of one pass over ``model``'s float32 CPU linear layers per row count, ``F.linear``
    then ``W @ xᵀ``, best of ``reps`` (the two interleaved), at the current number of threads."""
    layers = _cpu_float32_weights(model)
    widths = {m.in_features for m in layers}
    gen = torch.Generator().manual_seed(0)  # its own: measuring never moves the caller's random stream
    out: dict[int, tuple[float, float]] = {}
    for rows in range(1, max_rows + 1):
        xs = {d: torch.randn(rows, d, generator=gen) for d in widths}
        best = [float("inf"), float("inf")]
        for _ in range(reps):
            for i, product in enumerate((F.linear, _product)):
                t0 = time.perf_counter()
                for m in layers:
                    product(xs[m.in_features], m.weight, m.bias)
                best[i] = min(best[i], time.perf_counter() - t0)
        out[rows] = (best[0], best[1])
    return out


def rows_for(model: nn.Module) -> frozenset[int]:
    """The row counts for which ``model``'s linear layers take ``W @ xᵀ`` at the current number of
    threads: pinned (:func:`pin`), or measured once (:func:`measure`, :data:`MARGIN`)."""
    threads = torch.get_num_threads()
    chosen = _CHOSEN.setdefault(model, {})
    if threads not in chosen:
        times = measure(model) if _cpu_float32_weights(model) else {}
        chosen[threads] = frozenset(r for r, (linear, mm) in times.items() if mm <= (1 - MARGIN) * linear)
    return chosen[threads]


def pin(model: nn.Module, rows: Iterable[int], threads: int | None = None) -> None:
    """Fix the row counts that take ``W @ xᵀ`` for ``model`` at ``threads`` (default: the current
    number), instead of measuring them."""
    rows = frozenset(rows)
    if not all(isinstance(r, int) and r >= 1 for r in rows):
        raise ValueError(f"rows must be positive integers, got {sorted(rows, key=str)}")
    _CHOSEN.setdefault(model, {})[threads or torch.get_num_threads()] = rows


@contextmanager
def few_rows(rows: Iterable[int]) -> Iterator[None]:
    """Within this block, installed linear layers over any of ``rows`` rows take ``W @ xᵀ``."""
    token = _ROWS.set(frozenset(rows))
    try:
        yield
    finally:
        _ROWS.reset(token)

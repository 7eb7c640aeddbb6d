"""Linear layers over a few rows through whichever CPU kernel this machine measured fastest.

Verifying k + 1 tokens multiplies every weight of the target by a few rows. On a CPU the same
float32 product reaches different kernels depending on how it is asked for, and which is faster
over a given number of rows depends on the CPU (docs/roofline.md):

- ``"linear"``: ``F.linear`` (``x @ Wᵀ``), the layer's own forward. On an Intel Xeon with AMX it is
  flat up to 3 rows and jumps by half at the fourth (MKL changes kernel).
- ``"mm"``: ``(W @ xᵀ)ᵀ``, another kernel of the same BLAS: 0.55–0.87x ``F.linear`` over 2–5 rows on
  an AMD EPYC, twice it on the Xeon. Considered up to :data:`MM_ROWS` rows (slower past them on
  both). One row is padded with a zero row to two (a GEMV may run on one thread).
- ``"packed"``: oneDNN's inner product on a copy of the weight in its blocked layout (what
  inductor's CPU freezing and vLLM's CPU backend prepack). On the Xeon a pass over SmolLM2's linear
  layers at 5 rows costs 1.37x ``F.linear``'s one-row pass this way against 1.76x with ``F.linear``;
  one row costs a third more than ``F.linear``'s, so it is taken only where it wins. The copy is a
  second set of those weights in memory, made at the first measurement and dropped again if no
  row count takes it.

Only the rounding differs. So the choice is measured, not assumed: :func:`plan_for` times one pass
over the model's own float32 linear layers each way at :data:`ROW_COUNTS` (at the current number of
threads, once per model, thread count and packing choice: about 4 seconds for SmolLM2 on one thread)
and keeps, per row count, the fastest product that is at least :data:`MARGIN` faster than
``F.linear``; a row count between two measured ones takes the lower one's packed choice. :func:`pin`
fixes the plan instead (tests, or a user who measured).

:func:`install` gives every float32 ``nn.Linear`` of a model a forward that follows the plan in
effect (:func:`few_rows`; the target's forward and LM head enter it, and install it only once some
row count chose another product) and behaves as ``F.linear`` otherwise, so the same model called
elsewhere (transformers' ``generate``, a training step) is unchanged.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PRODUCTS", "ROW_COUNTS", "MM_ROWS", "MARGIN", "Plan", "install", "few_rows", "measure", "choose",
           "plan_for", "pin", "packing_available", "packed_bytes"]

PRODUCTS = ("linear", "mm", "packed")
"""The products a row count can take; ``"linear"`` is the layer's own (and the default)."""

ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)
"""Row counts measured. Past the last one every layer keeps ``F.linear``."""

MM_ROWS = 5
"""``W @ xᵀ`` is considered up to this many rows (past it, slower on both CPUs measured)."""

MARGIN = 0.1
"""A product other than ``F.linear`` is taken for a row count only when a pass takes at most
``1 - MARGIN`` of ``F.linear``'s, so that timing noise rarely flips the choice (and with it the
rounding) between runs."""

Plan = Mapping[int, str]
"""Row count → ``"mm"`` or ``"packed"``; a row count not in it takes ``F.linear``."""

_EMPTY: Plan = MappingProxyType({})
_PLAN: ContextVar[Plan] = ContextVar("specdec_few_rows", default=_EMPTY)
_CHOSEN: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, bool], Plan]] = weakref.WeakKeyDictionary()
_PACKED: weakref.WeakKeyDictionary[nn.Linear, tuple[tuple, Tensor]] = weakref.WeakKeyDictionary()
_PACK_HINT = 8  # the batch size oneDNN is told to pack for (4 and 16 measured the same)


class _FewRowForward:
    """The forward of one ``nn.Linear``: the product the plan in effect names for this many rows,
    of a float32 input on the CPU outside autograd; ``F.linear`` for anything else."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Linear):
        self.module = module

    def __call__(self, x: Tensor) -> Tensor:
        module = self.module
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        how = _PLAN.get().get(rows)
        if how is None:  # the common case (one row a step): straight to the layer's own product
            return F.linear(x, module.weight, module.bias)
        w = module.weight
        if (w.device.type != "cpu" or w.dtype != torch.float32 or x.dtype != torch.float32
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return F.linear(x, w, module.bias)
        return _product(how, x.reshape(rows, x.shape[-1]), module).view(*x.shape[:-1], w.shape[0])


def _product(how: str, flat: Tensor, module: nn.Linear) -> Tensor:
    """One of :data:`PRODUCTS` over ``flat`` [rows, in] → [rows, out]: what the installed forward
    takes and what :func:`measure` times, the same call."""
    if how == "mm":
        return _mm(flat, module.weight, module.bias)
    if how == "packed":
        return _packed(flat, module)
    return F.linear(flat, module.weight, module.bias)


def _mm(flat: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """``(W @ flatᵀ)ᵀ`` [rows, out], contiguous (what follows expects it); one row padded to two."""
    rows = flat.shape[0]
    if rows == 1:
        flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    y = torch.mm(w, flat.T).T[:rows].contiguous()
    if b is not None:
        y += b
    return y


def packing_available() -> bool:
    """Whether this torch build has oneDNN's packed inner product (x86 CPU builds do)."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def _packed_weight(module: nn.Linear) -> Tensor:
    """The module's weight in oneDNN's blocked layout, made once (again if the weight changed)."""
    w = module.weight
    key = (w.data_ptr(), _version(w), tuple(w.shape))
    hit = _PACKED.get(module)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_HINT))
        _PACKED[module] = hit
    return hit[1]


def _version(w: Tensor) -> int:
    """The weight's in-place version (an inference tensor has none: it cannot change in place)."""
    try:
        return w._version
    except RuntimeError:
        return -1


def _packed(flat: Tensor, module: nn.Linear) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(flat.contiguous(), _packed_weight(module), module.bias, "none", [], "")


def packed_bytes(model: nn.Module) -> int:
    """Bytes held by packed copies of ``model``'s weights (the memory ``"packed"`` costs)."""
    return sum(_PACKED[m][1].nbytes for m in model.modules() if m in _PACKED)


def _unpack(model: nn.Module) -> None:
    for m in model.modules():
        _PACKED.pop(m, None)


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
def measure(model: nn.Module, row_counts: tuple[int, ...] = ROW_COUNTS, reps: int = 2,
            packed: bool = True) -> dict[int, dict[str, float]]:
    """Seconds of one pass over ``model``'s float32 CPU linear layers per row count and product
    (``"mm"`` up to :data:`MM_ROWS` rows, ``"packed"`` when asked and available), best of ``reps``
    with the products interleaved, at the current number of threads. Packing makes the copies."""
    layers = _cpu_float32_weights(model)
    widths = {m.in_features for m in layers}
    packed = packed and packing_available()
    if packed:
        for m in layers:  # the copies first: packing is not what a pass costs
            _packed_weight(m)
    gen = torch.Generator().manual_seed(0)  # its own: measuring never moves the caller's random stream
    out: dict[int, dict[str, float]] = {}
    for rows in row_counts:
        xs = {d: torch.randn(rows, d, generator=gen, device="cpu") for d in widths}  # not a default device
        names = ["linear"] + (["mm"] if rows <= MM_ROWS else []) + (["packed"] if packed else [])
        best = dict.fromkeys(names, float("inf"))
        for _ in range(reps):
            for name in names:
                t0 = time.perf_counter()
                for m in layers:
                    _product(name, xs[m.in_features], m)
                best[name] = min(best[name], time.perf_counter() - t0)
        out[rows] = best
    return out


def choose(times: Mapping[int, Mapping[str, float]]) -> Plan:
    """The plan from :func:`measure`'s times: per measured row count the fastest product that takes
    at most ``1 - MARGIN`` of ``F.linear``'s time; a count between two measured ones takes the
    lower one's choice if it is ``"packed"`` (``"mm"`` stays where it was measured)."""
    measured: dict[int, str] = {}
    for rows, t in times.items():
        name, best = min(((n, s) for n, s in t.items() if n != "linear"), key=lambda p: p[1], default=(None, 0.0))
        if name is not None and best <= (1 - MARGIN) * t["linear"]:
            measured[rows] = name
    plan: dict[int, str] = {}
    counts = sorted(times)
    for lo, hi in zip(counts, counts[1:] + counts[-1:]):  # the last count fills nothing past itself
        if lo in measured:
            plan[lo] = measured[lo]
            if measured[lo] == "packed":
                plan.update(dict.fromkeys(range(lo + 1, hi), "packed"))
    return MappingProxyType(plan)


def plan_for(model: nn.Module, packed: bool = True) -> Plan:
    """The plan ``model``'s linear layers follow at the current number of threads: pinned
    (:func:`pin`), or measured once (:func:`measure`, :func:`choose`). ``packed=False`` never
    considers (nor makes) packed copies. Packed copies no row count takes are dropped."""
    key = (torch.get_num_threads(), packed)
    chosen = _CHOSEN.setdefault(model, {})
    if key not in chosen:
        times = measure(model, packed=packed) if _cpu_float32_weights(model) else {}
        chosen[key] = choose(times)
        if not any(p == "packed" for plans in chosen.values() for p in plans.values()):
            _unpack(model)
    return chosen[key]


def pin(model: nn.Module, plan: Plan, threads: int | None = None, packed: bool = True) -> None:
    """Fix ``model``'s plan at ``threads`` (default: the current number) and packing choice instead
    of measuring it: ``{rows: "mm" | "packed"}``, any row count not named takes ``F.linear``."""
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be a mapping of row counts to products, got {type(plan).__name__}")
    for rows, how in plan.items():
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
            raise ValueError(f"row counts must be positive integers, got {rows!r}")
        if how not in PRODUCTS[1:]:
            raise ValueError(f"a row count takes one of {PRODUCTS[1:]}, got {how!r}")
    _CHOSEN.setdefault(model, {})[(threads or torch.get_num_threads(), packed)] = MappingProxyType(dict(plan))


@contextmanager
def few_rows(plan: Plan) -> Iterator[None]:
    """Within this block, installed linear layers follow ``plan`` (row count → product)."""
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)

"""Linear layers over a few rows through whichever CPU kernel this machine measured fastest.

Verifying k + 1 tokens multiplies every weight of the target by a few rows. On a CPU the same
float32 product reaches different kernels depending on how it is asked for, and which is faster
over a given number of rows depends on the CPU (docs/roofline.md):

- ``"linear"``: ``F.linear`` (``x @ Wᵀ``), the layer's own forward. On some CPUs it is flat over a
  few rows and then jumps where the BLAS changes kernel.
- ``"mm"``: ``(W @ xᵀ)ᵀ``, another kernel of the same BLAS: faster than ``F.linear`` over a few rows
  on some CPUs, slower on others. Considered up to :data:`MM_ROWS` rows. One row is padded with a
  zero row to two (a GEMV may run on one thread).
- ``"packed"``: oneDNN's inner product on a copy of the weight in its blocked layout (what
  inductor's CPU freezing and vLLM's CPU backend prepack): cheaper per extra row on CPUs with AMX,
  dearer for one row, so it is taken only where it wins. The measured products per row count are
  the step-anatomy and roofline tables (docs/roofline.md, with their commands). The copy is a
  second set of those weights in memory (the originals stay: the one-row forward, a tied
  embedding, transformers' own calls and training read them), so packing is bounded: only the
  layers :func:`pack_layers` picks within a **budget**, a share of the model's float32 linear
  weight bytes (:func:`set_pack_budget`; a :class:`~specdec.target.Target` sets :data:`PACK_BUDGET`
  unless told another; a model never given one packs every layer), hold a copy, the largest first (the packed op's fixed cost per call, several
  times ``F.linear``'s, is what a small layer cannot win back); the others keep ``F.linear`` inside
  a "packed" pass, and the pass is measured that way. The copies are made at the first
  measurement and dropped again if no row count takes them.

Only the rounding differs. So the choice is measured, not assumed, but never inside a timed run:
:func:`autotune` (called by :func:`specdec.load_target`, or ``specdec-autotune``) times one pass over
the model's own float32 linear layers each way at :data:`ROW_COUNTS`, :data:`REPEATS` times, and keeps,
per row count, the fastest product (by median) that is at least :data:`MARGIN` faster than
``F.linear``; a row count between two measured ones takes the lower one's packed choice.

A plan measured while other work shares the cores is wrong for good (a quiet machine's fastest
product loses to ``F.linear`` under load, and the cache keeps it), so a plan is kept only when it
was measured quietly: :func:`autotune` refuses to tune, keeping :data:`HEURISTIC` and saying why,
when other work leaves fewer free cores than the threads it measures with (:func:`busy`, from the
one-minute load average less this process's own share, :func:`other_load`) before or after
measuring, or when the repeats spread wider than :data:`SPREAD_LIMIT`. The cached plan records the
conditions it was measured under (load, cores, spread, repeats, date), and reading it costs a spot
check (:func:`spot_check`: one short pass per row count the plan sends elsewhere, its product against
``F.linear``): a plan with no conditions recorded, measured under more load than now, or whose
product is now clearly slower than ``F.linear`` is measured again. The plan is cached on disk, the way
Triton caches its autotuning, under ``$SPECDEC_CACHE/few_rows/`` (default ``~/.cache/specdec``), keyed
by the CPU model, the thread count, the dtype, the torch version, the packing choice and the
layers' shapes (:func:`plan_key`): measured once per machine, then read. :func:`plan_for`, which the
target's forward asks, never measures: it takes the plan pinned or tuned in this process, else the
cached one, else :data:`HEURISTIC` (``F.linear`` everywhere: deterministic, no copy). Every result
records which plan ran, where it came from, when and how it was measured, and how to measure it
again (:func:`plan_record`). :func:`pin` fixes the plan
instead (tests, or a user who measured).

:func:`install` gives every float32 ``nn.Linear`` of a model a forward that follows the plan in
effect (:func:`few_rows`; the target's forward and LM head enter it, and install it only once some
row count chose another product) and behaves as ``F.linear`` otherwise, so the same model called
elsewhere (transformers' ``generate``, a training step) is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.paths import cache_root, write_json_whole
from specdec.provenance import cpu_model
from specdec.timing import Stopwatch, now

__all__ = ["PRODUCTS", "ROW_COUNTS", "MM_ROWS", "MARGIN", "HEURISTIC", "Plan", "install", "few_rows", "measure",
           "choose", "plan_for", "plan_record", "plan_key", "cached_plan", "autotune", "cache_folder", "cpu_model",
           "pin", "packing_available", "packed_bytes", "PACK_BUDGET", "linear_bytes", "pack_layers", "set_pack_budget",
           "pack_budget", "REPEATS", "SPREAD_LIMIT", "RETUNE", "Times", "other_load", "cores_available", "busy",
           "spread", "spot_check", "age", "describe"]

PRODUCTS = ("linear", "mm", "packed")
"""The products a row count can take; ``"linear"`` is the layer's own (and the default)."""

ROW_COUNTS = (*range(1, 17), 32)
"""Row counts measured: every one a verification of up to 15 drafts meets (9: a draft of 8, the
model-free drafters' default, and its anchor). Past the last one every layer keeps ``F.linear``."""

REPEATS = 5
"""Passes per product and row count when tuning: the median decides, the spread is recorded."""

SPREAD_LIMIT = 0.25
"""The widest relative spread (interquartile range over the median, of any product at any row
count) a tuned plan is kept at: past it the passes disagree by more than twice :data:`MARGIN`, so
noise, not the CPU, would pick the products."""

RETUNE = "specdec-autotune --force"
"""The command that measures the plan again (on a quiet machine)."""

BUSY_SLACK = 0.5
"""Load (runnable threads) that other work may add beyond the cores left free before the machine
counts as busy: an idle machine's own daemons."""

MM_ROWS = 16
"""``W @ xᵀ`` is considered up to this many rows: on the Xeons measured it loses past 5 rows, on an
AVX2-only AMD EPYC it wins up to 10 (SmolLM2-135M, two threads: 78.2 ms a pass at 9 rows against
93.5 packed and 111.7 ``F.linear``, docs/roofline.md), so the tuner, not a constant, decides."""

MARGIN = 0.1
"""A product other than ``F.linear`` is taken for a row count only when a pass takes at most
``1 - MARGIN`` of ``F.linear``'s, so that timing noise rarely flips the choice (and with it the
rounding) between runs."""

PACK_BUDGET = 0.25
"""The share of a model's float32 linear-weight bytes its packed copies may hold by default: a
quarter (SmolLM2-135M: its tied LM head and six MLP projections, 128 of 513 MiB). Packing every
layer holds the linear weights twice."""

Plan = Mapping[int, str]
"""Row count → ``"mm"`` or ``"packed"``; a row count not in it takes ``F.linear``."""

_EMPTY: Plan = MappingProxyType({})

HEURISTIC: Plan = _EMPTY
"""The plan where none was tuned or cached for this machine: ``F.linear`` at every row count, the
layer's own product (what transformers runs), the same on every machine and run, with no second
copy of the weights. Which other product wins depends on the CPU (the module docstring), so no
rule of thumb picks one without measuring."""

_PLAN: ContextVar[Plan] = ContextVar("specdec_few_rows", default=_EMPTY)


class _Choice(NamedTuple):
    plan: Plan
    source: str  # "pinned", "measured", "cached" or "heuristic"
    measured: dict[str, Any] | None = None  # the conditions it was measured under (None: not measured)
    note: str = ""  # why this plan and not another (a refusal, a re-tune), for results to say


# model -> (threads, packed) -> the plan chosen and where it came from
_CHOSEN: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, bool], _Choice]] = weakref.WeakKeyDictionary()
_PACKED: weakref.WeakKeyDictionary[nn.Linear, tuple[tuple, Tensor]] = weakref.WeakKeyDictionary()
_UNPACKED: weakref.WeakKeyDictionary[nn.Linear, bool] = weakref.WeakKeyDictionary()  # layers a budget leaves out
_BUDGET: weakref.WeakKeyDictionary[nn.Module, float] = weakref.WeakKeyDictionary()  # model -> its budget
_PACK_HINT = 8  # the batch size oneDNN is told to pack for (4 and 16 measured the same)


class _FewRowForward:
    """The forward of one ``nn.Linear``: the product the plan in effect names for this many rows,
    of a float32 input on the CPU outside autograd; ``F.linear`` for anything else."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Linear):
        self.module = module

    def __call__(self, x: Tensor) -> Tensor:
        module = self.module
        if torch.compiler.is_compiling():  # a traced step (specdec.capture) never follows a plan
            return F.linear(x, module.weight, module.bias)
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
    if how == "packed" and module not in _UNPACKED:
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


def linear_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s float32 CPU linear weights, what a packing budget is a share of (a tied
    weight counts once per layer that reads it: each layer would get a copy of its own)."""
    return sum(m.weight.nbytes for m in _cpu_float32_weights(model))


def _check_budget(budget: float) -> float:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
        raise ValueError(f"a packing budget is a share of the linear weights' bytes in [0, 1], got {budget!r}")
    return float(budget)


def pack_layers(model: nn.Module, budget: float = PACK_BUDGET) -> list[nn.Linear]:
    """The float32 CPU linear layers of ``model`` that may hold a packed copy within ``budget`` (a
    share of :func:`linear_bytes`): the largest first, each one that still fits (ties in model order)."""
    left = _check_budget(budget) * linear_bytes(model)
    chosen = []
    for m in sorted(_cpu_float32_weights(model), key=lambda m: -m.weight.nbytes):  # a stable sort
        if m.weight.nbytes <= left:
            chosen.append(m)
            left -= m.weight.nbytes
    return chosen


def set_pack_budget(model: nn.Module, budget: float = PACK_BUDGET) -> None:
    """Let only :func:`pack_layers`'s layers hold packed copies (any other layer's copy is dropped
    now; theirs are made when first needed). Plans tuned under another budget hold for that one
    (:func:`plan_key` names the budget)."""
    budget = _check_budget(budget)
    if _BUDGET.get(model) == budget:
        return
    keep = set(map(id, pack_layers(model, budget)))
    for m in model.modules():
        if type(m) is nn.Linear:
            if id(m) in keep:
                _UNPACKED.pop(m, None)
            else:
                _UNPACKED[m] = True
                _PACKED.pop(m, None)
    _BUDGET[model] = budget


def pack_budget(model: nn.Module) -> float:
    """The packing budget in effect for ``model`` (1.0, every layer, until one is set)."""
    return _BUDGET.get(model, 1.0)


def _make_copies(model: nn.Module) -> None:
    """The packed copies of the layers within ``model``'s budget, made now (not in a timed pass)."""
    for m in _cpu_float32_weights(model):
        if m not in _UNPACKED:
            _packed_weight(m)


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


class Times(dict):
    """:func:`measure`'s result: row count → product → median seconds of a pass, with
    :attr:`spreads` (the same keys → interquartile range over the median) and :attr:`repeats`."""

    def __init__(self, medians: Mapping[int, Mapping[str, float]], spreads: Mapping[int, Mapping[str, float]],
                 repeats: int):
        super().__init__(medians)
        self.spreads, self.repeats = dict(spreads), repeats


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of a few timings (linear interpolation)."""
    xs = sorted(xs)

    def at(q: float) -> float:
        i = q * (len(xs) - 1)
        lo = int(i)
        return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (i - lo)

    return at(0.25), at(0.5), at(0.75)


@torch.inference_mode()
def measure(model: nn.Module, row_counts: tuple[int, ...] = ROW_COUNTS, reps: int = REPEATS,
            packed: bool = True) -> Times:
    """Seconds of one pass over ``model``'s float32 CPU linear layers per row count and product
    (``"mm"`` up to :data:`MM_ROWS` rows, ``"packed"`` when asked and available: the layers within
    the model's packing budget packed, the others ``F.linear``): the median of ``reps`` passes with
    the products interleaved, at the current number of threads, with their spread (:class:`Times`).
    Packing makes the copies."""
    layers = _cpu_float32_weights(model)
    widths = {m.in_features for m in layers}
    packed = packed and packing_available()
    if packed:
        _make_copies(model)  # the copies first: packing is not what a pass costs
    gen = torch.Generator().manual_seed(0)  # its own: measuring never moves the caller's random stream
    medians: dict[int, dict[str, float]] = {}
    spreads: dict[int, dict[str, float]] = {}
    for rows in row_counts:
        xs = {d: torch.randn(rows, d, generator=gen, device="cpu") for d in widths}  # not a default device
        names = ["linear"] + (["mm"] if rows <= MM_ROWS else []) + (["packed"] if packed else [])
        seconds: dict[str, list[float]] = {name: [] for name in names}
        for name in names:  # one untimed pass each: the first call of a shape pays for its set-up
            for m in layers:
                _product(name, xs[m.in_features], m)
        for _ in range(reps):
            for name in names:
                with Stopwatch() as sw:  # host products only: nothing to synchronise
                    for m in layers:
                        _product(name, xs[m.in_features], m)
                seconds[name].append(sw.seconds)
        medians[rows], spreads[rows] = {}, {}
        for name, ts in seconds.items():
            q1, med, q3 = _quartiles(ts)
            medians[rows][name], spreads[rows][name] = med, (q3 - q1) / med if med > 0 else 0.0
    return Times(medians, spreads, reps)


def spread(times: Mapping[int, Mapping[str, float]]) -> float | None:
    """The widest relative spread of :func:`measure`'s passes (None for times without spreads)."""
    spreads = getattr(times, "spreads", None)
    if not spreads:
        return None
    return max((x for t in spreads.values() for x in t.values()), default=0.0)


def cores_available() -> int:
    """The CPUs this process may run on (its affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def other_load(own_threads: int = 0, running_s: float = 0.0) -> float:
    """The one-minute load average less this process's own share: ``own_threads`` busy for the
    last ``running_s`` seconds add ``own_threads·(1 - e^(-running_s/60))`` to it (the kernel's
    average is exponential over a minute). NaN where the system has no load average."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return float("nan")
    return max(0.0, load - own_threads * (1 - math.exp(-max(running_s, 0.0) / 60)))


def busy(threads: int, load: float, cores: int | None = None) -> bool:
    """Whether other work (``load``, :func:`other_load`) leaves fewer free cores than ``threads``
    (with :data:`BUSY_SLACK` of tolerance): timings taken now measure the contention, not the CPU."""
    cores = cores or cores_available()
    return math.isfinite(load) and load + threads > cores + BUSY_SLACK


def _conditions(load: float, cores: int, threads: int, times: Mapping[int, Mapping[str, float]]) -> dict[str, Any]:
    spread_ = spread(times)
    return {"load": None if not math.isfinite(load) else round(load, 2), "cores": cores, "threads": threads,
            "repeats": getattr(times, "repeats", None), "spread": None if spread_ is None else round(spread_, 3),
            "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _busy_note(load: float, cores: int, threads: int) -> str:
    return (f"the machine is busy (other load {load:.1f} on {cores} cores, {threads} thread{'s' if threads > 1 else ''}"
            " wanted): timings now would measure the contention")


@torch.inference_mode()
def spot_check(model: nn.Module, plan: Plan, reps: int = 3) -> dict[int, tuple[float, float]]:
    """Row count → (seconds of a pass with ``plan``'s product, with ``F.linear``), best of ``reps``
    interleaved, for each row count of ``plan`` that :func:`measure` measured (a row count filled
    between two measured ones shares the lower one's product): the cheap check that a cached plan
    still holds."""
    layers = _cpu_float32_weights(model)
    gen = torch.Generator().manual_seed(0)
    out: dict[int, tuple[float, float]] = {}
    for rows, how in sorted(plan.items()):
        if rows not in ROW_COUNTS:
            continue
        xs = {d: torch.randn(rows, d, generator=gen, device="cpu") for d in {m.in_features for m in layers}}
        best = {how: float("inf"), "linear": float("inf")}
        for _ in range(reps):
            for name in best:
                with Stopwatch() as sw:
                    for m in layers:
                        _product(name, xs[m.in_features], m)
                best[name] = min(best[name], sw.seconds)
        out[rows] = (best[how], best["linear"])
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


def cache_folder() -> Path:
    """Where tuned plans are kept: ``$SPECDEC_CACHE/few_rows`` (default ``~/.cache/specdec/few_rows``)."""
    return cache_root() / "few_rows"


def plan_key(model: nn.Module, packed: bool = True, threads: int | None = None) -> dict[str, Any]:
    """What a tuned plan holds for: the CPU model, thread count, dtype, torch version, whether
    packing was considered, the row counts and products measured (a plan from a tuner that measured
    fewer is tuned again, not read), and the float32 CPU linear layers' shapes (a digest: another
    model of the same shapes takes the same products)."""
    layers = _cpu_float32_weights(model)
    shapes = sorted((m.in_features, m.out_features, m.bias is not None) for m in layers)
    return {"cpu": cpu_model(), "threads": threads or torch.get_num_threads(), "dtype": "float32",
            "torch": torch.__version__, "packed": bool(packed and packing_available()),
            "pack_budget": pack_budget(model) if packed else 0.0,
            "measured": {"rows": list(ROW_COUNTS), "products": list(PRODUCTS), "mm_rows": MM_ROWS},
            "layers": hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]}


def cache_file(key: Mapping[str, Any]) -> Path:
    """The file the plan tuned for ``key`` (:func:`plan_key`) is cached in."""
    digest = hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()[:20]
    return cache_folder() / f"{digest}.json"


def _as_plan(raw: Mapping[str, str]) -> Plan:
    plan = {int(r): how for r, how in raw.items()}
    if any(how not in PRODUCTS[1:] or rows < 1 for rows, how in plan.items()):
        raise ValueError(f"not a few-row plan: {dict(raw)!r}")
    return MappingProxyType(plan)


def _cached_record(model: nn.Module, packed: bool) -> tuple[Plan, dict[str, Any] | None] | None:
    """(plan, the conditions it was measured under, None if it records none) cached for ``model``'s
    :func:`plan_key`; None when nothing is (or the file does not parse: it is then tuned again)."""
    key = plan_key(model, packed)
    try:
        record = json.loads(cache_file(key).read_text())
        if record.get("key") != key:
            return None
        conditions = record.get("conditions")
        return _as_plan(record["plan"]), dict(conditions) if isinstance(conditions, dict) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def cached_plan(model: nn.Module, packed: bool = True) -> Plan | None:
    """The plan tuned for ``model``'s :func:`plan_key` on this machine, read from the cache; None
    when none was (or the file does not parse: it is then tuned again)."""
    hit = _cached_record(model, packed)
    return None if hit is None else hit[0]


def _stale(model: nn.Module, plan: Plan, conditions: dict[str, Any] | None, load: float) -> str | None:
    """Why a cached plan no longer holds on this machine now (None: it holds). Asked only on a quiet
    machine: a spot check under load would measure the load."""
    if conditions is None:
        return "the cached plan records no measuring conditions (load, spread, repeats)"
    then = conditions.get("load")
    if isinstance(then, (int, float)) and math.isfinite(load) and then - load >= 1.0:
        return f"the cached plan was measured under other load {then:.1f}, now {load:.1f}"
    for rows, (chosen, linear) in spot_check(model, plan).items():
        if chosen * (1 - MARGIN) > linear:  # clearly slower: by the margin a product must win by to be taken
            return (f"its {plan[rows]!r} product at {rows} rows now takes {chosen / linear:.2f}x F.linear's time"
                    " (spot check)")
    return None


def autotune(model: nn.Module, packed: bool = True, force: bool = False) -> Plan:
    """The plan for ``model`` at the current thread count, tuned once per machine: read from the
    cache (:func:`cached_plan`) and spot-checked (:func:`spot_check`, one short pass per row count
    the plan sends elsewhere), else measured (:func:`measure`, :func:`choose`, a few seconds for
    SmolLM2) and written there with the conditions it was measured under; ``force`` measures again.
    A busy machine or a wide spread is never tuned on: the plan stays as it was (cached, else
    :data:`HEURISTIC`), and :func:`plan_record` says why. Call it before any timed run
    (:func:`specdec.load_target` does); the plan then holds for this model in this process."""
    threads = torch.get_num_threads()
    key = (threads, packed)
    chosen = _CHOSEN.setdefault(model, {})
    if not _cpu_float32_weights(model):
        chosen[key] = _Choice(_EMPTY, "heuristic", None, "no float32 CPU linear layer to tune")
        return _EMPTY
    cores, load = cores_available(), other_load()
    hit = _cached_record(model, packed)
    if hit is not None and not force:
        plan, conditions = hit
        if packed and "packed" in plan.values() and packing_available():
            _make_copies(model)  # the copies now, not in the first timed forward (nor the spot check)
        if busy(threads, load, cores):
            note = f"not spot-checked: {_busy_note(load, cores, threads)}"
            chosen[key] = _Choice(plan, "cached", conditions, note)
            return plan
        why = _stale(model, plan, conditions, load)
        if why is None:
            chosen[key] = _Choice(plan, "cached", conditions, f"spot-checked at other load {load:.1f}: it holds")
            return plan
        retuned = f"measured again: {why}"
        keep = _Choice(HEURISTIC, "heuristic", None, f"the cached plan no longer holds ({why}); F.linear at every row count")
    else:
        retuned = ""
        keep = (_Choice(hit[0], "cached", hit[1], "the cached plan kept") if hit is not None  # forced
                else _Choice(HEURISTIC, "heuristic", None, "F.linear at every row count"))
    if busy(threads, load, cores):
        chosen[key] = keep._replace(note=f"not tuned: {_busy_note(load, cores, threads)}; {keep.note}"
                                         f"; re-tune with {RETUNE} on a quiet machine")
        return keep.plan
    start = now()
    times = measure(model, packed=packed)
    after = other_load(threads, now() - start)
    load = max(load, after) if math.isfinite(after) else load
    wide = spread(times)
    refusal = (_busy_note(load, cores, threads) if busy(threads, after, cores)
               else f"the repeats spread {wide:.0%} (over {SPREAD_LIMIT:.0%}): noise would pick the products"
               if wide is not None and wide > SPREAD_LIMIT else None)
    if refusal is not None:
        chosen[key] = keep._replace(note=f"not tuned: {refusal}; {keep.note}; re-tune with {RETUNE} on a quiet machine")
        if not any(p == "packed" for c in chosen.values() for p in c.plan.values()):
            _unpack(model)
        return keep.plan
    plan = choose(times)
    conditions = _conditions(load, cores, threads, times)
    chosen[key] = _Choice(plan, "measured", conditions, retuned)
    if not any(p == "packed" for c in chosen.values() for p in c.plan.values()):
        _unpack(model)
    pkey = plan_key(model, packed)
    record = {"key": pkey, "plan": {str(r): how for r, how in plan.items()},
              "times_s": {str(r): t for r, t in times.items()},
              "spreads": {str(r): t for r, t in getattr(times, "spreads", {}).items()},
              "conditions": conditions, "measured": conditions["measured"]}
    write_json_whole(cache_file(pkey), record)  # a read-only home: the plan still holds in this process
    return plan


def _resolve(model: nn.Module, packed: bool) -> _Choice:
    key = (torch.get_num_threads(), packed)
    chosen = _CHOSEN.setdefault(model, {})
    if key not in chosen:
        hit = _cached_record(model, packed) if _cpu_float32_weights(model) else None
        chosen[key] = (_Choice(hit[0], "cached", hit[1], "read from the cache, not spot-checked (autotune was not asked)")
                       if hit is not None else _Choice(HEURISTIC, "heuristic", None, "nothing tuned or cached"))
    return chosen[key]


def plan_for(model: nn.Module, packed: bool = True) -> Plan:
    """The plan ``model``'s linear layers follow at the current number of threads, never measured
    here: pinned (:func:`pin`) or tuned (:func:`autotune`) in this process, else the one cached for
    this machine (:func:`cached_plan`, read once), else :data:`HEURISTIC`. ``packed=False`` names a
    plan that never takes (nor makes) packed copies."""
    return _resolve(model, packed).plan


def age(measured: str | None, now: datetime | None = None) -> str | None:
    """How long ago an ISO-8601 UTC time was, in words ("3 days"); None when unknown."""
    if not measured:
        return None
    try:
        then = datetime.strptime(measured, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return None
    s = max(0.0, ((now or datetime.now(timezone.utc)) - then).total_seconds())
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if s >= size:
            n = int(s // size)
            return f"{n} {unit}{'s' if n > 1 else ''}"
    return "under a minute"


def describe(record: Mapping[str, Any]) -> str:
    """One line on a :func:`plan_record`: where the plan came from, when and how it was measured,
    why (a refusal, a re-tune) and how to re-tune."""
    c = record.get("conditions")
    how = ""
    if c:
        load = "unknown load" if c.get("load") is None else f"other load {c['load']:.1f}"
        spread_ = "" if c.get("spread") is None else f", spread {c['spread']:.0%}"
        reps = f"{c['repeats']} repeats" if c.get("repeats") else "repeats unknown"
        how = (f"measured {record.get('age') or '?'} ago ({c.get('measured')}), {reps} at {load} on"
               f" {c.get('cores')} cores{spread_}")
    elif record.get("source") in ("cached", "measured"):
        how = "measuring conditions not recorded"
    parts = [p for p in (how, record.get("note")) if p]
    retune = "" if RETUNE in (record.get("note") or "") else f"; re-tune: {RETUNE}"
    return f"{record['source']}" + (f"; {'; '.join(parts)}" if parts else "") + retune


def plan_record(model: nn.Module, packed: bool = True) -> dict[str, Any]:
    """Which plan :func:`plan_for` gives, for a result to record: its source (``"pinned"``,
    ``"measured"``, ``"cached"`` or ``"heuristic"``), the thread count, the plan itself (row count →
    product; a row count not named takes ``F.linear``), the conditions it was measured under
    (load, cores, spread, repeats, date; None where it was not measured), its age, a note on why
    this plan (a refusal to tune on a busy machine, a re-tune, a spot check) and the command that
    re-tunes it."""
    choice = _resolve(model, packed)
    conditions = choice.measured
    return {"source": choice.source, "threads": torch.get_num_threads(), "packed": packed,
            "pack_budget": pack_budget(model) if packed else 0.0, "packed_mib": round(packed_bytes(model) / 2**20, 1),
            "linear_mib": round(linear_bytes(model) / 2**20, 1),
            "plan": {str(r): how for r, how in sorted(choice.plan.items())},
            "conditions": conditions, "age": age(conditions.get("measured")) if conditions else None,
            "note": choice.note, "retune": RETUNE}


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
    _CHOSEN.setdefault(model, {})[(threads or torch.get_num_threads(), packed)] = _Choice(
        MappingProxyType(dict(plan)), "pinned", None, "pinned in this process")


@contextmanager
def few_rows(plan: Plan) -> Iterator[None]:
    """Within this block, installed linear layers follow ``plan`` (row count → product)."""
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)


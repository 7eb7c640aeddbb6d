"""Which path a kernel call takes on a GPU: the faster of the Triton kernel and its torch reference,
measured per device and shape, cached on disk, and recorded.

A fused kernel is not faster everywhere. On the first H200 run (docs/kernels.md) the rejection
sampler beat its reference 3–46×, but the Markov sampler ran at 0.28–0.34× of torch, the fused
draft input at 0.31–1.46× depending on the row count, and the KV gather at 0.72× for one row.
So under ``auto`` on a GPU (:mod:`specdec.kernels.dispatch`) the choice is measured, the way
Triton's autotuner measures its configs: the first call of a kernel in a shape **bucket** (the
row count as a power of two, the vocabulary, the draft count's ``N_POW2``, …; each kernel module
names its own) times both paths on that call's own inputs (:data:`WARMUP` untimed calls each,
which take the kernel's compile and autotuning, then the median of :data:`REPEATS`) and keeps the
faster. Both paths compute the same function (integers identical, floats within each kernel's
stated tolerance), so the choice changes speed only.

The choice is cached under ``$SPECDEC_CACHE/kernels/`` (default ``~/.cache/specdec/kernels``), one
file per choice, keyed by the GPU's name and architecture, torch's and triton's versions, the
kernel and its bucket (:func:`choice_key`): measured once per machine, then read. A forced backend
(``SPECDEC_KERNELS=torch|triton``, :func:`~specdec.kernels.dispatch.use_backend`) is obeyed and
never measured; off the GPU ``auto`` is the reference, as before. :func:`record` lists every choice
this process made, with its source (``measured`` or ``cached``) and times, for a run's summary.

The first call of a new bucket pays the measurement (tens of milliseconds plus any compile): warm
a benchmark up before timing it, as for Triton's autotuning. Inside a CUDA graph capture or a
``torch.compile`` trace nothing is timed: a bucket not chosen yet takes the Triton path there,
unrecorded, and is measured at its first call outside.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from specdec.kernels.dispatch import backend_for, requested
from specdec.paths import cache_root, write_json_whole
from specdec.timing import measure

__all__ = ["Choice", "call", "choice_key", "cache_folder", "device_name", "record", "last", "forget", "pow2", "seconds",
           "WARMUP", "REPEATS"]

T = TypeVar("T")
WARMUP = 2  # untimed calls per path: the first compiles and autotunes the Triton kernel
REPEATS = 7  # timed calls per path; the median decides


@dataclass(frozen=True)
class Choice:
    """The path one kernel takes in one shape bucket on one device, and why."""

    kernel: str
    shape: dict[str, Any]
    backend: str  # "triton" or "torch"
    source: str  # "measured" (here, now), "cached" (an earlier process on this machine), or why not timed
    triton_ms: float | None
    torch_ms: float | None


_CHOSEN: dict[str, Choice] = {}  # cache-key digest -> choice, for this process
_BY_CALL: dict[tuple, Choice] = {}  # (kernel, device, bucket) -> choice: the per-call lookup, no hashing of keys
_LAST: dict[str, tuple[str, str]] = {}  # kernel -> (backend, why) of its latest call


def pow2(n: int) -> int:
    """The bucket of a count: the next power of two (1 for 0 or 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def cache_folder() -> Path:
    """Where choices are kept: ``$SPECDEC_CACHE/kernels`` (default ``~/.cache/specdec/kernels``)."""
    return cache_root() / "kernels"


def _version(pkg: str) -> str | None:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


@lru_cache(maxsize=None)
def _triton_version() -> str | None:
    return _version("triton")


@lru_cache(maxsize=None)
def _device_name(kind: str, index: int | None) -> tuple[str, str]:
    if kind != "cuda":
        return kind, kind
    props = torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device())
    arch = props.gcnArchName.split(":")[0] if torch.version.hip else f"sm_{props.major}{props.minor}"
    return props.name, arch


def device_name(device: torch.device) -> dict[str, str]:
    """The GPU as a cache key names it: its name and architecture (``sm_90``, ``gfx942``)."""
    name, arch = _device_name(device.type, device.index)
    return {"name": name, "arch": arch}


def choice_key(kernel: str, shape: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """What a cached choice holds for: this GPU, these torch and triton versions, this kernel and bucket."""
    return {"device": device_name(device), "torch": torch.__version__, "triton": _triton_version(),
            "kernel": kernel, "shape": dict(shape)}


def _digest(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()[:20]


def _cached(key: Mapping[str, Any]) -> Choice | None:
    try:
        raw = json.loads((cache_folder() / f"{_digest(key)}.json").read_text())
        if raw.get("key") != json.loads(json.dumps(dict(key))) or raw["backend"] not in ("triton", "torch"):
            return None
        return Choice(key["kernel"], dict(key["shape"]), raw["backend"], "cached", raw.get("triton_ms"),
                      raw.get("torch_ms"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # none yet, or unreadable: measured again


def _store(key: Mapping[str, Any], choice: Choice) -> None:
    record = {"key": dict(key), "backend": choice.backend, "triton_ms": choice.triton_ms,
              "torch_ms": choice.torch_ms, "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_json_whole(cache_folder() / f"{_digest(key)}.json", record)  # unwritable: it holds in this process


def seconds(path: str, fn: Callable[[], Any], device: torch.device) -> float:
    """Median seconds of ``fn()``, the ``path`` (``"triton"`` or ``"torch"``) of one call, on
    ``device`` (synchronised), after :data:`WARMUP` untimed calls."""
    return measure(fn, REPEATS, warmup=WARMUP, device=device).median


def _cannot_time(device: torch.device) -> bool:
    """True inside a CUDA graph capture or a ``torch.compile`` trace, where nothing may be timed."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    return capturing or torch.compiler.is_compiling()


def _choose(kernel: str, shape: Mapping[str, Any], device: torch.device, reference: Callable[[], Any],
            fused: Callable[[], Any]) -> Choice:
    call_key = (kernel, device.type, device.index, *((k, tuple(v) if isinstance(v, list) else v)
                                                     for k, v in shape.items()))
    choice = _BY_CALL.get(call_key)
    if choice is None:
        choice = _choose_once(kernel, shape, device, reference, fused)
        if choice.source in ("measured", "cached"):
            _BY_CALL[call_key] = choice
    return choice


def _choose_once(kernel: str, shape: Mapping[str, Any], device: torch.device, reference: Callable[[], Any],
                 fused: Callable[[], Any]) -> Choice:
    key = choice_key(kernel, shape, device)
    digest = _digest(key)
    choice = _CHOSEN.get(digest) or _cached(key)
    if choice is None and _cannot_time(device):
        return Choice(kernel, dict(shape), "triton", "not timed: inside a graph capture or a compile", None, None)
    if choice is None:
        t_fused, t_ref = seconds("triton", fused, device), seconds("torch", reference, device)
        choice = Choice(kernel, dict(shape), "triton" if t_fused < t_ref else "torch", "measured",
                        round(t_fused * 1e3, 4), round(t_ref * 1e3, 4))
        _store(key, choice)
    _CHOSEN[digest] = choice
    return choice


def call(kernel: str, shape: Mapping[str, Any], tensors: Sequence[Tensor], reference: Callable[[], T],
         fused: Callable[[], T]) -> T:
    """Run one kernel call: ``fused()`` (the Triton path) or ``reference()`` (torch), as
    :func:`~specdec.kernels.dispatch.backend_for` says for ``tensors``; under ``auto`` on a GPU,
    the one measured faster for this device and ``shape`` bucket."""
    backend = backend_for(*tensors)
    why = "forced" if requested() != "auto" else "off the GPU or without triton"
    if backend == "triton" and requested() == "auto":
        choice = _choose(kernel, shape, tensors[0].device, reference, fused)
        backend, why = choice.backend, choice.source
    _LAST[kernel] = (backend, why)
    return fused() if backend == "triton" else reference()


def record() -> list[dict[str, Any]]:
    """Every choice this process made (kernel, bucket, backend, source, both times in ms), for a
    run's summary; empty where none was measured or read (off the GPU, or a forced backend)."""
    return [asdict(c) for c in sorted(_CHOSEN.values(), key=lambda c: (c.kernel, json.dumps(c.shape, sort_keys=True)))]


def last(kernel: str) -> tuple[str, str] | None:
    """(backend, why) of ``kernel``'s latest call in this process: why is ``measured``, ``cached``,
    ``forced`` or ``off the GPU or without triton``."""
    return _LAST.get(kernel)


def forget() -> None:
    """Drop this process's choices (the disk cache stays): the next call reads or measures again."""
    _CHOSEN.clear()
    _BY_CALL.clear()
    _LAST.clear()

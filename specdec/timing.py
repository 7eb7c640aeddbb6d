"""The one place that reads a clock for a measurement: device sync, warm-up, repetitions, median
and spread.

Every timing in the project goes through here (the loop's phase clock, the runner's request
timings, the roofline, the benchmarks, the step-cost profile of a draft-length policy, the few-row
plan), so each figure means the same thing: wall seconds of the host between two synchronised
points. On an asynchronous device (CUDA) a timed region starts and ends with a device sync, or
the clock would time only the host's dispatch; on the CPU a sync costs nothing.
``tests/test_layout.py`` checks that no other module reads ``time.perf_counter`` or synchronises
the device for a timing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Timing", "Stopwatch", "sync", "now", "measure", "repeat"]


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU and for ``None``."""
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device | str | None = None) -> float:
    """Seconds on the monotonic clock, after the device's queued work (when one is named)."""
    sync(device)
    return time.perf_counter()


class Stopwatch:
    """Seconds of one region, synchronised at both ends: ``with Stopwatch(dev) as sw: ...; sw.seconds``."""

    def __init__(self, device: torch.device | str | None = None):
        self.device, self.seconds = device, 0.0

    def __enter__(self) -> Stopwatch:
        self._t0 = now(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = now(self.device) - self._t0


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one thing, in seconds."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def spread(self) -> float:
        """The interquartile range (max − min under four samples): how far one run is from the next."""
        s = sorted(self.samples)
        if len(s) < 4:
            return s[-1] - s[0]
        q = statistics.quantiles(s, n=4)
        return q[2] - q[0]

    def to_dict(self, scale: float = 1.0, digits: int = 4) -> dict[str, Any]:
        """Median, spread and count (times ``scale``, e.g. 1e3 for ms) for a results file."""
        return {"median": round(self.median * scale, digits), "spread": round(self.spread * scale, digits),
                "min": round(self.min * scale, digits), "repeats": len(self.samples)}


def repeat(sample: Callable[[], float], repeats: int = 5, warmup: int = 1) -> Timing:
    """``repeats`` calls of ``sample`` (each returns the seconds it measured itself, e.g. with a
    :class:`Stopwatch` around the part that counts) after ``warmup`` untimed ones."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for _ in range(warmup):
        sample()
    return Timing(tuple(float(sample()) for _ in range(repeats)))


def measure(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1, device: torch.device | str | None = None,
            after: Callable[[], Any] | None = None) -> Timing:
    """Seconds of ``fn()``, ``repeats`` times after ``warmup`` calls, the device synchronised around
    each; ``after`` runs untimed after every call (to put state back, e.g. drop a verified block)."""

    def once() -> float:
        with Stopwatch(device) as sw:
            fn()
        if after is not None:
            after()
        return sw.seconds

    return repeat(once, repeats, warmup)

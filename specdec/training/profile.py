"""One training step under ``torch.profiler``: where a step's time goes, operator by operator.

A trainer's rate says how fast; the table says why (launch-bound, a kernel that dominates, a host
read). :func:`profiled` wraps the block it is given (the trainer wraps one whole optimiser step) and
writes the operator table, sorted by the device's own time on a GPU and by CPU time elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from specdec.timing import Stopwatch

__all__ = ["profiled"]

_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")


@contextmanager
def profiled(device: torch.device, path: Path, title: str, rows: int = 30) -> Iterator[dict[str, float]]:
    """Profile the block and write its ``rows`` costliest operators (self time) to ``path``, under
    ``title``. Yields a dict whose ``seconds`` holds, once the block has ended, the wall time of the
    block, the profiler and the table together, so a timed loop can leave all of it out of its rate."""
    on_gpu = device.type == "cuda"
    out = {"seconds": 0.0}
    with Stopwatch(device) as whole:
        with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]) as prof, \
                Stopwatch(device) as step:  # synchronised: the block's last kernels land inside the profile
            yield out
        events = prof.key_averages()
        table = events.table(sort_by="self_device_time_total" if on_gpu else "self_cpu_time_total", row_limit=rows)
        launches = sum(e.count for e in events if e.key in _LAUNCHES)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{title}\nwall {step.seconds:.4f} s under the profiler; {launches} kernel launches\n\n"
                        f"{table}\n")
    out["seconds"] = whole.seconds

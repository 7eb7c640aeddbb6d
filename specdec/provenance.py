"""Where a result or a checkpoint came from: the command, the git revision, the machine, the versions.

Training (:mod:`specdec.training.trainer`) and evaluation (:mod:`specdec.eval.runner`) record the
same fields through these helpers, so a number in a results file and the weights it was measured
on can be traced to the same kind of record (:func:`record`). The CPU is read here and only here,
once per process (:func:`cpu`): its model name and the vector/matrix extensions that decide which
kernels run, since CPUs that print the same name can run the same forward at different speeds.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ROOT", "NOTES", "ISA", "CPU", "cpu", "cpu_model", "gpu", "machine", "record", "git_sha", "git_dirty",
           "command_line", "versions", "with_kept_notes"]

ROOT = Path(__file__).resolve().parents[1]  # the repository root of a source checkout
# A generated results page keeps what follows this line (the prose on what its tables mean) when it is rendered again
NOTES = "<!-- notes: kept when the page is regenerated -->"


# the CPU extensions that decide which BLAS and oneDNN kernels a forward reaches (docs/roofline.md)
ISA = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


@dataclass(frozen=True)
class CPU:
    """What this machine's CPU is: its model name, which of :data:`ISA` it has, its logical and
    physical cores (``None`` where the system does not say)."""

    model: str
    isa: tuple[str, ...]
    logical_cores: int | None
    physical_cores: int | None


def _parse_cpuinfo(text: str) -> CPU:
    """A :class:`CPU` from the text of ``/proc/cpuinfo`` (x86 and most Linux ports name these keys)."""
    model, flags, cores = None, set(), set()
    physical_id = core_id = None
    for line in text.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name" and model is None:
            model = value
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
        elif key == "physical id":
            physical_id = value
        elif key == "core id":
            core_id = value
        elif not key and core_id is not None:  # a blank line ends one logical CPU
            cores.add((physical_id, core_id))
            physical_id = core_id = None
    if core_id is not None:
        cores.add((physical_id, core_id))
    return CPU(model or platform.processor() or platform.machine() or "unknown", tuple(f for f in ISA if f in flags),
               os.cpu_count(), len(cores) or None)


@functools.lru_cache(maxsize=1)
def cpu() -> CPU:
    """This machine's CPU, read once per process from ``/proc/cpuinfo`` (else what ``platform`` says)."""
    try:
        return _parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return _parse_cpuinfo("")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``, else what ``platform`` says)."""
    return cpu().model


def gpu() -> str | None:
    """The current CUDA (or ROCm) device's name, None without one."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def machine(dtype: str | None = None, on_gpu: bool | None = None) -> dict[str, Any]:
    """Where a job runs: the CPU (model, extensions, cores), the GPU it runs on (``on_gpu``; default:
    whenever one is present), torch's thread count and the dtype it computes in."""
    import torch

    c = cpu()
    return {"cpu": c.model, "cpu_isa": list(c.isa), "cores": c.physical_cores, "logical_cores": c.logical_cores,
            "gpu": gpu() if on_gpu or on_gpu is None else None, "threads": torch.get_num_threads(), "dtype": dtype}


def record(dtype: str | None = None, on_gpu: bool | None = None, argv: list[str] | None = None) -> dict[str, Any]:
    """One job's provenance: the command, the commit and whether the tree differed from it, the
    machine (:func:`machine`), the versions (:func:`versions`) and the date (UTC)."""
    return {"command": command_line(argv), "git_sha": git_sha(), "git_dirty": git_dirty(), **versions(),
            "machine": machine(dtype, on_gpu), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_sha() -> str | None:
    """The commit this library runs from (recorded with every result and checkpoint), or None."""
    return _git("rev-parse", "HEAD") or None


def git_dirty() -> bool | None:
    """Whether tracked files differ from that commit (None outside a git checkout): a dirty
    revision does not reproduce the run by itself."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed from the repository root: ``python <script relative to the root> args…``."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else None
    if script is not None and script.is_relative_to(ROOT):
        argv[0] = str(script.relative_to(ROOT))
    return shlex.join(["python", *argv])


def versions() -> dict[str, str]:
    """Versions that change numbers: Python, torch, transformers, and Triton where it is installed."""
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        out["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        pass
    return out


def with_kept_notes(page: Path, generated: str) -> str:
    """``generated`` followed by the notes of ``page`` as it is on disk (everything after :data:`NOTES`),
    so rendering a results page again replaces its tables and keeps its prose."""
    old = page.read_text() if page.is_file() else ""
    notes = old.split(NOTES, 1)[1] if NOTES in old else "\n"
    return generated.rstrip("\n") + "\n\n" + NOTES + notes

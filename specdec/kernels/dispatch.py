"""Which implementation of a kernel runs: the Triton kernel or its torch reference.

``auto`` (the default) considers Triton when it is installed and the tensors live on a GPU (CUDA or
ROCm), and takes the torch reference everywhere else, so the library needs no Triton on a CPU. On
a GPU it then takes whichever of the two measured faster for that device and shape
(:mod:`specdec.kernels.choice`). The choice is overridable:

- the environment variable ``SPECDEC_KERNELS=auto|torch|triton`` (read at every call, so a test
  or a launcher script can set it late);
- :func:`use_backend` — a context manager that wins over the environment, for tests and benchmarks.

Forcing ``triton`` on CPU tensors is only meaningful under ``TRITON_INTERPRET=1`` (Triton's
interpreter, 10^3–10^4× slower than torch): that is how the tests run every kernel here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from functools import lru_cache

import torch

__all__ = ["BACKENDS", "backend_for", "use_backend", "triton_available", "interpreting", "platform", "requested",
           "on_gpu_device"]

BACKENDS = ("auto", "torch", "triton")
_forced: list[str] = []  # innermost use_backend() last


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when the ``triton`` package can be imported (it is an optional extra)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True under Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def requested() -> str:
    """The backend asked for: the innermost :func:`use_backend`, else ``SPECDEC_KERNELS``, else ``auto``."""
    name = _forced[-1] if _forced else os.environ.get("SPECDEC_KERNELS", "auto")
    if name not in BACKENDS:
        raise ValueError(f"SPECDEC_KERNELS must be one of {BACKENDS}, got {name!r}")
    return name


def on_gpu_device(*tensors: torch.Tensor) -> bool:
    """True when every tensor lives on a GPU (ROCm tensors are "cuda" tensors in torch)."""
    return all(t.is_cuda for t in tensors)


def backend_for(*tensors: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"`` for a call on these tensors.

    Forcing ``triton`` without Triton installed, or on CPU tensors outside the interpreter, is an
    error rather than a silent fallback: a forced path that does not run would hide a bug.
    """
    name = requested()
    on_gpu = on_gpu_device(*tensors)
    if name == "torch":
        return "torch"
    if name == "auto":
        return "triton" if on_gpu and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError("SPECDEC_KERNELS=triton but triton is not installed (pip install 'specdec[triton]')")
    if not on_gpu and not interpreting():
        raise RuntimeError("the Triton path on CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter)")
    return "triton"


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force ``name`` (``auto``, ``torch`` or ``triton``) inside the block, whatever the environment."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def platform() -> str:
    """The tuning family of GPU 0: ``gfx942`` (MI300X), ``gfx950`` (MI355X), another ``gfx…``
    arch, ``cuda``, or ``cpu``. ROCm is recognised through ``torch.version.hip``; the arch
    name comes from ``gcnArchName`` (e.g. ``gfx942:sramecc+:xnack-``, features stripped)."""
    if not torch.cuda.is_available():
        return "cpu"
    if torch.version.hip:
        return torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    return "cuda"

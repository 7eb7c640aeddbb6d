"""The one place user input is checked: types and ranges, with an error that names the argument.

Everything here runs before any work starts. Integers must be integers (Python, numpy or a 0-d
integer tensor; ``True`` and ``2.0`` are refused), floats must be finite real numbers, and token
ids may come as lists, 1-D/2-D integer tensors or numpy arrays, never as floats.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = ["as_int", "as_float", "as_token_ids", "as_prompt_batch", "as_float_dtype", "FLOAT_DTYPES"]

FLOAT_DTYPES = ("float32", "bfloat16", "float16")  # what a drafter may run in, by name


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def as_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int, or a ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer, got a {value.dtype} tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {_describe(value)}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def as_float(name: str, value: Any, minimum: float | None = None, maximum: float | None = None,
             open_minimum: bool = False) -> float:
    """``value`` as a finite Python float within the bounds, or an error naming ``name``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a number, got a {value.dtype} tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {_describe(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and (value <= minimum if open_minimum else value < minimum):
        raise ValueError(f"{name} must be {'>' if open_minimum else '>='} {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def as_float_dtype(name: str, value: Any) -> torch.dtype | None:
    """A floating dtype by name (``FLOAT_DTYPES``), or None for ``""`` (the target's own)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a dtype name, one of {FLOAT_DTYPES} or '' (the target's), got {_describe(value)}")
    if value and value not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be one of {FLOAT_DTYPES} or '' (the target's), got {value!r}")
    return getattr(torch, value) if value else None


def _array_ids(name: str, value: Any) -> list[Any] | None:
    """Token ids of a tensor or numpy array as (nested) Python ints; None for other types."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer token ids, got a {value.dtype} tensor")
        return value.tolist()
    if type(value).__module__ == "numpy" and hasattr(value, "dtype"):
        if value.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integer token ids, got a numpy array of {value.dtype}")
        return value.tolist()
    return None


def as_token_ids(name: str, value: Any, vocab_size: int | None = None) -> list[int]:
    """One prompt's token ids (a list, a 1-D integer tensor or array) as a non-empty list of ints."""
    array = _array_ids(name, value)
    if array is not None:
        value = array
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of token ids, got {_describe(value)}")
    ids = [as_int(f"{name}[{i}]", t) for i, t in enumerate(value)]
    if not ids:
        raise ValueError(f"{name} is empty")
    if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"{name}: token ids must lie in [0, {vocab_size}), got min {min(ids)} max {max(ids)}")
    return ids


def as_prompt_batch(value: Any) -> list[str] | list[list[int]]:
    """One prompt or a batch, as text or token ids (lists, tensors, numpy) → a list of prompts.

    A string or a flat list/1-D array of ids is one prompt (a list of Python or numpy integers
    alike); a list of those, or a 2-D array, a batch.
    """
    array = _array_ids("prompts", value)
    if array is not None:
        value = array
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise TypeError(f"prompts must be a string, token ids or a non-empty list of those, got {_describe(value)}")
    if all(isinstance(p, str) for p in value):
        return list(value)
    if any(isinstance(p, str) for p in value):
        raise TypeError("prompts mixes text and token ids")
    if not isinstance(value[0], (list, tuple)) and getattr(value[0], "ndim", 0) == 0:
        return [as_token_ids("prompts", value)]  # ids: ints, numpy integers, 0-d tensors
    return [as_token_ids(f"prompts[{i}]", p) for i, p in enumerate(value)]

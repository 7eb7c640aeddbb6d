"""The fields every ``config.json`` that speculators saves carries, whatever the family (EAGLE-3,
DFlash, DSpark), as its own config classes and ``save_pretrained`` write them (speculators 0.9.0:
``SpeculatorModelConfig`` and ``VerifierConfig`` in ``speculators/config.py``):

- ``architectures``: the saving model's class name, which transformers' ``save_pretrained`` writes
  (``Eagle3DraftModel``, ``DFlashDraftModel``, ``DSparkDraftModel``), not the config classes'
  defaults (``*Speculator``);
- ``dtype`` (transformers 5's name; ``torch_dtype`` is the old one) and ``speculators_version``;
- ``speculators_config.verifier``: ``name_or_path`` and the verifier's own ``architectures``, read
  from its ``config.json`` as ``VerifierConfig.from_pretrained`` does (empty when unknown).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["SPECULATORS_VERSION", "dtype_name", "verifier_block"]

SPECULATORS_VERSION = "0.9.0"  # the release whose config classes and save code these exports follow


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``, as transformers writes ``dtype``."""
    return str(dtype).removeprefix("torch.")


def verifier_block(verifier: str | None, architectures: list[str] | None = None) -> dict[str, Any]:
    """``speculators_config.verifier``: the verifier's hub id or path and its architectures (given,
    else those of ``<verifier>/config.json`` when it is a local folder, else none)."""
    if architectures is None:
        config = Path(verifier) / "config.json" if verifier else None
        architectures = list(json.loads(config.read_text()).get("architectures") or []) if config and config.is_file() else []
    return {"name_or_path": verifier, "architectures": list(architectures)}

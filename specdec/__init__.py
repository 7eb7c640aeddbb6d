"""specdec: pluggable speculative-decoding drafters, one draft → verify loop, proven lossless.

    import specdec
    target = specdec.load_target("smollm2-135m")
    out = specdec.generate(target, "Write a Python function that reverses a string.", drafter="ngram", k=4)
    out.texts, out.summary

Names are imported on first use (PEP 562), so ``import specdec`` loads neither torch nor
transformers until something asks for them.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

# A source checkout keeps the sub-packages drafters/ and verifiers/ beside this folder and the
# committed checkpoints in experiments/checkpoints/, mapped into specdec.* by pyproject.toml. When
# Python imports specdec from the checkout itself (a REPL or script started in its root, whatever
# the install), the sub-packages are found there too.
_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "drafters" / "__init__.py").is_file():
    __path__ += [str(_ROOT), str(_ROOT / "experiments")]

_EXPORTS = {
    "GenerationResult": "specdec.api", "generate": "specdec.api", "load_target": "specdec.api",
    "make_drafter": "specdec.api", "make_verifier": "specdec.api",
    "Request": "specdec.loop", "run": "specdec.loop",
    "SamplingParams": "specdec.sampling",
    "Target": "specdec.target",
    "Committed": "specdec.types", "DraftProposal": "specdec.types", "Requirements": "specdec.types",
    "Verification": "specdec.types",
    "Drafter": "specdec.drafter", "Verifier": "specdec.verifier",
    "register_drafter": "specdec.registry", "register_verifier": "specdec.registry",
    "custom_generate": "specdec.hf",
    "registry": None,  # a sub-module: specdec.registry
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from specdec.api import GenerationResult, generate, load_target, make_drafter, make_verifier
    from specdec.drafter import Drafter
    from specdec.hf import custom_generate
    from specdec.loop import Request, run
    from specdec.registry import register_drafter, register_verifier
    from specdec.sampling import SamplingParams
    from specdec.target import Target
    from specdec.types import Committed, DraftProposal, Requirements, Verification
    from specdec.verifier import Verifier


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    module = _EXPORTS[name]
    value = importlib.import_module(f"specdec.{name}") if module is None else getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

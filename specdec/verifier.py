"""The Verifier contract.

A verifier turns a draft and the target's logits at every draft node into the tokens a row
emits this step. Verifiers import only :mod:`specdec.types` and :mod:`specdec.sampling`, never a
drafter. Each states whether it is ``lossless``; lossy ones are never the default.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import ClassVar

from torch import Tensor

from specdec.sampling import RowSampling
from specdec.types import DraftProposal, Verification

__all__ = ["Verifier"]


class Verifier(ABC):
    name: ClassVar[str]
    lossless: ClassVar[bool]

    @classmethod
    def option_names(cls) -> tuple[str, ...] | None:
        """The options the constructor takes, so a misspelt one fails by name (as drafters'
        do); None (nothing checked) when it takes free ``**options``."""
        if cls.__init__ is object.__init__:
            return ()
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # after self
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return None
        return tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))

    def check(self, rows: RowSampling) -> None:
        """Raise before any work starts if this verifier cannot serve these requests."""

    @abstractmethod
    def verify(self, proposal: DraftProposal, logits: Tensor, rows: RowSampling) -> Verification:
        """logits [B, n+1, V]: position 0 is the root (last committed token), j+1 is node j."""

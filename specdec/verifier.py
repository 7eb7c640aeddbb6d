"""The Verifier contract.

A verifier turns a draft and the target's logits at every draft node into the tokens a row
emits this step. Verifiers import only :mod:`specdec.types` and :mod:`specdec.sampling`, never a
drafter. Each states whether it is ``lossless``; lossy ones are never the default.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from torch import Tensor

from specdec.sampling import RowSampling
from specdec.types import DraftProposal, Verification

__all__ = ["Verifier"]


class Verifier(ABC):
    name: ClassVar[str]
    lossless: ClassVar[bool]

    def check(self, rows: RowSampling) -> None:
        """Raise before any work starts if this verifier cannot serve these requests."""

    @abstractmethod
    def verify(self, proposal: DraftProposal, logits: Tensor, rows: RowSampling) -> Verification:
        """logits [B, n+1, V]: position 0 is the root (last committed token), j+1 is node j."""

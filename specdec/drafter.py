"""The Drafter contract.

A drafter is bound once to a target, declares what it needs from it, builds its own state from
the prompt, proposes a chain or a tree each step, and rolls its state forward (or back) from what
the target committed. The loop calls nothing else, so it never names a drafter.

Every registered drafter provides :meth:`Drafter.tiny`: a random-weight instance for a tiny
target of any supported family. The conformance suite builds every drafter that way.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import fields
from typing import Any, ClassVar

from torch import Tensor

from specdec.sampling import RowSampling
from specdec.target import Target
from specdec.types import Committed, DraftProposal, Requirements

__all__ = ["Drafter"]


class Drafter(ABC):
    name: ClassVar[str]
    options_class: ClassVar[type | None] = None  # the dataclass whose fields :meth:`create` takes as ``**options``

    @classmethod
    def option_names(cls) -> tuple[str, ...] | None:
        """The options :meth:`create` accepts, so a misspelt one fails by name: its named keyword
        parameters, plus the fields of :attr:`options_class` when it takes ``**options``; None
        (nothing checked) when it takes free ``**options`` and declares no class."""
        params = list(inspect.signature(cls.create).parameters.values())[1:]  # after target
        names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if any(p.kind is p.VAR_KEYWORD for p in params):
            if cls.options_class is None:
                return None
            names += [f.name for f in fields(cls.options_class)]
        return tuple(dict.fromkeys(names))

    def requirements(self) -> Requirements:
        """Features the target must capture for this drafter (none by default)."""
        return Requirements()

    def bind(self, target: Target) -> None:
        """Check compatibility with ``target`` (vocabulary, sizes) and keep what is shared.

        Raise ``ValueError`` on a mismatch: this runs before any generation work. Checks that the
        target has the layers :meth:`requirements` names (the loop asks the target to capture them
        for each generation only).
        """
        target.check(self.requirements())
        self.target = target

    def check_k(self, k: int) -> None:
        """Raise ``ValueError`` if this drafter cannot propose ``k`` tokens (or a tree of depth ``k``):
        the loop calls it before any generation work, so a too-large ``k`` fails with the drafter's
        own reason instead of deep inside a step. Any ``k`` by default."""

    @abstractmethod
    def start(self, prefill: Committed, rows: RowSampling) -> Any:
        """Build per-generation state from the committed prompt; return it."""

    @abstractmethod
    def propose(self, state: Any, k: int, rows: RowSampling) -> DraftProposal:
        """Propose up to ``k`` tokens per row (a chain), or a tree of depth <= ``k``."""

    @abstractmethod
    def observe(self, state: Any, committed: Committed) -> None:
        """Roll the state forward to what the target committed (and back from rejected drafts)."""

    @abstractmethod
    def select_rows(self, state: Any, rows: Tensor) -> None:
        """Keep only these batch rows in ``state`` (finished requests are retired)."""

    @classmethod
    @abstractmethod
    def create(cls, target: Target, **options: Any) -> Drafter:
        """Build from user options (what a config file or ``make_drafter`` passes) and bind."""

    @classmethod
    @abstractmethod
    def tiny(cls, target: Target, **overrides: Any) -> Drafter:
        """A random-weight instance bound to a tiny ``target``, for the conformance suite."""

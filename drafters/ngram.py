"""Prompt-lookup n-gram drafting (Saxena 2023; transformers' ``prompt_lookup_num_tokens``).

No model: find the most recent earlier occurrence of the context's last ``n`` tokens (longest
``n`` first, from ``max_ngram`` down to ``min_ngram``) and propose the tokens that followed it.
Deterministic, so ``q`` is ``None`` and the verifier treats every draft as one-hot. Rows
without a match propose nothing that step (``num_valid = 0``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specdec.drafter import Drafter
from specdec.sampling import RowSampling
from specdec.target import Target
from specdec.types import Committed, DraftProposal, padded_ids

__all__ = ["NgramDrafter", "NgramConfig", "lookup", "transformers_peer"]


@dataclass(frozen=True)
class NgramConfig:
    max_ngram: int = 3  # longest suffix matched; transformers' default is 2
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")


def lookup(context: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The up-to-``k`` tokens that followed the latest earlier match of the context's suffix."""
    L = len(context)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = context[L - n:]
        for start in range(L - n - 1, -1, -1):  # latest match first, excluding the suffix itself
            if context[start:start + n] == suffix:
                return context[start + n:start + n + k]
    return []


class NgramDrafter(Drafter):
    name = "ngram"

    options_class = NgramConfig

    def __init__(self, config: NgramConfig | None = None):
        self.config = config or NgramConfig()

    def start(self, prefill: Committed, rows: RowSampling) -> list[list[int]]:
        history = []
        for toks, n, nxt in zip(prefill.tokens.tolist(), prefill.num_tokens.tolist(), prefill.next_tokens.tolist()):
            history.append(toks[:n] + [nxt])
        return history

    def propose(self, state: list[list[int]], k: int, rows: RowSampling) -> DraftProposal:
        drafts = [lookup(h, k, self.config.max_ngram, self.config.min_ngram) for h in state]
        dev = self.target.device
        tokens = padded_ids(drafts, k, 0, dev)
        num_valid = torch.tensor([len(d) for d in drafts], dtype=torch.long, device=dev)
        return DraftProposal.chain(tokens, None, num_valid)

    def observe(self, state: list[list[int]], committed: Committed) -> None:
        for h, toks, n, nxt in zip(state, committed.tokens.tolist(), committed.num_tokens.tolist(),
                                   committed.next_tokens.tolist()):
            h.extend(toks[1:n])  # toks[0] is the previous next token, already in the history
            h.append(nxt)

    def select_rows(self, state: list[list[int]], rows: Tensor) -> None:
        state[:] = [state[i] for i in rows.tolist()]

    @classmethod
    def create(cls, target: Target, **options: Any) -> NgramDrafter:
        d = cls(NgramConfig(**options))
        d.bind(target)
        return d

    @classmethod
    def tiny(cls, target: Target, **overrides: Any) -> NgramDrafter:
        return cls.create(target, **overrides)


def transformers_peer(target: Target, drafter: Drafter | None, k: int) -> dict[str, Any]:
    """``generate()`` arguments for transformers' prompt lookup, the peer of this drafter: ``k``
    tokens per step, matching the drafter's ``max_ngram`` (transformers' own default, 2, for any
    other drafter)."""
    extra: dict[str, Any] = {"prompt_lookup_num_tokens": k}
    if isinstance(drafter, NgramDrafter):
        extra["max_matching_ngram_size"] = drafter.config.max_ngram
    return extra

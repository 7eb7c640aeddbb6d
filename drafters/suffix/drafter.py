"""SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975), as vLLM's ``method="suffix"`` and
Snowflake's Arctic Inference ship it: a model-free drafter over suffix trees.

Each request has its own suffix tree over its prompt and output so far; a global tree holds the
outputs of earlier (and concurrent) requests of this process for the same target, bounded in
sequences and tokens and evicted oldest first. Each step, every suffix of the request's last
``max_depth`` tokens that occurs in a tree yields a draft tree grown from the matched node by
empirical frequency (``count(child) / count(node)``, multiplied down the path), with
``min(max_spec_tokens, max_spec_factor * match_length + max_spec_offset)`` nodes; the
best-scoring draft of both trees is proposed. Deterministic: ``q`` is ``None``; each node's
frequency score given its parent is reported as its ``confidence``.

The global tree makes a row's drafts depend on what other requests produced. That never changes
the output distribution (a draft is fixed before the row's verification draws its random numbers),
but it does change which random numbers a sampled row consumes, so a sampled row drafting from it
is not reproducible seed-for-seed across batch compositions or histories (greedy rows are). So a
seeded sampled row drafts from its own tree only, unless ``global_for_seeded`` (its output still
feeds the global tree for the others); the ``coupled`` verifier pins its tokens either way.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specdec.drafter import Drafter
from specdec.drafters.suffix.tree import Draft, OutputCache, SuffixTree
from specdec.sampling import RowSampling
from specdec.target import Target
from specdec.types import Committed, DraftProposal, padded_ids
from specdec.validate import as_float, as_int

__all__ = ["SuffixDrafter", "SuffixConfig", "global_cache", "clear_global_caches"]

# The global trees of this process: one per target (and tree depth), gone with the target.
_CACHES: weakref.WeakKeyDictionary[Target, dict[int, OutputCache]] = weakref.WeakKeyDictionary()


def global_cache(target: Target, max_depth: int) -> OutputCache:
    """The global tree every suffix drafter of ``target`` with this ``max_depth`` shares."""
    return _CACHES.setdefault(target, {}).setdefault(max_depth, OutputCache(max_depth))


def clear_global_caches() -> None:
    """Forget every earlier output (tests, or a new workload that must start cold)."""
    _CACHES.clear()


@dataclass(frozen=True)
class SuffixConfig:
    """Defaults are vLLM's (``suffix_decoding_*`` of its SpeculativeConfig) where it has one."""

    max_depth: int = 24  # suffix-tree depth: match length + draft depth (vLLM max_tree_depth; Arctic 64)
    max_spec_tokens: int | None = None  # draft nodes per step at most; None = k
    max_spec_factor: float = 1.0  # nodes <= max_spec_factor * match length + max_spec_offset
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1  # nodes whose estimated path probability is lower are never drafted
    tree: bool = True  # a frequency-scored tree (the paper); False: the best path only (vLLM's use)
    max_cached_requests: int = 10000  # outputs in the global tree (oldest evicted); 0 = no global tree
    max_cached_tokens: int = 200_000  # tokens in the global tree (oldest outputs evicted); ~0.5 kB each
    # seeded sampled rows draft from the global tree too: their tokens then depend on what other
    # requests produced (the distribution does not), so a seed no longer pins them; off by default
    global_for_seeded: bool = False

    def __post_init__(self) -> None:
        ints = {"max_depth": 2, "max_cached_requests": 0, "max_cached_tokens": 1}
        for name, least in ints.items():
            object.__setattr__(self, name, as_int(name, getattr(self, name), minimum=least))
        if self.max_spec_tokens is not None:
            object.__setattr__(self, "max_spec_tokens", as_int("max_spec_tokens", self.max_spec_tokens, minimum=1))
        object.__setattr__(self, "max_spec_factor", as_float("max_spec_factor", self.max_spec_factor, minimum=0))
        object.__setattr__(self, "max_spec_offset", as_float("max_spec_offset", self.max_spec_offset))
        object.__setattr__(self, "min_token_prob",
                           as_float("min_token_prob", self.min_token_prob, minimum=0, maximum=1))
        for flag in ("tree", "global_for_seeded"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {getattr(self, flag)!r} ({type(getattr(self, flag)).__name__})")
        if self.max_spec_factor * (self.max_depth - 1) + self.max_spec_offset < 1:
            raise ValueError(f"max_spec_factor={self.max_spec_factor} and max_spec_offset={self.max_spec_offset}"
                             f" allow no draft token even for the longest match ({self.max_depth - 1} tokens)")


@dataclass
class _Row:
    local: SuffixTree  # this request's prompt and output, as sequence 0
    output: int | None  # its output's sequence id in the global tree; None without one


class SuffixDrafter(Drafter):
    name = "suffix"

    options_class = SuffixConfig

    def __init__(self, config: SuffixConfig | None = None):
        self.config = config or SuffixConfig()
        self.cache: OutputCache | None = None

    def bind(self, target: Target) -> None:
        super().bind(target)
        c = self.config
        self.cache = global_cache(target, c.max_depth) if c.max_cached_requests > 0 else None

    def _caps(self) -> tuple[int, int]:
        return self.config.max_cached_requests, self.config.max_cached_tokens

    def start(self, prefill: Committed, rows: RowSampling) -> list[_Row]:
        state = []
        for toks, n, nxt in zip(prefill.tokens.tolist(), prefill.num_tokens.tolist(), prefill.next_tokens.tolist()):
            local = SuffixTree(self.config.max_depth)
            local.extend(0, toks[:n] + [nxt])
            output = None
            if self.cache is not None:
                output = self.cache.add(*self._caps())
                self.cache.extend(output, [nxt], *self._caps())
            state.append(_Row(local, output))
        return state

    def _speculate(self, row: _Row, k: int, shared: bool = True) -> Draft:
        c = self.config
        args = (row.local.seqs[0][-c.max_depth:], k if c.max_spec_tokens is None else c.max_spec_tokens,
                c.max_spec_factor, c.max_spec_offset, c.min_token_prob, k, c.tree)
        draft = row.local.speculate(*args)
        if self.cache is not None and shared:
            other = self.cache.tree.speculate(*args)
            if other.score > draft.score:  # ties go to the request's own tree, as in Arctic
                draft = other
        return draft

    def propose(self, state: list[_Row], k: int, rows: RowSampling) -> DraftProposal:
        # a seeded sampled row keeps to its own tree (its seed then pins its tokens), unless opted in
        own = [p.seed is not None and not p.greedy and not self.config.global_for_seeded for p in rows.params]
        drafts = [self._speculate(row, k, shared=not o) for row, o in zip(state, own)]
        n = max(len(d.tokens) for d in drafts)
        dev = self.target.device
        tokens = padded_ids([d.tokens for d in drafts], n, 0, dev)
        # padding: children of the root
        parents = padded_ids([d.parents for d in drafts], n, -1, dev)
        num_valid = torch.tensor([len(d.tokens) for d in drafts], dtype=torch.long, device=dev)
        # each node's frequency score given its parent: count(child) / count(node)
        conf = [[pr / (d.probs[p] if p >= 0 else 1.0) for pr, p in zip(d.probs, d.parents)] for d in drafts]
        confidence = torch.tensor([c + [0.0] * (n - len(c)) for c in conf], dtype=torch.float32, device=dev)
        return DraftProposal(tokens, parents, None, num_valid, confidence)

    def observe(self, state: list[_Row], committed: Committed) -> None:
        for row, toks, n, nxt in zip(state, committed.tokens.tolist(), committed.num_tokens.tolist(),
                                     committed.next_tokens.tolist()):
            new = toks[1:n] + [nxt]  # toks[0] is the previous next token, already stored
            row.local.extend(0, new)
            if self.cache is not None and row.output is not None:
                self.cache.extend(row.output, new, *self._caps())

    def select_rows(self, state: list[_Row], rows: Tensor) -> None:
        state[:] = [state[i] for i in rows.tolist()]  # retired outputs stay in the global tree

    @classmethod
    def create(cls, target: Target, **options: Any) -> SuffixDrafter:
        d = cls(SuffixConfig(**options))
        d.bind(target)
        return d

    @classmethod
    def tiny(cls, target: Target, **overrides: Any) -> SuffixDrafter:
        """Per-request trees only by default: the conformance suite checks that a sampled row is
        reproduced exactly whatever its batch, which a shared global tree gives up by design
        (see the module docstring); tests/test_suffix.py checks the global tree separately."""
        return cls.create(target, **{"max_cached_requests": 0, **overrides})

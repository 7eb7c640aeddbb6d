"""The data that crosses the seams between target, drafter, verifier and loop.

Shape symbols: ``B`` batch rows, ``n`` draft nodes per row (a chain has ``n = k``), ``m`` tokens
in one target block, ``V`` vocabulary, ``D`` hidden size.

A draft is a tree given by parent indices; a chain is the tree ``parents = [-1, 0, 1, ...]``.
Node ``j`` of the proposal is verified against the target distribution at block position
``j + 1``; block position 0 is the last committed token (the root).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from specdec.kv import KVStore

__all__ = ["Requirements", "DraftProposal", "Verification", "Committed", "chain_parents", "node_depths", "padded_ids"]


@dataclass(frozen=True)
class Requirements:
    """What a drafter needs the target to hand out.

    ``layer_inputs`` are residual-stream ids: id ``i`` is the hidden state at the *input* of
    layer ``i`` (EAGLE-3's convention); id ``L`` (the layer count) is the last layer's output,
    before the final norm. Use :func:`specdec.target.layer_output_ids` to convert DFlash-style
    "output of layer i" ids.
    """

    layer_inputs: tuple[int, ...] = ()
    final_hidden: bool = False  # post-norm final hidden state: what the LM head reads
    target_cache: bool = False  # read access to the target's KV cache

    def union(self, other: Requirements) -> Requirements:
        return Requirements(
            layer_inputs=tuple(sorted(set(self.layer_inputs) | set(other.layer_inputs))),
            final_hidden=self.final_hidden or other.final_hidden,
            target_cache=self.target_cache or other.target_cache,
        )


def chain_parents(n: int, batch: int = 1, device: torch.device | str = "cpu") -> Tensor:
    """Parent indices of a chain of ``n`` nodes: ``[-1, 0, 1, ..., n-2]`` per row. [B, n]"""
    return (torch.arange(n, device=device) - 1).expand(batch, n).clone()


def padded_ids(rows: Sequence[Sequence[int]], width: int, fill: int, device: torch.device | str = "cpu") -> Tensor:
    """Ragged integer rows right-padded with ``fill`` to ``width`` as one long tensor on ``device``,
    built in one host→device copy (drafts, prompts and parent lists cross the seams this way). [R, width]"""
    if any(len(r) > width for r in rows):
        raise ValueError(f"a row is longer than width={width}")
    return torch.tensor([[*r, *[fill] * (width - len(r))] for r in rows], dtype=torch.long, device=device)


def node_depths(parents: Tensor) -> Tensor:
    """Depth of every node (children of the root have depth 1). [B, n] from parents [B, n]."""
    depth = torch.zeros_like(parents)
    for j in range(parents.shape[1]):
        p = parents[:, j]
        parent_depth = depth.gather(1, p.clamp(min=0).unsqueeze(1)).squeeze(1)
        depth[:, j] = torch.where(p < 0, 1, parent_depth + 1)
    return depth


@dataclass
class DraftProposal:
    """What a drafter proposes for one step.

    ``q[b, j]`` is the exact distribution node ``j`` was drawn from, conditioned on its parent
    *and on its earlier siblings* (so i.i.d. siblings share q, siblings drawn without replacement
    carry renormalised q, and deterministic siblings are one-hot). It is the distribution after
    the same temperature / top-k / top-p warping the target gets. ``q is None`` declares the
    whole draft deterministic: the verifier then treats every node's q as one-hot.
    Siblings must appear in the order they were drawn, and parents before children.
    ``confidence`` is optional advice for draft-length policies (:mod:`specdec.policy`): the
    drafter's estimate that node ``j`` is accepted given its parent was. It never reaches the
    verifier.
    """

    tokens: Tensor  # [B, n] int64
    parents: Tensor  # [B, n] int64, -1 for a child of the last committed token
    q: Tensor | None = None  # [B, n, V] float, or None when deterministic
    num_valid: Tensor | None = None  # [B] nodes to verify per row; the rest is padding
    confidence: Tensor | None = None  # [B, n] in [0, 1], or None
    # Host-known facts, so the loop reads nothing back from the device to act on them:
    is_chain: bool = field(default=False, init=False)  # built by chain() / empty(): parents are a chain's
    all_valid: bool = field(default=False, init=False)  # num_valid was not given: every node is verified

    def __post_init__(self) -> None:
        if self.parents.dim() == 1:
            self.parents = self.parents.expand(self.tokens.shape[0], -1).clone()
        if self.num_valid is None:
            self.all_valid = True
            self.num_valid = torch.full(
                (self.tokens.shape[0],), self.tokens.shape[1], dtype=torch.long, device=self.tokens.device
            )

    @property
    def deterministic(self) -> bool:
        return self.q is None

    @property
    def n(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def chain(cls, tokens: Tensor, q: Tensor | None = None, num_valid: Tensor | None = None,
              confidence: Tensor | None = None) -> DraftProposal:
        p = cls(tokens, chain_parents(tokens.shape[1], tokens.shape[0], tokens.device), q, num_valid, confidence)
        p.is_chain = True
        return p

    @classmethod
    def empty(cls, batch: int, device: torch.device | str = "cpu") -> DraftProposal:
        tokens = torch.zeros(batch, 0, dtype=torch.long, device=device)
        p = cls(tokens, tokens.clone(), None, torch.zeros(batch, dtype=torch.long, device=device))
        p.is_chain = p.all_valid = True
        return p

    def with_num_valid(self, num_valid: Tensor) -> DraftProposal:
        """The same drafts with fewer of them verified per row (a draft-length policy's choice)."""
        p = DraftProposal(self.tokens, self.parents, self.q, num_valid, self.confidence)
        p.is_chain = self.is_chain
        return p

    def check_shapes(self, batch: int, vocab_size: int) -> None:
        """The checks of :meth:`validate` that read nothing from the device."""
        B, n = self.tokens.shape
        if B != batch:
            raise ValueError(f"proposal has {B} rows, the batch has {batch}")
        if self.tokens.dtype != torch.long:
            raise ValueError(f"proposal tokens must be int64, got {self.tokens.dtype}")
        if self.parents.shape != (B, n):
            raise ValueError(f"parents shape {tuple(self.parents.shape)} != tokens shape {(B, n)}")
        if self.q is not None and self.q.shape != (B, n, vocab_size):
            raise ValueError(f"q shape {tuple(self.q.shape)} != {(B, n, vocab_size)}")
        if self.confidence is not None and self.confidence.shape != (B, n):
            raise ValueError(f"confidence shape {tuple(self.confidence.shape)} != {(B, n)}")

    def invalid(self, vocab_size: int) -> Tensor:
        """Whether any value check of :meth:`validate` fails, as a 0-d bool tensor on the device:
        the loop reads it with the step's one synchronisation, then calls :meth:`validate` for the message."""
        return torch.stack([bad for bad, _ in self._value_checks(vocab_size)]).any()

    def validate(self, batch: int, vocab_size: int) -> None:
        """Raise a clear error for a malformed proposal (a drafter bug), before verification."""
        self.check_shapes(batch, vocab_size)
        for bad, message in self._value_checks(vocab_size):
            if bool(bad):
                raise ValueError(message())

    def _value_checks(self, vocab_size: int) -> list[tuple[Tensor, Callable[[], str]]]:
        """(0-d bool tensor: the check fails, its message) for every check of the values."""
        assert self.num_valid is not None
        n, dev = self.n, self.tokens.device
        idx = torch.arange(n, device=self.parents.device)
        checks: list[tuple[Tensor, Callable[[], str]]] = [
            (((self.tokens < 0) | (self.tokens >= vocab_size)).any(), lambda: f"draft token ids must lie in [0, {vocab_size})"),
            (((self.parents < -1) | (self.parents >= idx)).any().to(dev),
             lambda: "every parent index must be -1 or the index of an earlier node"),
            (((self.num_valid < 0) | (self.num_valid > n)).any().to(dev), lambda: f"num_valid must lie in [0, {n}]"),
        ]
        if self.q is not None and n:
            # A drafted token must have positive probability under the q it was drawn from: the
            # rejection rule u·q(x) < p(x) would accept a q(x) = 0 token whenever p(x) > 0.
            valid = torch.arange(n, device=self.q.device) < self.num_valid.to(self.q.device).unsqueeze(1)
            tokens = self.tokens.to(self.q.device).clamp(0, vocab_size - 1)
            q_tok = self.q.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, n]
            zero = valid & ~(q_tok > 0)  # catches q(x) = 0 and NaN alike

            def message() -> str:
                b, j = zero.nonzero()[0].tolist()
                return (f"row {b}, node {j}: drafted token {int(self.tokens[b, j])} has q = {float(q_tok[b, j])}"
                        " under the q reported for it; q must be the distribution it was drawn from")

            checks.append((zero.any().to(dev), message))
        return checks


@dataclass
class Verification:
    """The verifier's verdict for one step.

    ``path[b, :num_accepted[b]]`` are the accepted node indices, root to leaf. ``tokens[b]``
    holds the emitted tokens: the accepted drafts, then one more token (the bonus token if the
    whole path was accepted down to a leaf, else the token recovered from the residual).
    """

    path: Tensor  # [B, n] int64, -1 padded
    num_accepted: Tensor  # [B] int64
    tokens: Tensor  # [B, n+1] int64, -1 padded

    @property
    def num_emitted(self) -> Tensor:
        return self.num_accepted + 1

    @property
    def next_tokens(self) -> Tensor:
        """The last emitted token per row. [B]"""
        return self.tokens.gather(1, self.num_accepted.unsqueeze(1)).squeeze(1)


@dataclass
class Committed:
    """What the drafter learns after the prefill and after every step.

    ``tokens`` are the tokens whose target KV entries were committed just now: the whole prompt
    at the prefill; the last committed token and the accepted drafts after a step. ``hidden`` and
    ``final_hidden`` are the target's features at exactly those tokens. ``next_tokens`` follow
    them: sampled by the target, not yet in its cache, and the anchor of the next draft.
    """

    tokens: Tensor  # [B, m] left-aligned, -1 padded
    num_tokens: Tensor  # [B]
    positions: Tensor  # [B, m] absolute positions of tokens
    next_tokens: Tensor  # [B]
    active: Tensor  # [B] bool: rows still generating
    hidden: dict[int, Tensor] = field(default_factory=dict)  # layer id -> [B, m, D]
    final_hidden: Tensor | None = None  # [B, m, D]
    verification: Verification | None = None  # None at the prefill
    target_cache: KVStore | None = None  # read-only; only for drafters that declare target_cache

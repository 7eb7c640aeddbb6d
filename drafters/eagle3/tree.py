"""Draft tree shapes for EAGLE-3: static trees given as paths, and EAGLE-2's dynamic rerank.

**Static trees** are written as vLLM's ``speculative_token_tree`` (and Medusa's "choices"): a list
of paths, each a tuple of child ranks from the root, ``[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]``.
Node ``(0, 1)`` is the second child of node ``(0,)``. Every prefix of a path must be present and
a node's children ranks must be ``0..c-1`` (rank ``r`` is the ``r``-th draw, or the ``r``-th most
likely token). Nodes are ordered by depth then path, so parents come before children, siblings are
consecutive in draw order, and the nodes of depth ``<= k`` form a prefix (a tree cut at ``k``).

**Dynamic trees** (EAGLE-2, arXiv 2406.16858): expand the ``top_k`` best nodes of each depth with
their ``top_k`` most likely children, score every candidate by its cumulative draft log-probability,
and keep the ``budget`` best candidates overall. A child never scores above its parent, and ties go
to the shallower node, so the kept set is closed under ancestors.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["StaticTree", "parse_tree", "chain_tree", "rerank", "MAX_TREE_DEPTH", "DEFAULT_STATIC_TREE"]

# The deepest draft in every mode (chain, static, dynamic). Each depth is one sequential draft forward
# per step, and EAGLE-3 heads are trained over a few unrolled test-time-training steps (3 in
# speculators, 7 in SafeAILab's recipe): acceptance falls geometrically past that, so beyond 16 a
# deeper draft only adds cost.
MAX_TREE_DEPTH = 16
# 8 nodes: three guesses for the next token, two for the one after the best guess, one chain to depth 4
DEFAULT_STATIC_TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]"


@dataclass(frozen=True)
class StaticTree:
    paths: tuple[tuple[int, ...], ...]  # sorted by (depth, path)
    parents: tuple[int, ...]  # node index of each node's parent, -1 for the root's children
    ranks: tuple[int, ...]  # each node's rank among its siblings

    @property
    def depth(self) -> int:
        return len(self.paths[-1])

    def cut(self, k: int) -> StaticTree:
        """The tree restricted to depth <= k (a prefix of the node order)."""
        n = sum(1 for p in self.paths if len(p) <= k)
        return StaticTree(self.paths[:n], self.parents[:n], self.ranks[:n])

    def nodes_at(self, depth: int) -> list[int]:
        return [i for i, p in enumerate(self.paths) if len(p) == depth]

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def to_vllm(self) -> str:
        """The ``speculative_token_tree`` string vLLM reads."""
        return str(list(self.paths))


def chain_tree(k: int) -> StaticTree:
    return parse_tree([(0,) * d for d in range(1, k + 1)])


def parse_tree(spec: str | list | tuple) -> StaticTree:
    """A :class:`StaticTree` from a list of paths or its string form; ``ValueError`` on a bad tree."""
    if isinstance(spec, str):
        try:
            spec = ast.literal_eval(spec)
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"static tree {spec!r} is not a list of tuples") from e
    if not isinstance(spec, (list, tuple)) or not spec:
        raise ValueError("a static tree needs at least one path")
    paths = []
    for p in spec:
        if isinstance(p, int):
            p = (p,)
        if not isinstance(p, (list, tuple)) or not p or not all(isinstance(r, int) and r >= 0 for r in p):
            raise ValueError(f"tree path {p!r} must be a non-empty tuple of non-negative child ranks")
        paths.append(tuple(p))
    if len(set(paths)) != len(paths):
        raise ValueError("static tree has duplicate paths")
    if max(len(p) for p in paths) > MAX_TREE_DEPTH:
        raise ValueError(f"static tree is deeper than {MAX_TREE_DEPTH}")
    paths.sort(key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(paths)}
    parents = []
    for p in paths:
        if len(p) > 1 and p[:-1] not in index:
            raise ValueError(f"tree path {p} has no parent {p[:-1]}")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in index:
            raise ValueError(f"tree path {p}: sibling ranks must be 0..c-1 (rank {p[-1] - 1} is missing)")
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
    return StaticTree(tuple(paths), tuple(parents), tuple(p[-1] for p in paths))


def rerank(scores: Tensor, depths: Tensor, parents: Tensor, budget: int) -> tuple[Tensor, Tensor]:
    """Keep the ``budget`` best candidates per row, ordered parents-first.

    scores [B, C] cumulative log-probabilities, depths [B, C], parents [B, C] (candidate index, -1
    for the root). Returns the kept candidate indices [B, n] (by depth, then candidate index) and
    their parents as indices into the kept list [B, n].
    """
    B, C = scores.shape
    n = min(budget, C)
    # best score first; ties to the shallower, then earlier candidate (a stable two-key sort)
    by_depth = torch.sort(depths * C + torch.arange(C, device=scores.device), dim=1).indices
    by_score = torch.sort(-scores.gather(1, by_depth), dim=1, stable=True).indices
    kept = by_depth.gather(1, by_score)[:, :n]
    kept = kept.gather(1, torch.sort(depths.gather(1, kept) * C + kept, dim=1).indices)
    slot = torch.full((B, C + 1), -1, dtype=torch.long, device=scores.device)  # candidate → kept index
    slot.scatter_(1, kept + 1, torch.arange(n, device=scores.device).expand(B, n).contiguous())
    new_parents = slot.gather(1, parents.gather(1, kept) + 1)
    if bool(((new_parents < 0) & (parents.gather(1, kept) >= 0)).any()):
        raise AssertionError("reranked tree lost an ancestor")  # impossible for log-probabilities
    return kept, new_parents

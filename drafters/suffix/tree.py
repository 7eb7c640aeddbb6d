"""The suffix structure of SuffixDecoding (Oliaro et al., arXiv 2411.04975), as Arctic Inference
ships it: a depth-limited suffix trie over several token sequences whose nodes count occurrences.

The node of string ``s`` (``|s| <= max_depth``) holds ``count(s)``, the number of positions where
``s`` occurs in the stored sequences; the root counts every position. ``count(s + [t]) / count(s)``
is the empirical probability that ``t`` follows ``s``, and a draft is grown from the node of the
context's suffix by these probabilities.

Memory: a string that occurs once is never materialised below its first node. That node is a
*leaf* pointing at its one occurrence ``(sequence, start)``, and the chain under it is read off
the sequence; it is split only when a second occurrence arrives. So a node exists only for
strings seen twice (plus one leaf per occurrence that branches off), not for every substring.
Appending a token is ``O(max_depth)``: each of the last ``max_depth`` suffixes of its sequence
grows by one token (Arctic's "active nodes"). Removing a sequence walks its suffixes once.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

__all__ = ["SuffixTree", "Draft", "OutputCache"]


class _Node:
    """A trie node. Internal: ``children`` maps the next token to its node. Leaf (``children is
    None``): its string occurs once, at ``seqs[seq][start : start + depth]``, and continues there."""

    __slots__ = ("count", "depth", "children", "seq", "start")

    def __init__(self, count: int, depth: int, seq: int = -1, start: int = -1, leaf: bool = True):
        self.count, self.depth, self.seq, self.start = count, depth, seq, start
        self.children: dict[int, _Node] | None = None if leaf else {}


_Cursor = tuple[_Node, int]  # a point in the trie: a node and the string length (> node.depth only inside a leaf)


@dataclass
class Draft:
    """A speculation tree: ``parents[i]`` is the index of token ``i``'s parent, -1 for the root's
    children; parents come before children. ``probs`` are the estimated path probabilities and
    ``score`` their sum (the expected number of accepted tokens if the estimates were exact)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class SuffixTree:
    """Occurrence counts of every substring of length <= ``max_depth`` of the stored sequences,
    updated token by token (:meth:`append`) and per sequence (:meth:`remove`)."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.seqs: dict[int, list[int]] = {}
        self._root = _Node(0, 0, leaf=False)
        # Per sequence: [start, node] of its suffixes that can still grow (shorter than max_depth);
        # the node is the deepest one known on the suffix's path (refined lazily in append).
        self._active: dict[int, deque[list]] = {}

    @property
    def num_tokens(self) -> int:
        return self._root.count

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        for t in tokens:
            self.append(seq_id, t)

    def append(self, seq_id: int, token: int) -> None:
        """Append ``token`` to sequence ``seq_id`` (created if new): every suffix of the sequence
        that ends at its end and is shorter than ``max_depth`` gets one token longer."""
        seq = self.seqs.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, deque())
        p = len(seq)  # index of the new token
        active.append([p, self._root])
        self._root.count += 1
        # Shortest suffix first: a split below may then only meet leaves whose chains stop before
        # the new token (longer suffixes of this sequence have not counted it yet).
        for entry in reversed(active):
            start, node = entry
            length = p - start  # the suffix seq[start:p] is counted; now count seq[start:p+1]
            while node.children is not None and node.depth < length:
                node = node.children[seq[start + node.depth]]
            if node.children is None:  # inside its own leaf: the chain grows with the sequence
                entry[1] = node
                continue
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(1, length + 1, seq_id, start)
            elif child.children is None:  # a second occurrence: the leaf becomes a node
                self._split(child)
            else:
                child.count += 1
            entry[1] = child
        # The token is stored only now: until here, leaves of this sequence must not see it.
        seq.append(token)
        while active and p + 1 - active[0][0] >= self.max_depth:
            active.popleft()

    def _split(self, leaf: _Node) -> None:
        """Materialise a leaf met by a second occurrence: its own occurrence continues as a child."""
        seq, start, d = self.seqs[leaf.seq], leaf.start, leaf.depth
        leaf.count, leaf.children = 2, {}
        if d < self.max_depth and start + d < len(seq):
            leaf.children[seq[start + d]] = _Node(1, d + 1, leaf.seq, start)
        leaf.seq = leaf.start = -1

    def remove(self, seq_id: int) -> None:
        """Forget a sequence: every one of its suffixes is uncounted; nodes left at 0 go."""
        seq = self.seqs.pop(seq_id)
        self._active.pop(seq_id)
        for start in range(len(seq)):
            node = self._root
            node.count -= 1
            for d in range(start, min(len(seq), start + self.max_depth)):
                assert node.children is not None  # a leaf has count 1: it went with its parent's entry
                child = node.children[seq[d]]
                child.count -= 1
                if child.count == 0:  # its subtree counted only this occurrence too
                    del node.children[seq[d]]
                    break
                node = child

    # --- queries ---------------------------------------------------------------------------
    def _limit(self, node: _Node) -> int:
        """The deepest string a leaf stands for."""
        return min(self.max_depth, len(self.seqs[node.seq]) - node.start)

    def _children(self, cur: _Cursor, least: float = 0.0) -> list[tuple[int, int, _Cursor]]:
        """(token, count, cursor) of the continuations counted at least ``least`` times, most
        frequent first (ties: lower token first)."""
        node, d = cur
        if node.children is None:
            return [(self.seqs[node.seq][node.start + d], 1, (node, d + 1))] if d < self._limit(node) else []
        kids = [(t, c.count, (c, d + 1)) for t, c in node.children.items() if c.count >= least]
        kids.sort(key=lambda x: (-x[1], x[0]))
        return kids

    def _match(self, pattern: list[int]) -> _Cursor | None:
        node, d = self._root, 0
        while d < len(pattern):
            if node.children is None:  # one occurrence left: compare the rest with it at once
                end = len(pattern)
                occurrence = self.seqs[node.seq][node.start + d:node.start + end]
                return (node, end) if end <= self._limit(node) and occurrence == pattern[d:] else None
            child = node.children.get(pattern[d])
            if child is None:
                return None
            node, d = child, d + 1
        return node, d

    def count(self, pattern: list[int]) -> int:
        """Occurrences of ``pattern`` (0 if longer than ``max_depth``)."""
        cur = self._match(pattern) if len(pattern) <= self.max_depth else None
        return 0 if cur is None else cur[0].count

    def continuations(self, pattern: list[int]) -> dict[int, int]:
        """Next token → count(pattern + [token]), for strings within ``max_depth``."""
        cur = self._match(pattern) if len(pattern) <= self.max_depth else None
        return {} if cur is None else {t: c for t, c, _ in self._children(cur)}

    def speculate(self, context: list[int], max_tokens: int, max_spec_factor: float, max_spec_offset: float,
                  min_token_prob: float, max_draft_depth: int, tree: bool = True) -> Draft:
        """The best-scoring draft over every suffix of ``context`` that occurs (Arctic's rule).

        For a match of length ``m`` (at most ``max_depth - 1``: the tree must leave room to
        speculate) the draft gets ``min(max_tokens, floor(max_spec_factor * m + max_spec_offset))``
        tokens: longer matches earn longer drafts. Ties prefer the longer match. Matches are tried
        longest first and the search stops once no shorter one's budget could beat the best score
        (a score never exceeds its token count); the result is that of trying every length.
        """
        lo, hi = 0, min(len(context), self.max_depth - 1)
        while lo < hi:  # the longest suffix that occurs (a suffix of an occurring one occurs too)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._match(context[len(context) - mid:]) is not None else (lo, mid - 1)
        best = Draft()
        for m in range(lo, 0, -1):
            budget = min(max_tokens, int(m * max_spec_factor + max_spec_offset + 1e-6))
            if m < lo and budget <= best.score:
                break
            cur = self._match(context[len(context) - m:])
            assert cur is not None
            draft = self._grow(cur, budget, min_token_prob, max_draft_depth, tree)
            if m == lo or draft.score > best.score:
                best = draft
                best.match_len = m
        return best

    def _grow(self, cur: _Cursor, budget: int, min_token_prob: float, max_draft_depth: int, tree: bool) -> Draft:
        """Greedy best-first growth: the most probable frontier node is added next, where a node's
        probability is the product of count(child) / count(parent) down its path; nodes below
        ``min_token_prob`` are never added. ``tree=False`` follows the best child only (a chain)."""
        draft = Draft()
        # (-prob, tie order: first pushed first, parent index, depth, token, cursor)
        heap: list[tuple[float, int, int, int, int, _Cursor]] = []
        order = 0

        def push(parent_cur: _Cursor, prob: float, parent: int, depth: int) -> None:
            nonlocal order
            if depth > max_draft_depth:
                return
            total = parent_cur[0].count
            least = min_token_prob * total / prob * (1 - 1e-9)  # rarer children fall below min_token_prob
            for token, count, child_cur in self._children(parent_cur, least):
                p = prob * count / total
                if p < min_token_prob:
                    break  # the rest are rarer still
                heapq.heappush(heap, (-p, order, parent, depth, token, child_cur))
                order += 1
                if not tree:
                    break

        if budget <= 0:
            return draft
        push(cur, 1.0, -1, 1)
        while heap and len(draft.tokens) < budget:
            neg_p, _, parent, depth, token, child_cur = heapq.heappop(heap)
            draft.tokens.append(token)
            draft.parents.append(parent)
            draft.probs.append(-neg_p)
            draft.score += -neg_p
            push(child_cur, -neg_p, len(draft.tokens) - 1, depth + 1)
        return draft


class OutputCache:
    """Earlier outputs in one suffix tree, bounded by sequences and tokens, evicted oldest first
    (the global tree of SuffixDecoding; vLLM bounds it by ``suffix_decoding_max_cached_requests``)."""

    def __init__(self, max_depth: int):
        self.tree = SuffixTree(max_depth)
        self.ages: dict[int, None] = {}  # live sequence ids, oldest first (dicts keep insertion order)
        self._next_id = 0

    def add(self, max_sequences: int, max_tokens: int) -> int:
        """A new, empty output sequence; the oldest ones are evicted past ``max_sequences``."""
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self.ages[seq_id] = None
        self._evict(max_sequences, max_tokens)
        return seq_id

    def extend(self, seq_id: int, tokens: list[int], max_sequences: int, max_tokens: int) -> None:
        """Append to an output unless it was evicted; evict the oldest past ``max_tokens``."""
        if seq_id in self.ages:
            self.tree.extend(seq_id, tokens)
            self._evict(max_sequences, max_tokens)

    def _evict(self, max_sequences: int, max_tokens: int) -> None:
        while self.ages and (len(self.ages) > max_sequences or self.tree.num_tokens > max_tokens):
            oldest = next(iter(self.ages))
            del self.ages[oldest]
            if oldest in self.tree.seqs:
                self.tree.remove(oldest)

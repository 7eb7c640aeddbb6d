"""A stock Hugging Face ``DynamicCache`` made ragged: rows that accept different lengths.

Every forward appends the same number of slots ``m`` to every row. After verification each row
keeps only its accepted slots; the rest become holes, masked out of attention from then on.
Each row carries its own positions (count of valid slots before it), so holes cost memory and
compute but never change a logit. :meth:`RaggedCache.compact` gathers every row's valid slots to
the front when holes pile up (always worth it after trees, which leave siblings behind).

Masks are additive 4D ``[B, 1, m, S + m]`` float masks, which transformers passes through as-is;
for models with sliding-window layers a dict ``{layer_type: mask}`` is built, one per type.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

from specdec.kernels.compaction import gather_slots

__all__ = ["RaggedCache", "BlockPlan", "ancestor_matrix"]


def ancestor_matrix(parents: Tensor) -> Tensor:
    """anc[b, i, j] is True when block token j is token i or one of its ancestors.

    parents [B, m] hold block-local parent indices (-1 = attached to the committed prefix).
    """
    B, m = parents.shape
    anc = torch.eye(m, dtype=torch.bool, device=parents.device).expand(B, m, m).clone()
    for i in range(m):
        p = parents[:, i]
        has = p >= 0
        if has.any():
            rows = anc[torch.arange(B, device=parents.device), p.clamp(min=0)]  # [B, m]
            anc[:, i] |= rows & has.unsqueeze(1)
    return anc


@dataclass
class BlockPlan:
    """The mask and positions for one forward of ``m`` new tokens."""

    attention_mask: Tensor | dict[str, Tensor]
    position_ids: Tensor  # [B, m]


class RaggedCache:
    """Per-row validity and positions over a ``DynamicCache``.

    ``valid [B, S]`` marks the slots that hold committed tokens; ``slot_pos [B, S]`` their
    positions; ``lengths [B]`` the number of committed tokens (the next position).
    """

    def __init__(self, batch: int, device: torch.device | str, dtype: torch.dtype,
                 layer_types: list[str] | None = None, sliding_window: int | None = None):
        self.kv = DynamicCache()
        self.device = torch.device(device)
        self.dtype = dtype
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.slot_pos = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.layer_types = layer_types
        self.sliding_window = sliding_window
        self._pending: Tensor | None = None  # positions of the block awaiting commit [B, m]

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    def plan(self, parents: Tensor) -> BlockPlan:
        """Mask and positions for a block whose tokens have block-local ``parents`` [B, m]."""
        if self._pending is not None:
            raise RuntimeError("commit() the previous block before planning the next one")
        B, m = parents.shape
        anc = ancestor_matrix(parents)
        depth = anc.sum(-1) - 1  # [B, m]: 0 for tokens attached to the prefix
        positions = self.lengths.unsqueeze(1) + depth
        allowed = torch.cat([self.valid.unsqueeze(1).expand(B, m, self.num_slots), anc], dim=-1)
        key_pos = torch.cat([self.slot_pos, positions], dim=-1)  # [B, S + m]
        self._pending = positions
        mask = self._additive(allowed)
        if self.layer_types and self.sliding_window and "sliding_attention" in self.layer_types:
            in_window = positions.unsqueeze(-1) - key_pos.unsqueeze(1) < self.sliding_window
            masks = {"full_attention": mask, "sliding_attention": self._additive(allowed & in_window)}
            return BlockPlan({t: masks[t] for t in set(self.layer_types)}, positions)
        return BlockPlan(mask, positions)

    def _additive(self, allowed: Tensor) -> Tensor:
        neg = torch.finfo(self.dtype).min
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(allowed, zero, neg).unsqueeze(1)  # [B, 1, m, S + m]

    def commit(self, keep: Tensor) -> None:
        """Keep the block slots marked in ``keep`` [B, m]; they must form a root-to-node path."""
        if self._pending is None:
            raise RuntimeError("nothing to commit: plan() a block first")
        self.valid = torch.cat([self.valid, keep], dim=1)
        self.slot_pos = torch.cat([self.slot_pos, self._pending], dim=1)
        self.lengths = self.lengths + keep.sum(1)
        self._pending = None

    def rollback(self, counts: Tensor) -> None:
        """Drop the last ``counts[b]`` committed tokens of each row. counts [B]"""
        rank_from_end = self.valid.flip(-1).long().cumsum(-1).flip(-1)  # 1 = last valid slot
        drop = self.valid & (rank_from_end <= counts.unsqueeze(1))
        self.valid = self.valid & ~drop
        self.lengths = self.lengths - drop.sum(1)

    @property
    def hole_fraction(self) -> float:
        return 1.0 - float(self.valid.sum()) / max(1, self.valid.numel())

    def compact(self) -> None:
        """Gather every row's valid slots to the front and drop the columns no row needs."""
        keep_cols = int(self.lengths.max()) if self.batch else 0
        order = torch.sort((~self.valid).long(), dim=1, stable=True).indices[:, :keep_cols]  # [B, S']
        for layer in self.kv.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            layer.keys = gather_slots(layer.keys, order)
            layer.values = gather_slots(layer.values, order)
        self.valid = self.valid.gather(1, order)
        self.slot_pos = self.slot_pos.gather(1, order)

    def select_rows(self, rows: Tensor) -> None:
        """Keep only the given batch rows (retire finished requests)."""
        for layer in self.kv.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            layer.keys = layer.keys[rows]
            layer.values = layer.values[rows]
        self.valid, self.slot_pos, self.lengths = self.valid[rows], self.slot_pos[rows], self.lengths[rows]

"""The one ragged KV store: the target's cache and every drafter's that keeps one.

Every forward appends the same number of slots ``m`` to every row. After verification each row
keeps only its accepted slots; the rest become holes, masked out of attention from then on.
Each row carries its own positions (count of valid slots before it), so holes cost memory and
compute but never change a logit. A store fed committed tokens only (a drafter's context) simply
commits every real slot and never rolls back.

**Memory.** Every layer's keys and values live in buffers ``[B, H, capacity, D]`` (K and V may
differ in ``H`` and ``D``, as MLA latents do) preallocated: a run that knows its longest row
:meth:`~KVStore.reserve`-s exactly that many slots before its prefill; past the reservation the
buffers grow in blocks of :attr:`KVStore.block` slots, and so do the per-slot ``valid`` /
``slot_pos``: a step writes into the buffers, and only crossing a block boundary reallocates.
Everything handed out is a view over the used slots; the slots past them are never read, so they
are left uninitialised. :attr:`KVStore.nbytes` is what the buffers hold: for the target's store,
``capacity × layers × (Hk·Dk + Hv·Dv) × dtype bytes`` per row, plus 9 bytes a slot for
``valid``/``slot_pos`` (SmolLM2-135M in float32: 45 KiB a slot, 330 MiB at a 7.5k-token row,
what transformers' own cache holds for the same tokens). Nothing is preallocated before the first
write of a layer, and a run reserves no more than its longest row can reach.

Every method that changes the store runs in inference mode: its buffers are inference tensors,
updated in place between steps as well as inside the forwards that fill them.

**Compaction.** :meth:`KVStore.maybe_compact` is the one policy: once compaction would free more
than :attr:`KVStore.compact_at` of the slots, every row's valid slots are gathered to the front
(always worth it after trees, which leave siblings behind). It frees the slots past the longest
row only, so holes that ragged prompt lengths leave in the shorter rows do not count: a batch of
prompts of different lengths would otherwise copy its whole cache every few steps for nothing.

Masks are additive 4D ``[B, 1, m, S + m]`` float masks, built once per block on the device and
shared by every layer; for models with sliding-window layers a dict ``{layer_type: mask}`` is
built, one per type. A chain (``parents=None``) needs no ancestor matrix. When the store is
**dense** (no holes, known on the host: every commit kept its whole block since the store was
empty) a chain needs no mask at all: slots are positions, so the model's own causal mask over
slots is exact (``plan(None, implicit_causal=True)`` returns ``attention_mask=None``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.kernels.compaction import gather_slots

__all__ = ["KVStore", "BlockPlan", "ancestor_matrix"]


def ancestor_matrix(parents: Tensor) -> Tensor:
    """anc[b, i, j] is True when block token j is token i or one of its ancestors.

    parents [B, m] hold block-local parent indices (-1 = attached to the committed prefix).
    Pointer doubling on the device: after round t every row holds its ancestors up to distance
    2^t, so ceil(log2(m - 1)) rounds of one gather each suffice; no value is read on the host.
    """
    B, m = parents.shape
    idx = torch.arange(m, device=parents.device)
    up = parents  # [B, m]: the ancestor at distance 2^t, -1 = none
    anc = (idx.unsqueeze(1) == idx) | (up.unsqueeze(-1) == idx)  # [B, m, m]: distance <= 1
    for _ in range(max(m - 2, 0).bit_length()):
        has = (up >= 0).unsqueeze(-1)  # [B, m, 1]
        hop = up.clamp(min=0)
        anc = anc | (anc.gather(1, hop.unsqueeze(-1).expand(B, m, m)) & has)
        up = torch.where(has.squeeze(-1), up.gather(1, hop), -1)
    return anc


@dataclass
class BlockPlan:
    """The mask and positions for one forward of ``m`` new tokens."""

    attention_mask: Tensor | dict[str, Tensor] | None  # None: the model's own causal mask is exact
    position_ids: Tensor  # [B, m]
    slots: Tensor | None = None  # [m] the block's slots, for a static plan (masks over the whole capacity)


class KVStore:
    """Ragged per-row K/V of ``num_layers`` layers.

    ``valid [B, S]`` marks the slots that hold committed tokens; ``slot_pos [B, S]`` their
    positions; ``lengths [B]`` the number of committed tokens (the next position). A block is
    :meth:`plan`-ned, each layer :meth:`write`-s its K/V, then :meth:`commit` keeps some slots.
    """

    block = 256  # slots the buffers grow by
    # the compaction policy: compact once it would free this fraction of the slots. Compacting copies
    # the valid slots (read + write); every later step reads the freed ones once per layer, so a
    # fraction f pays back after about 2(1 - f)/f steps: 6 at 0.25
    compact_at = 0.25
    # retiring rows: up to this many rows that shift down move one copy each; more move as one gather
    ROW_COPIES = 8

    def __init__(self, batch: int, device: torch.device | str, dtype: torch.dtype, num_layers: int = 1,
                 layer_types: list[str] | None = None, sliding_window: int | None = None):
        self.device = torch.device(device)
        self.dtype = dtype  # of the additive masks
        self.num_layers = num_layers
        self.layer_types = layer_types
        self.sliding_window = sliding_window
        self.num_slots = 0  # S: slots in use (committed columns, holes included)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        self._valid = torch.zeros(batch, 0, dtype=torch.bool, device=self.device)  # [B, capacity]
        self._slot_pos = torch.zeros(batch, 0, dtype=torch.long, device=self.device)  # [B, capacity]
        self._keys: list[Tensor | None] = [None] * num_layers  # [B, H, capacity, Dk], allocated on first write
        self._values: list[Tensor | None] = [None] * num_layers  # [B, H, capacity, Dv]
        self._pending: Tensor | None = None  # positions of the block awaiting commit [B, m]
        self.block_writes = 0  # layers that wrote the planned block's K/V (a forward that wrote none never saw the store)
        self.dense = True  # no holes: every slot is valid and slot index == position (host-known)
        # where K/V buffers come from: None allocates (uninitialised); a function (key, shape, like) -> a
        # zeroed tensor gives buffers at addresses that outlive the store (a captured step's arena)
        self.alloc = None

    # --- views ------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self._valid.shape[1]

    @property
    def valid(self) -> Tensor:
        """[B, S] bool view: the slot holds a committed token."""
        return self._valid[:, : self.num_slots]

    @property
    def slot_pos(self) -> Tensor:
        """[B, S] view: each slot's position."""
        return self._slot_pos[:, : self.num_slots]

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """Layer ``i``'s keys and values over the used slots, views [B, H, S, D]."""
        k, v = self._keys[i], self._values[i]
        if k is None or v is None:
            raise ValueError(f"layer {i} holds no K/V (it never wrote any)")
        return k[:, :, : self.num_slots], v[:, :, : self.num_slots]

    @property
    def nbytes(self) -> int:
        """Bytes the store's buffers hold (at their capacity, used or not)."""
        bufs = [x for x in (*self._keys, *self._values) if x is not None] + [self._valid, self._slot_pos]
        return sum(x.nbytes for x in bufs)

    @property
    def hole_fraction(self) -> float:
        valid = self.valid
        return 1.0 - float(valid.sum()) / max(1, valid.numel())

    # --- one block: plan, write, commit -----------------------------------------------------
    @torch.inference_mode()
    def plan(self, parents: Tensor | None = None, length: int | None = None,
             implicit_causal: bool = False, static: bool = False) -> BlockPlan:
        """Mask and positions for a block whose tokens have block-local ``parents`` [B, m], or for
        a chain of ``length`` tokens (``parents=None``: no ancestor matrix to build).

        ``implicit_causal``: the caller's model builds its own causal mask over slots (transformers
        does when given no mask), so a chain over a :attr:`dense` store gets ``attention_mask=None``.
        ``static``: for a captured step (:meth:`write_static`): the masks span the buffers' whole
        capacity (every slot past the used ones and the block masked out) and the plan carries the
        block's slot indices, so the step's shapes depend on the batch, the block and the capacity
        only, never on how many slots are used.
        """
        if self._pending is not None:
            raise RuntimeError("commit() the previous block before planning the next one")
        if (parents is None) == (length is None):
            raise ValueError("give exactly one of parents (a tree) and length (a chain)")
        B, S, dev = self.batch, self.num_slots, self.device
        if parents is None:
            assert length is not None
            m = length
            depth = torch.arange(m, device=dev).expand(B, m)
            block = torch.ones(m, m, dtype=torch.bool, device=dev).tril().expand(B, m, m)
        else:
            m = parents.shape[1]
            block = ancestor_matrix(parents)  # [B, m, m]
            depth = block.sum(-1) - 1  # [B, m]: 0 for tokens attached to the prefix
        positions = self.lengths.unsqueeze(1) + depth
        self._reserve(S + m)
        self._pending = positions
        self.block_writes = 0
        if static:
            return self._static_plan(block, positions)
        if parents is None and implicit_causal and self.dense:
            return BlockPlan(None, positions)
        allowed = torch.cat([self.valid.unsqueeze(1).expand(B, m, S), block], dim=-1)  # [B, m, S + m]
        return BlockPlan(self._masks(allowed, lambda: torch.cat([self.slot_pos, positions], dim=-1), positions), positions)

    def _static_plan(self, block: Tensor, positions: Tensor) -> BlockPlan:
        """The block's plan over the whole capacity: slots ``[S, S + m)`` hold the block."""
        (B, m), S, C = positions.shape, self.num_slots, self.capacity
        allowed = torch.zeros(B, m, C, dtype=torch.bool, device=self.device)
        allowed[:, :, :S] = self.valid.unsqueeze(1)
        allowed[:, :, S: S + m] = block

        def key_pos() -> Tensor:
            pos = self._slot_pos.clone()
            pos[:, S: S + m] = positions
            return pos

        slots = torch.arange(S, S + m, device=self.device)
        return BlockPlan(self._masks(allowed, key_pos, positions), positions, slots)

    def _masks(self, allowed: Tensor, key_pos: Callable[[], Tensor], positions: Tensor) -> Tensor | dict[str, Tensor]:
        """The additive mask of ``allowed`` [B, m, keys], one per layer type where some layers slide
        (``key_pos()`` [B, keys]: each key's position, built only then)."""
        mask = self._additive(allowed)
        if self.layer_types and self.sliding_window and "sliding_attention" in self.layer_types:
            in_window = positions.unsqueeze(-1) - key_pos().unsqueeze(1) < self.sliding_window
            masks = {"full_attention": mask, "sliding_attention": self._additive(allowed & in_window)}
            return {t: masks[t] for t in set(self.layer_types)}
        return mask

    def _additive(self, allowed: Tensor) -> Tensor:
        neg = torch.finfo(self.dtype).min
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(allowed, zero, neg).unsqueeze(1)  # [B, 1, m, S + m]

    @torch.inference_mode()
    def write(self, i: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Store layer ``i``'s K/V of the planned block (keys, values [B, H, m, D]); returns the
        layer's keys and values over the used slots plus the block, views [B, H, S + m, D]."""
        if self._pending is None or keys.shape[2] != self._pending.shape[1]:
            raise RuntimeError("write() the K/V of exactly the planned block")
        S, end = self.num_slots, self.num_slots + keys.shape[2]
        if self._keys[i] is None:  # buffers are uninitialised: a layer must write every block from the first
            if S:
                raise RuntimeError(f"layer {i} wrote nothing for the first {S} slots")
            self._keys[i] = self._buffer(("k", i), keys)
            self._values[i] = self._buffer(("v", i), values)
        k, v = self._keys[i], self._values[i]
        assert k is not None and v is not None
        k[:, :, S:end] = keys
        v[:, :, S:end] = values
        self.block_writes += 1
        return k[:, :, :end], v[:, :, :end]

    def _buffer(self, key: tuple[str, int], like: Tensor) -> Tensor:
        """A K or V buffer [B, H, capacity, D] for a block like ``like`` (see :attr:`alloc`)."""
        shape = (*like.shape[:2], self.capacity, like.shape[3])
        return like.new_empty(*shape) if self.alloc is None else self.alloc(key, shape, like)

    def write_static(self, i: int, keys: Tensor, values: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Layer ``i``'s K/V of a block planned with ``static=True`` written at ``slots`` [m]; returns
        the layer's whole buffers [B, H, capacity, D]. Device work only (no check, no host read, no
        allocation): the form a captured step records. The layer must have written before (the
        prefill, which runs uncaptured, allocates the buffers)."""
        k, v = self._keys[i], self._values[i]
        assert k is not None and v is not None, "a static write needs the buffers a prefill allocated"
        k.index_copy_(2, slots, keys)
        v.index_copy_(2, slots, values)
        return k, v

    def buffers(self, i: int) -> tuple[Tensor, Tensor]:
        """Layer ``i``'s whole K/V buffers [B, H, capacity, D] (a captured step reads every slot,
        masking those past :attr:`num_slots`)."""
        k, v = self._keys[i], self._values[i]
        if k is None or v is None:
            raise ValueError(f"layer {i} holds no K/V (it never wrote any)")
        return k, v

    def has_buffers(self, i: int) -> bool:
        """Whether layer ``i`` has written (its buffers exist: a static write can follow)."""
        return self._keys[i] is not None

    def static_valid(self) -> Tensor:
        """[B, capacity] bool: the committed slots, False past :attr:`num_slots` (a static mask)."""
        out = torch.zeros_like(self._valid)
        out[:, : self.num_slots] = self.valid
        return out

    def static_slot_pos(self) -> Tensor:
        """[B, capacity] each slot's position (meaningless past :attr:`num_slots`, where
        :meth:`static_valid` is False)."""
        return self._slot_pos

    def buffer_key(self) -> tuple:
        """What a recording over this store depends on: the batch, the capacity and every K/V
        buffer's address (a reallocation, a new store or fewer rows all mean another recording)."""
        return (self.batch, self.capacity,
                tuple(0 if x is None else x.data_ptr() for x in (*self._keys, *self._values)))

    @torch.inference_mode()
    def commit(self, keep: Tensor | int | None = None) -> None:
        """Keep the block slots marked in ``keep`` [B, m]; they must form a root-to-node path.
        ``None`` keeps the whole block (a chain), which leaves a :attr:`dense` store dense. An int
        ``c`` keeps the block's first ``c`` slots in every row (a chain whose rows accepted alike,
        e.g. at batch 1): the rest of the block is dropped outright, not left as holes, so a dense
        store stays dense (its attention needs no mask, it never needs compacting)."""
        if self._pending is None:
            raise RuntimeError("nothing to commit: plan() a block first")
        m = self._pending.shape[1]
        if isinstance(keep, int) and not isinstance(keep, bool):
            if not 0 <= keep <= m:
                raise ValueError(f"commit() keeps 0..{m} leading slots of the block, got {keep}")
            m, self._pending, keep = keep, self._pending[:, :keep], None
        S, end = self.num_slots, self.num_slots + m
        self._valid[:, S:end] = True if keep is None else keep
        self._slot_pos[:, S:end] = self._pending
        self.num_slots = end
        self.lengths = self.lengths + (m if keep is None else keep.sum(1))
        self.dense = self.dense and keep is None
        self._pending = None

    def reserve(self, slots: int) -> None:
        """Room for ``slots`` slots in every buffer, exactly (no-op when they fit). A run that knows
        its longest row (prompt + new tokens + a block) reserves it before its prefill: the buffers
        are then allocated once, at that size, instead of growing a block at a time past it."""
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise ValueError(f"reserve() takes a number of slots >= 0, got {slots!r}")
        if slots > self.capacity:
            self._move(slots)

    def _reserve(self, slots: int) -> None:
        """Grow every buffer to hold ``slots`` slots, in whole blocks (no-op when they fit)."""
        if slots <= self.capacity:
            return
        self._move(-(-slots // self.block) * self.block)

    def _new_buffer(self, like: Tensor, shape: tuple[int, ...]) -> Tensor:
        """A reallocated buffer of ``like``'s kind: uninitialised, except K/V under an arena, which
        are zeroed normal tensors (a static step reads every slot, and a compiled one writes only
        normal tensors)."""
        if self.alloc is None or like.dtype in (torch.bool, torch.long):
            return like.new_empty(shape)
        with torch.inference_mode(False):
            return like.new_zeros(shape)

    def _move(self, capacity: int, rows: Tensor | None = None) -> None:
        """Reallocate every buffer with ``capacity`` slots, keeping the used slots (of ``rows`` only,
        when given); slots past them stay uninitialised: they are written before they are read."""
        def moved(x: Tensor, dim: int) -> Tensor:
            used = x.narrow(dim, 0, self.num_slots)
            used = used if rows is None else used[rows]
            out = self._new_buffer(x, (*used.shape[:dim], capacity, *used.shape[dim + 1:]))
            out.narrow(dim, 0, self.num_slots).copy_(used)
            return out

        self._valid, self._slot_pos = moved(self._valid, 1), moved(self._slot_pos, 1)
        for buffers in (self._keys, self._values):
            for i, x in enumerate(buffers):  # one buffer at a time: the old one is freed before the next moves
                if x is not None:
                    buffers[i] = moved(x, 2)
                    del x

    @torch.inference_mode()
    def append_rows(self, other: KVStore) -> None:
        """Add ``other``'s rows after this store's: requests admitted into a running batch
        (continuous batching) are prefilled into a store of their own, then joined here. Each part
        keeps its slots; the columns one part has and the other lacks become holes (zeroed, so a
        masked slot never meets uninitialised memory in attention) that compaction later frees.
        Both stores must hold the same layers; one reallocation."""
        if other.num_layers != self.num_layers or (other.layer_types or None) != (self.layer_types or None):
            raise ValueError("append_rows joins stores of the same layers")
        if self._pending is not None or other._pending is not None:
            raise RuntimeError("append_rows between steps only: a block is awaiting commit")
        if not other.batch:
            return
        S = max(self.num_slots, other.num_slots)
        capacity = max(self.capacity, other.capacity)
        B = self.batch

        def joined(a: Tensor | None, b: Tensor | None, dim: int) -> Tensor | None:
            if a is None and b is None:
                return None
            if a is None and B or b is None:
                raise ValueError("append_rows: a layer holds K/V in one store and none in the other")
            like = b if a is None else a
            out = self._new_buffer(like, (B + b.shape[0], *like.shape[1:dim], capacity, *like.shape[dim + 1:]))
            for part, rows, used in ((a, slice(0, B), self.num_slots), (b, slice(B, None), other.num_slots)):
                dst = out[rows]
                if part is not None and used:
                    dst.narrow(dim, 0, used).copy_(part.narrow(dim, 0, used))
                if S > used:
                    dst.narrow(dim, used, S - used).zero_()
            return out

        self._valid, self._slot_pos = joined(self._valid, other._valid, 1), joined(self._slot_pos, other._slot_pos, 1)
        for mine, theirs in ((self._keys, other._keys), (self._values, other._values)):
            for i in range(self.num_layers):
                mine[i] = joined(mine[i], theirs[i], 2)
        self.lengths = torch.cat([self.lengths, other.lengths.to(self.device)])
        self.dense = self.dense and other.dense and self.num_slots == other.num_slots
        self.num_slots = S

    # --- between steps ----------------------------------------------------------------------
    @torch.inference_mode()
    def rollback(self, counts: Tensor) -> None:
        """Drop the last ``counts[b]`` committed tokens of each row. counts [B]"""
        valid = self.valid
        rank_from_end = valid.flip(-1).long().cumsum(-1).flip(-1)  # 1 = last valid slot
        drop = valid & (rank_from_end <= counts.unsqueeze(1))
        valid &= ~drop
        self.lengths = self.lengths - drop.sum(1)
        self.dense = False

    def maybe_compact(self, lengths: list[int] | None = None) -> None:
        """The one compaction policy (see :attr:`compact_at`); the loop and drafters call it after a
        step. ``lengths``, the rows' committed counts as the caller knows them on the host, spare
        the device read the policy otherwise takes."""
        if not self.num_slots or not self.batch:
            return
        longest = max(lengths) if lengths is not None else int(self.lengths.max())
        if 1.0 - longest / self.num_slots > self.compact_at:
            self.compact(longest)
            self.dense = lengths is not None and min(lengths) == longest

    @torch.inference_mode()
    def compact(self, longest: int | None = None) -> None:
        """Gather every row's valid slots to the front; the slots no row needs become free.
        ``longest`` is the longest row's length when the caller knows it (no device read)."""
        keep_cols = longest if longest is not None else int(self.lengths.max()) if self.batch else 0
        order = torch.sort((~self.valid).long(), dim=1, stable=True).indices[:, :keep_cols]  # [B, S']
        for buffers in (self._keys, self._values):
            for x in buffers:
                if x is not None:
                    x[:, :, :keep_cols] = gather_slots(x[:, :, : self.num_slots], order)
        self._valid[:, :keep_cols] = self.valid.gather(1, order)
        self._slot_pos[:, :keep_cols] = self.slot_pos.gather(1, order)
        self.num_slots = keep_cols

    def refresh_dense(self) -> bool:
        """Mark the store :attr:`dense` again when every used slot is valid (each row holds
        :attr:`num_slots` tokens, e.g. after :meth:`compact` of rows of equal length): slot index
        is then position, so chains drop their mask again. One device read; returns :attr:`dense`."""
        if not self.dense and self.batch and int(self.lengths.min()) == self.num_slots:
            self.dense = True
        return self.dense

    @torch.inference_mode()
    def select_rows(self, rows: Tensor) -> None:
        """Keep only the given batch rows (retire finished requests). Rows in increasing order (the
        loop's) move down in place, only the ones that shift, over the used slots: no allocation,
        one copy. Any other selection reallocates. ``rows`` on the host spare a device read."""
        keep = rows.tolist()
        on_dev = rows.to(self.device)
        if any(a >= b for a, b in zip(keep, keep[1:])):
            self._move(self.capacity, on_dev)
        else:
            shifts, S, n = [(i, r) for i, r in enumerate(keep) if i != r], self.num_slots, len(keep)

            def shift_down(x: Tensor, dim: int) -> None:
                """The kept rows of ``x``'s used slots (along ``dim``) moved down in place: one copy
                per row for a few, one gather for many (a large batch retiring)."""
                used = x.narrow(dim, 0, S)
                if len(shifts) <= self.ROW_COPIES:
                    for i, r in shifts:
                        used[i].copy_(used[r])
                else:  # the rows from the first that moves on, gathered (a copy) and written back
                    used[shifts[0][0]: n] = used[on_dev[shifts[0][0]:]]

            for buffers in (self._keys, self._values):
                for j, x in enumerate(buffers):
                    if x is not None:
                        shift_down(x, 2)
                        buffers[j] = x[:n]  # a view: the rows past it are freed at the next reallocation
            shift_down(self._valid, 1)
            shift_down(self._slot_pos, 1)
            self._valid, self._slot_pos = self._valid[:n], self._slot_pos[:n]
        self.lengths = self.lengths[on_dev]

"""The ragged KV store: buffers grow by whole blocks and are written in place, everything handed
out is a view, and plan / rollback / compact / select_rows behave exactly as the concatenating
cache they replace (kept here as the specification). One compaction policy, set in one place."""

from __future__ import annotations

import pytest
import torch

from specdec.kv import KVStore, ancestor_matrix
from specdec.target import Target
from specdec.testing.tiny import tiny_model
from specdec.types import chain_parents

B, H, D = 3, 2, 4


class ConcatReference:
    """The replaced cache's semantics: every buffer grown by ``torch.cat`` each step."""

    def __init__(self, batch: int):
        self.keys = torch.zeros(batch, H, 0, D)
        self.valid = torch.zeros(batch, 0, dtype=torch.bool)
        self.slot_pos = torch.zeros(batch, 0, dtype=torch.long)
        self.lengths = torch.zeros(batch, dtype=torch.long)

    def step(self, keys, parents, keep):
        depth = ancestor_matrix(parents).sum(-1) - 1
        self.keys = torch.cat([self.keys, keys], 2)
        self.valid = torch.cat([self.valid, keep], 1)
        self.slot_pos = torch.cat([self.slot_pos, self.lengths.unsqueeze(1) + depth], 1)
        self.lengths = self.lengths + keep.sum(1)

    def rollback(self, counts):
        rank_from_end = self.valid.flip(-1).long().cumsum(-1).flip(-1)
        drop = self.valid & (rank_from_end <= counts.unsqueeze(1))
        self.valid, self.lengths = self.valid & ~drop, self.lengths - drop.sum(1)

    def compact(self):
        order = torch.sort((~self.valid).long(), dim=1, stable=True).indices[:, : int(self.lengths.max())]
        self.keys = self.keys.gather(2, order[:, None, :, None].expand(-1, H, -1, D))
        self.valid, self.slot_pos = self.valid.gather(1, order), self.slot_pos.gather(1, order)

    def select_rows(self, rows):
        self.keys, self.valid = self.keys[rows], self.valid[rows]
        self.slot_pos, self.lengths = self.slot_pos[rows], self.lengths[rows]

    def append_rows(self, other):
        """Both parts padded with holes to the longer one's slots, then stacked."""
        S = max(self.valid.shape[1], other.valid.shape[1])

        def pad(x, dim):
            return torch.nn.functional.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, S - x.shape[dim]])

        self.keys = torch.cat([pad(self.keys, 2), pad(other.keys, 2)])
        self.valid = torch.cat([pad(self.valid, 1), pad(other.valid, 1)])
        self.slot_pos = torch.cat([pad(self.slot_pos, 1), pad(other.slot_pos, 1)])
        self.lengths = torch.cat([self.lengths, other.lengths])


def step(store: KVStore, ref: ConcatReference | None, parents, keep, gen):
    """One block through the store (and the reference): plan, write both layers, commit."""
    plan = store.plan(parents)
    keys = torch.randn(store.batch, H, parents.shape[1], D, generator=gen)
    out_k, out_v = store.write(0, keys, -keys)
    store.write(1, keys[..., :2], keys[..., :3])  # K and V of a layer may differ in width (MLA)
    assert torch.equal(out_k[:, :, -parents.shape[1]:], keys) and out_k.shape[2] == store.num_slots + parents.shape[1]
    store.commit(keep)
    if ref is not None:
        ref.step(keys, parents, keep)
    return plan


def assert_same(store: KVStore, ref: ConcatReference):
    assert torch.equal(store.valid, ref.valid)
    assert torch.equal(store.slot_pos, ref.slot_pos)
    assert torch.equal(store.lengths, ref.lengths)
    assert torch.equal(store.layer(0)[0], ref.keys) and torch.equal(store.layer(0)[1], -ref.keys)
    assert torch.equal(store.layer(1)[0], ref.keys[..., :2])


def test_buffers_grow_by_whole_blocks_and_are_written_in_place():
    store, gen = KVStore(B, "cpu", torch.float32, num_layers=2), torch.Generator().manual_seed(0)
    step(store, None, chain_parents(5, B), torch.ones(B, 5, dtype=torch.bool), gen)
    assert store.capacity == KVStore.block
    ptrs = (store.layer(0)[0].data_ptr(), store.layer(1)[1].data_ptr(), store.valid.data_ptr())
    while store.num_slots + 7 <= KVStore.block:  # every step inside the first block: no reallocation
        step(store, None, chain_parents(7, B), torch.ones(B, 7, dtype=torch.bool), gen)
        assert (store.layer(0)[0].data_ptr(), store.layer(1)[1].data_ptr(), store.valid.data_ptr()) == ptrs
    before = store.layer(0)[0].clone()
    step(store, None, chain_parents(7, B), torch.ones(B, 7, dtype=torch.bool), gen)  # crosses the boundary
    assert store.capacity == 2 * KVStore.block and store.layer(0)[0].data_ptr() != ptrs[0]
    assert torch.equal(store.layer(0)[0][:, :, : before.shape[2]], before)  # the used slots moved along


def test_reads_are_views_over_the_used_slots():
    store, gen = KVStore(B, "cpu", torch.float32, num_layers=2), torch.Generator().manual_seed(1)
    step(store, None, chain_parents(4, B), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]).bool(), gen)
    keys, values = store.layer(0)
    assert keys.shape == (B, H, 4, D) and values.shape == (B, H, 4, D)
    # windows of the preallocated buffers, not copies: their strides span the whole capacity
    assert keys.stride(1) == values.stride(1) == store.capacity * D and store.valid.stride(0) == store.capacity
    assert store.valid.shape == store.slot_pos.shape == (B, 4) and store.lengths.tolist() == [4, 2, 1]
    with pytest.raises(ValueError, match="layer 1"):
        KVStore(B, "cpu", torch.float32, num_layers=2).layer(1)


def test_a_layer_writes_every_block_from_the_first():
    """Buffers are uninitialised past what was written: a layer that skipped blocks would expose
    garbage slots, so it is refused."""
    store, gen = KVStore(B, "cpu", torch.float32, num_layers=3), torch.Generator().manual_seed(5)
    step(store, None, chain_parents(2, B), torch.ones(B, 2, dtype=torch.bool), gen)  # layers 0 and 1 only
    store.plan(chain_parents(1, B))
    with pytest.raises(RuntimeError, match="layer 2 wrote nothing for the first 2 slots"):
        store.write(2, torch.zeros(B, H, 1, D), torch.zeros(B, H, 1, D))
    with pytest.raises(RuntimeError, match="exactly the planned block"):
        store.write(0, torch.zeros(B, H, 2, D), torch.zeros(B, H, 2, D))


@pytest.mark.parametrize("row_copies", [8, 0])  # rows moved down one copy each, or by one gather
@pytest.mark.parametrize("kept", [[2, 0], [0, 2], [1, 2]])  # reallocated; moved down in place
def test_plan_rollback_compact_and_select_rows_equal_the_concatenating_cache(kept, row_copies, monkeypatch):
    monkeypatch.setattr(KVStore, "ROW_COPIES", row_copies)
    store, ref = KVStore(B, "cpu", torch.float32, num_layers=2), ConcatReference(B)
    gen = torch.Generator().manual_seed(2)
    tree = torch.tensor([[-1, 0, 0, 1, 2]]).expand(B, -1)
    for i in range(12):
        parents = tree if i % 3 == 0 else chain_parents(3 + i % 2, B)
        keep = torch.rand(B, parents.shape[1], generator=gen) < 0.6
        keep[:, 0] = True
        if parents is tree:  # keep a root-to-node path
            keep[:, 2], keep[:, 4] = False, False
            keep[:, 3] &= keep[:, 1]
        else:
            keep = keep.long().cumprod(1).bool()
        plan = step(store, ref, parents, keep, gen)
        assert plan.position_ids.tolist() == ref.slot_pos[:, -parents.shape[1]:].tolist()
        assert_same(store, ref)
        if i % 4 == 1:
            counts = torch.tensor([1, 0, 2])
            store.rollback(counts), ref.rollback(counts)
            assert_same(store, ref)
        if i % 4 == 2:
            store.compact(), ref.compact()
            assert_same(store, ref)
    rows = torch.tensor(kept)
    store.select_rows(rows), ref.select_rows(rows)
    assert_same(store, ref)
    for _ in range(3):  # the rows left keep growing, past the buffers' block
        step(store, ref, chain_parents(2, 2), torch.ones(2, 2, dtype=torch.bool), gen)
        assert_same(store, ref)
    last = torch.tensor([1])
    store.select_rows(last), ref.select_rows(last)
    step(store, ref, chain_parents(3, 1), torch.tensor([[True, True, False]]), gen)
    assert_same(store, ref)


@pytest.mark.parametrize("longer", ["running", "admitted"])
def test_append_rows_equals_the_concatenating_cache_and_keeps_growing(longer):
    """Rows admitted mid-run (continuous batching): a store's rows joined after a running one's,
    the shorter part padded with zeroed holes; both keep stepping as one store."""
    gen = torch.Generator().manual_seed(5)
    parts = []
    for batch, steps in ((B, 6 if longer == "running" else 1), (2, 1 if longer == "running" else 6)):
        store, ref = KVStore(batch, "cpu", torch.float32, num_layers=2), ConcatReference(batch)
        for i in range(steps):
            keep = torch.ones(batch, 3, dtype=torch.bool)
            keep[0, 2] = i % 2 == 0  # a hole in the first row
            step(store, ref, chain_parents(3, batch), keep, gen)
        parts.append((store, ref))
    (store, ref), (other, other_ref) = parts
    widths = torch.tensor([store.num_slots] * B + [other.num_slots] * 2)
    store.append_rows(other)
    ref.append_rows(other_ref)
    assert store.batch == B + 2 and not store.dense
    assert_same(store, ref)
    padding = torch.arange(store.num_slots) >= widths.unsqueeze(1)  # the shorter part's new columns
    assert padding.any() and torch.equal(store.layer(0)[0].masked_select(padding[:, None, :, None]),
                                         torch.zeros(int(padding.sum()) * H * D))
    for _ in range(4):
        step(store, ref, chain_parents(2, B + 2), torch.ones(B + 2, 2, dtype=torch.bool), gen)
        assert_same(store, ref)
    store.compact(), ref.compact()
    assert_same(store, ref)


def test_append_rows_refuses_other_layers_and_a_pending_block():
    store, other = KVStore(1, "cpu", torch.float32, num_layers=2), KVStore(1, "cpu", torch.float32, num_layers=3)
    with pytest.raises(ValueError, match="same layers"):
        store.append_rows(other)
    same = KVStore(1, "cpu", torch.float32, num_layers=2)
    same.plan(chain_parents(1, 1))
    with pytest.raises(RuntimeError, match="between steps"):
        store.append_rows(same)


def test_masks_follow_holes_trees_and_the_sliding_window():
    store = KVStore(1, "cpu", torch.float32, layer_types=["sliding_attention", "full_attention"], sliding_window=2)
    gen = torch.Generator().manual_seed(3)
    step_keep = torch.tensor([[1, 1, 0]]).bool()
    store.plan(chain_parents(3, 1))
    store.write(0, torch.randn(1, H, 3, D, generator=gen), torch.randn(1, H, 3, D, generator=gen))
    store.commit(step_keep)  # slots at positions 0, 1 and a hole
    plan = store.plan(torch.tensor([[-1, 0, -1]]))
    full, sliding = (plan.attention_mask[t][0, 0] == 0 for t in ("full_attention", "sliding_attention"))
    assert plan.position_ids.tolist() == [[2, 3, 2]]
    assert full.tolist() == [[True, True, False, True, False, False],
                             [True, True, False, True, True, False],
                             [True, True, False, False, False, True]]
    assert sliding.tolist() == [[False, True, False, True, False, False],  # position 2 sees 1 and itself
                                [False, False, False, True, True, False],
                                [False, True, False, False, False, True]]


def ancestors_one_token_at_a_time(parents: torch.Tensor) -> torch.Tensor:
    """The specification: each token's row is its parent's row plus itself (the replaced loop)."""
    B, m = parents.shape
    anc = torch.eye(m, dtype=torch.bool).expand(B, m, m).clone()
    for i in range(m):
        p = parents[:, i]
        anc[:, i] |= anc[torch.arange(B), p.clamp(min=0)] & (p >= 0).unsqueeze(1)
    return anc


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 17, 40])
def test_the_vectorised_ancestor_matrix_equals_the_per_token_loop(m):
    gen = torch.Generator().manual_seed(m)
    idx = torch.arange(m)
    trees = [(torch.rand(4, m, generator=gen) * (idx + 1)).long() - 1 for _ in range(5)]  # parent in [-1, i)
    for parents in trees + [chain_parents(m, 2), torch.full((1, m), -1)]:
        assert torch.equal(ancestor_matrix(parents), ancestors_one_token_at_a_time(parents))


def test_a_chain_plan_equals_the_tree_plan_of_its_parents_and_drops_the_mask_only_when_dense():
    gen = torch.Generator().manual_seed(6)
    for layer_types in (None, ["sliding_attention", "full_attention"]):
        stores = [KVStore(2, "cpu", torch.float32, num_layers=2, layer_types=layer_types, sliding_window=3)
                  for _ in range(2)]
        for keep in (None, None, torch.tensor([[1, 1, 0], [1, 0, 0]]).bool(), None):
            tree = stores[0].plan(chain_parents(3, 2))
            chain = stores[1].plan(length=3, implicit_causal=True)
            if stores[1].dense:
                assert chain.attention_mask is None
            else:
                masks = [tree.attention_mask, chain.attention_mask]
                if layer_types is None:
                    masks = [{"full_attention": x} for x in masks]
                assert all(torch.equal(masks[0][t], masks[1][t]) for t in masks[0])
            assert torch.equal(tree.position_ids, chain.position_ids)
            for store in stores:
                keys = torch.randn(2, H, 3, D, generator=gen)
                store.write(0, keys, keys), store.write(1, keys, keys)
                store.commit(keep)
        assert stores[1].num_slots == 12 and not stores[1].dense
        assert torch.equal(stores[0].lengths, stores[1].lengths) and stores[1].lengths.tolist() == [11, 10]


def test_maybe_compact_is_the_one_policy(monkeypatch):
    """It compacts when that frees slots past the longest row, not for the holes of shorter rows."""
    store, gen = KVStore(2, "cpu", torch.float32, num_layers=2), torch.Generator().manual_seed(4)
    step(store, None, chain_parents(4, 2), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).bool(), gen)
    assert store.hole_fraction == 3 / 8 and KVStore.compact_at == 0.25
    store.maybe_compact()
    assert store.num_slots == 4  # would free 1 slot of 4, not more: left alone
    monkeypatch.setattr(KVStore, "compact_at", 0.2)
    store.maybe_compact(lengths=[3, 2])  # the caller's host copy of the lengths: no device read
    assert store.num_slots == 3 and store.valid.tolist() == [[True, True, True], [True, True, False]]
    assert not store.dense
    ragged = KVStore(2, "cpu", torch.float32, num_layers=2)  # prompts of 10 and 2 tokens: 40% holes
    step(ragged, None, chain_parents(10, 2), torch.arange(10).expand(2, 10) < torch.tensor([[10], [2]]), gen)
    assert ragged.hole_fraction == 0.4 > KVStore.compact_at
    ragged.maybe_compact()
    assert ragged.num_slots == 10  # compaction would free nothing


def test_refresh_dense_after_compacting_rows_of_equal_length():
    """A rejected block compacted away leaves every row full again: dense, so a chain has no mask
    (the GPU kit's repeated forwards over one context); a ragged store stays masked."""
    store, gen = KVStore(2, "cpu", torch.float32, num_layers=2), torch.Generator().manual_seed(5)
    step(store, None, chain_parents(4, 2), None, gen)
    assert store.dense and store.refresh_dense()
    step(store, None, chain_parents(3, 2), torch.zeros(2, 3, dtype=torch.bool), gen)
    assert not store.dense and not store.refresh_dense()  # holes: still masked
    store.compact()
    assert store.num_slots == 4 and store.refresh_dense()
    plan = store.plan(length=2, implicit_causal=True)
    assert plan.attention_mask is None and plan.position_ids.tolist() == [[4, 5], [4, 5]]
    store.write(0, torch.zeros(2, H, 2, D), torch.zeros(2, H, 2, D))
    store.write(1, torch.zeros(2, H, 2, 2), torch.zeros(2, H, 2, 3))
    store.commit(torch.tensor([[1, 1], [1, 0]]).bool())
    store.compact()
    assert store.lengths.tolist() == [6, 5] and not store.refresh_dense()  # rows of unequal length


def test_a_chain_prefix_kept_alike_in_every_row_drops_the_rest_and_stays_dense():
    """``commit(c)``: every row keeps the block's first c slots (a chain at batch 1 accepting c - 1
    drafts): the next block is written right after them, the store stays dense (no mask, nothing to
    compact), and the K/V, positions and lengths equal what holes and a compaction would leave."""
    gen = torch.Generator().manual_seed(7)
    fast, slow = (KVStore(2, "cpu", torch.float32, num_layers=2) for _ in range(2))
    for c in (3, 1, 4, 0):
        keys = torch.randn(2, H, 4, D, generator=gen)
        for store, keep in ((fast, c), (slow, torch.arange(4).expand(2, 4) < c)):
            plan = store.plan(length=4, implicit_causal=True)
            assert store is slow or plan.attention_mask is None  # dense throughout: never a mask
            store.write(0, keys, keys), store.write(1, keys, -keys)
            store.commit(keep)
        slow.compact()
        assert fast.dense and fast.num_slots == slow.num_slots == int(fast.lengths[0])
        assert torch.equal(fast.lengths, slow.lengths) and torch.equal(fast.slot_pos, slow.slot_pos)
        for i in range(2):
            assert all(torch.equal(a, b) for a, b in zip(fast.layer(i), slow.layer(i)))
    assert fast.lengths.tolist() == [8, 8]
    fast.plan(length=2, implicit_causal=True)
    for bad in (3, -1):
        with pytest.raises(ValueError, match="0..2 leading slots"):
            fast.commit(bad)


def test_the_target_writes_into_its_store_in_place():
    """A transformers model runs on the store: every layer's update lands in the preallocated
    buffers, and a whole step reallocates nothing while the block has room."""
    t = Target(tiny_model("llama", vocab_size=32))
    s = t.new_session(2)
    t.prefill(s, [[1, 2, 3], [4]])
    ptrs = [s.cache.layer(i)[0].data_ptr() for i in range(t.num_layers)]
    out = t.forward(s, torch.tensor([[5, 6], [7, 8]]))
    t.commit(s, torch.tensor([[1, 1], [1, 0]]).bool())
    assert [s.cache.layer(i)[0].data_ptr() for i in range(t.num_layers)] == ptrs
    assert s.cache.num_slots == 5 and s.cache.lengths.tolist() == [5, 2]
    assert out.logits.shape == (2, 2, 32)


def test_a_reservation_is_exact_and_the_store_grows_past_it_by_blocks():
    store, gen = KVStore(B, "cpu", torch.float32, num_layers=2), torch.Generator().manual_seed(2)
    store.reserve(11)
    assert store.capacity == 11  # exactly, not a whole block
    step(store, None, chain_parents(5, B), torch.ones(B, 5, dtype=torch.bool), gen)
    ptr = store.layer(0)[0].data_ptr()
    step(store, None, chain_parents(6, B), torch.ones(B, 6, dtype=torch.bool), gen)  # fills it: no move
    assert store.capacity == 11 and store.layer(0)[0].data_ptr() == ptr
    store.reserve(4)  # smaller than it holds: nothing changes
    assert store.capacity == 11 and store.layer(0)[0].data_ptr() == ptr
    before = store.layer(0)[0].clone()
    step(store, None, chain_parents(1, B), torch.ones(B, 1, dtype=torch.bool), gen)  # past it: a whole block
    assert store.capacity == KVStore.block and torch.equal(store.layer(0)[0][:, :, :11], before)
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="reserve"):
            store.reserve(bad)


@pytest.mark.parametrize("with_drafter", [False, True], ids=["autoregressive", "chain"])
def test_a_run_allocates_the_targets_kv_once(with_drafter, monkeypatch):
    """The loop reserves the longest row a dense run reaches (prompt + new tokens + a block): the
    target's buffers are allocated at that size and never move during the run."""
    from specdec.drafters.ngram import NgramDrafter
    from specdec.loop import Request, run
    from specdec.verifiers import GreedyVerifier

    t = Target(tiny_model("llama", vocab_size=32))
    sessions, moves = [], []
    new_session = Target.new_session
    monkeypatch.setattr(Target, "new_session", lambda self, *a, **kw: sessions.append(new_session(self, *a, **kw))
                        or sessions[-1])
    move = KVStore._move
    monkeypatch.setattr(KVStore, "_move", lambda self, *a, **kw: (moves.append((self, a)), move(self, *a, **kw))[1])
    prompts, n, k = [[1, 2, 3, 4, 5], [6, 7]], 12, 3
    drafter = NgramDrafter.create(t) if with_drafter else None
    res = run(t, drafter, GreedyVerifier(), [Request(p, n) for p in prompts], k=k, eos_token_ids=set())
    store = sessions[0].cache
    assert all(len(r.tokens) == n for r in res.requests)
    if with_drafter:  # drafts were kept and rejected: the rejected ones left holes in the store
        drafted, accepted = (sum(getattr(r.metrics, f) for r in res.requests) for f in ("drafted", "accepted"))
        assert drafted > accepted > 0
    room = 5 + n + (k + 1 if with_drafter else 0)
    assert [a for s, a in moves if s is store] == [(room,)]  # the reservation, before any K/V existed
    assert store.capacity == room

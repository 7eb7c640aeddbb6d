"""Suffix decoding: the suffix structure against a naive scan (counts, continuations, longest match,
speculation), incremental updates against a rebuild, draft size against match length, the global
tree (shared per target, helps a repeated prompt, bounded and evicted oldest first, lossless),
the proposal contract and the config's errors."""

from __future__ import annotations

import heapq
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specdec
from specdec import SamplingParams
from specdec.drafters.suffix.drafter import SuffixConfig, SuffixDrafter, clear_global_caches, global_cache
from specdec.drafters.suffix.tree import Draft, OutputCache, SuffixTree
from specdec.loop import Request, run
from specdec.target import Target
from specdec.testing import Recording, assert_greedy_equivalent, greedy_reference, sampled_gof
from specdec.testing.tiny import tiny_model
from specdec.types import node_depths
from specdec.verifiers import GreedyVerifier, RejectionVerifier


@pytest.fixture(autouse=True)
def _cold_global_trees():
    """No test sees another's earlier outputs."""
    clear_global_caches()
    yield
    clear_global_caches()


# --- the naive reference ------------------------------------------------------------------------
def naive_count(seqs: list[list[int]], pat: list[int], depth: int) -> int:
    if len(pat) > depth:
        return 0
    return sum(s[i:i + len(pat)] == pat for s in seqs for i in range(len(s) - len(pat) + 1))


def naive_continuations(seqs: list[list[int]], pat: list[int], depth: int) -> dict[int, int]:
    if len(pat) + 1 > depth:
        return {}
    return dict(Counter(s[i + len(pat)] for s in seqs for i in range(len(s) - len(pat)) if s[i:i + len(pat)] == pat))


def naive_speculate(seqs, depth, context, max_tokens, factor, offset, min_prob, max_draft_depth, tree) -> Draft:
    """Arctic's rule, from naive counts: every match length ascending, ties to the longer."""
    best = Draft()
    for m in range(1, min(len(context), depth - 1) + 1):
        pat = context[len(context) - m:]
        if naive_count(seqs, pat, depth) == 0:
            break
        budget = min(max_tokens, int(m * factor + offset + 1e-6))
        draft, heap, order = Draft(), [], 0

        def push(path, prob, parent, d):
            nonlocal order
            if d > max_draft_depth:
                return
            total = naive_count(seqs, path, depth)
            for tok, c in sorted(naive_continuations(seqs, path, depth).items(), key=lambda x: (-x[1], x[0])):
                if prob * c / total < min_prob:
                    break
                heapq.heappush(heap, (-(prob * c / total), order, parent, d, tok, path + [tok]))
                order += 1
                if not tree:
                    break

        if budget > 0:
            push(pat, 1.0, -1, 1)
        while heap and len(draft.tokens) < budget:
            neg, _, parent, d, tok, path = heapq.heappop(heap)
            draft.tokens.append(tok)
            draft.parents.append(parent)
            draft.probs.append(-neg)
            draft.score += -neg
            push(path, -neg, len(draft.tokens) - 1, d + 1)
        if draft.score >= best.score:
            best, best.match_len = draft, m
    return best


# --- the suffix structure -------------------------------------------------------------------------
ops_st = st.lists(st.one_of(
    st.tuples(st.just("extend"), st.integers(0, 2), st.lists(st.integers(0, 2), min_size=1, max_size=12)),
    st.tuples(st.just("remove"), st.integers(0, 2)),
), max_size=14)


def build(ops, depth: int) -> tuple[SuffixTree, dict[int, list[int]]]:
    """Interleaved appends (token by token, across sequences) and removals."""
    tree, seqs = SuffixTree(depth), {}
    for op in ops:
        if op[0] == "extend":
            tree.extend(op[1], op[2])
            seqs.setdefault(op[1], []).extend(op[2])
        elif op[1] in seqs:
            tree.remove(op[1])
            del seqs[op[1]]
    return tree, seqs


def patterns(seqs: dict[int, list[int]], depth: int) -> list[list[int]]:
    """Every stored substring up to depth + 1 tokens, and strings that occur nowhere."""
    found = {()} | {tuple(s[i:j]) for s in seqs.values() for i in range(len(s))
                    for j in range(i + 1, min(len(s), i + depth + 1) + 1)}
    return [list(p) for p in found] + [[4], [0, 4], [3] * (depth + 1)]


@settings(max_examples=150, deadline=None)
@given(ops=ops_st, depth=st.integers(2, 6), context=st.lists(st.integers(0, 2), min_size=1, max_size=9))
def test_counts_continuations_and_longest_match_equal_a_naive_scan(ops, depth, context):
    tree, seqs = build(ops, depth)
    stored = list(seqs.values())
    assert tree.seqs == seqs and tree.num_tokens == sum(map(len, stored))
    for p in patterns(seqs, depth):
        assert tree.count(p) == (naive_count(stored, p, depth) if p else tree.num_tokens), p
        assert tree.continuations(p) == naive_continuations(stored, p, depth), p
    longest = max(m for m in range(min(len(context), depth) + 1) if m == 0 or tree.count(context[-m:]))
    naive = max(m for m in range(min(len(context), depth) + 1) if m == 0 or naive_count(stored, context[-m:], depth))
    assert longest == naive


@settings(max_examples=150, deadline=None)
@given(ops=ops_st, base=st.lists(st.integers(0, 2), min_size=3, max_size=16), depth=st.integers(2, 7),
       data=st.data(), max_tokens=st.integers(1, 6), factor=st.sampled_from([0.5, 1.0, 2.0]),
       offset=st.sampled_from([0.0, 1.0]), min_prob=st.sampled_from([0.0, 0.1, 0.4]),
       max_draft_depth=st.integers(1, 4), tree_mode=st.booleans())
def test_speculation_equals_the_reference_rule(ops, base, depth, data, max_tokens, factor, offset, min_prob,
                                               max_draft_depth, tree_mode):
    """Longest-first with early stopping gives what trying every match length gives."""
    tree, seqs = build([("extend", 3, base)] + ops, depth)
    stored = [t for s in seqs.values() for t in s]  # contexts cut from what is stored mostly match
    cut = data.draw(st.integers(1, len(stored)))
    context = stored[max(0, cut - 8):cut] + data.draw(st.lists(st.integers(0, 2), max_size=2))
    args = (context, max_tokens, factor, offset, min_prob, max_draft_depth, tree_mode)
    got, want = tree.speculate(*args), naive_speculate(list(seqs.values()), depth, *args)
    assert (got.tokens, got.parents, got.match_len) == (want.tokens, want.parents, want.match_len)
    assert got.probs == pytest.approx(want.probs) and got.score == pytest.approx(want.score)
    assert len(got.tokens) <= max_tokens
    if got.tokens:
        assert int(node_depths(torch.tensor([got.parents])).max()) <= max_draft_depth


@settings(max_examples=100, deadline=None)
@given(ops=ops_st, depth=st.integers(2, 6), contexts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8),
                                                             min_size=1, max_size=4))
def test_incremental_updates_equal_a_rebuild(ops, depth, contexts):
    tree, seqs = build(ops, depth)
    fresh = SuffixTree(depth)
    for sid, s in seqs.items():
        fresh.extend(sid, s)
    for p in patterns(seqs, depth):
        assert (tree.count(p), tree.continuations(p)) == (fresh.count(p), fresh.continuations(p)), p
    for c in contexts:
        assert tree.speculate(c, 5, 1.0, 1.0, 0.1, 4) == fresh.speculate(c, 5, 1.0, 1.0, 0.1, 4)


@pytest.mark.parametrize("factor,offset", [(1.0, 0.0), (0.5, 0.0), (2.0, 0.0), (1.0, 2.0)])
def test_draft_size_grows_with_match_length(factor, offset):
    tree = SuffixTree(24)
    seq = list(range(40))  # every token unique: the continuation of any match is certain
    tree.extend(0, seq)
    sizes = []
    for m in range(1, 11):
        d = tree.speculate([99] + seq[20 - m:20], 8, factor, offset, 0.1, 8)  # 99 occurs nowhere: match = m
        assert d.match_len == m
        assert d.tokens == seq[20:20 + len(d.tokens)] and d.probs == [1.0] * len(d.tokens)
        sizes.append(len(d.tokens))
    assert sizes == [min(8, int(m * factor + offset)) for m in range(1, 11)]


def test_tree_branches_by_frequency():
    tree = SuffixTree(8)
    for i in range(3):
        tree.extend(i, [1, 2, 3, 9])
    tree.extend(3, [1, 2, 4, 8])
    d = tree.speculate([5, 1, 2], 4, 2.0, 0.0, 0.1, 4)
    assert (d.tokens, d.parents, d.probs, d.match_len) == ([3, 9, 4, 8], [-1, 0, -1, 2], [0.75, 0.75, 0.25, 0.25], 2)
    assert tree.speculate([5, 1, 2], 4, 2.0, 0.0, 0.3, 4).tokens == [3, 9]  # 1/4 < min_token_prob
    assert tree.speculate([5, 1, 2], 4, 2.0, 0.0, 0.1, 4, tree=False).parents == [-1, 0]  # the best path only
    assert tree.speculate([5, 1, 2], 4, 2.0, 0.0, 0.1, 1).tokens == [3, 4]  # depth 1: siblings only


# --- the global tree ------------------------------------------------------------------------------
def test_output_cache_evicts_oldest_first_by_sequences_and_tokens():
    cache = OutputCache(4)
    ids = [cache.add(2, 100) for _ in range(3)]
    assert list(cache.ages) == ids[1:]
    for sid in ids:
        cache.extend(sid, [sid, 7, 7], 2, 100)  # the evicted first one is ignored
    assert cache.tree.seqs == {ids[1]: [ids[1], 7, 7], ids[2]: [ids[2], 7, 7]}
    assert cache.tree.count([7, 7]) == 2 and cache.tree.count([ids[0], 7]) == 0

    cache = OutputCache(4)
    kept = []
    for i in range(5):
        sid = cache.add(100, 10)
        cache.extend(sid, [i] * 4, 100, 10)
        kept.append(sid)
        assert cache.tree.num_tokens <= 10
    assert list(cache.tree.seqs) == kept[-2:]  # 2 x 4 tokens fit under 10
    assert cache.tree.continuations([4]) == {4: 3} and cache.tree.count([0]) == 0
    sid = cache.add(100, 10)
    cache.extend(sid, list(range(11)), 100, 10)  # longer than the cap by itself: not kept
    assert cache.tree.num_tokens == 0 and not cache.ages


def _tiny_target(vocab: int = 256) -> Target:
    """Greedy outputs of a wider random model rarely repeat themselves: the per-request tree
    alone drafts little, so what the global tree adds shows."""
    return Target(tiny_model("llama", vocab_size=vocab, init_scale=0.3, seed=0))


PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 42, 7], [100, 3, 77, 12]]


def _accepted(target, drafter, k=4, n=40):
    res = run(target, drafter, GreedyVerifier(), [Request(p, n) for p in PROMPTS], k=k, eos_token_ids=set())
    for p, r in zip(PROMPTS, res.requests):
        ref, logits = greedy_reference(target.model, p, n)
        assert_greedy_equivalent(r.tokens, ref, logits)
    return [r.metrics.mean_accepted_length for r in res.requests]


def test_global_tree_drafts_a_repeated_prompt_from_its_first_answer():
    target = _tiny_target()
    first = _accepted(target, SuffixDrafter.create(target))
    again = _accepted(target, SuffixDrafter.create(target))  # another drafter of the same target shares it
    assert max(first) < 1.5 and min(again) > 3.5, (first, again)
    assert _accepted(target, SuffixDrafter.create(target, max_cached_requests=0)) == first  # per-request only
    other = _tiny_target()  # a different target object: a different global tree
    assert _accepted(other, SuffixDrafter.create(other)) == first


def test_global_tree_is_bounded_while_it_is_used():
    target = _tiny_target()
    drafter = SuffixDrafter.create(target, max_cached_tokens=50, max_cached_requests=2)
    cache = global_cache(target, drafter.config.max_depth)
    for i in range(3):
        run(target, drafter, GreedyVerifier(), [Request([i + 1, 2, 3], 20), Request([9, i], 30)], k=3,
            eos_token_ids=set())
        assert cache.tree.num_tokens <= 50 and len(cache.ages) <= 2
    assert cache.tree.seqs and set(cache.ages) <= {4, 5}  # what is left is the last run's (ids 4, 5)
    clear_global_caches()
    assert global_cache(target, drafter.config.max_depth) is not cache


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(st.lists(st.integers(0, 31), min_size=1, max_size=8), min_size=1, max_size=3),
       k=st.integers(1, 5), tree_mode=st.booleans())
def test_greedy_is_lossless_with_a_warm_global_tree(target, prompts, k, tree_mode):
    drafter = SuffixDrafter.create(target, tree=tree_mode, max_spec_tokens=6)
    for _ in range(2):  # the second pass drafts from the first one's outputs
        res = run(target, drafter, RejectionVerifier(), [Request(p, 12) for p in prompts], k=k, eos_token_ids=set())
        for p, r in zip(prompts, res.requests):
            ref, logits = greedy_reference(target.model, p, 12)
            assert_greedy_equivalent(r.tokens, ref, logits)


def test_sampling_is_lossless_with_a_shared_global_tree(target):
    """Thousands of rows draft from each other's outputs: the output is still the target's (the
    χ² tool seeds its rows, which draft from the global tree when asked: ``global_for_seeded``)."""
    drafter = SuffixDrafter.create(target, max_spec_tokens=6, global_for_seeded=True)
    r = sampled_gof(target, drafter, RejectionVerifier(), [1, 2, 3, 4], SamplingParams(temperature=1.0),
                    n_samples=3000)
    assert len(r.pvalues) >= 3
    assert r.min_p > 1e-3 / len(r.pvalues), min(zip(r.pvalues, r.tests))
    assert global_cache(target, 24).tree.num_tokens > 3000  # the rows did share one tree


# --- the drafter ----------------------------------------------------------------------------------
def test_proposals_are_deterministic_trees_of_depth_at_most_k(target):
    rec = Recording(SuffixDrafter.create(target, max_spec_tokens=8, global_for_seeded=True))
    # sampled rows of one prompt: the shared global tree (which seeded rows draft from only when
    # asked) sees several continuations of one context
    reqs = [Request([1, 2, 1, 2, 1, 2, 3], 16, SamplingParams(temperature=1.0, seed=s)) for s in range(16)]
    run(target, rec, RejectionVerifier(), reqs + [Request([5, 5, 5, 5], 16)], k=3, eos_token_ids=set())
    ragged = branched = False
    for p in rec.proposals:
        assert p.q is None
        valid = torch.arange(p.n) < p.num_valid.unsqueeze(1)
        if p.n:
            assert int(torch.where(valid, node_depths(p.parents), 0).max()) <= 3
            assert bool((p.parents[~valid] == -1).all())  # padding
        ragged |= len(set(p.num_valid.tolist())) > 1
        branched |= any(len(set(p.parents[b, : int(p.num_valid[b])].tolist())) < int(p.num_valid[b])
                        for b in range(p.tokens.shape[0]))
        assert int(p.num_valid.max()) <= 8
    assert ragged and branched


@pytest.mark.parametrize("options,error,match", [
    ({"max_depth": 1}, ValueError, "max_depth must be >= 2"),
    ({"max_depth": 2.5}, TypeError, "max_depth must be an integer"),
    ({"max_spec_tokens": 0}, ValueError, "max_spec_tokens must be >= 1"),
    ({"max_spec_factor": -1.0}, ValueError, "max_spec_factor must be >= 0"),
    ({"max_spec_factor": "1"}, TypeError, "max_spec_factor must be a number"),
    ({"max_spec_offset": float("nan")}, ValueError, "max_spec_offset must be finite"),
    ({"min_token_prob": 1.5}, ValueError, "min_token_prob must be <= 1"),
    ({"tree": "yes"}, TypeError, "tree must be a bool"),
    ({"max_cached_requests": -1}, ValueError, "max_cached_requests must be >= 0"),
    ({"max_cached_tokens": 0}, ValueError, "max_cached_tokens must be >= 1"),
    ({"max_spec_factor": 0.0}, ValueError, "allow no draft token"),
    ({"max_tree_depth": 24}, TypeError, "max_tree_depth"),
])
def test_config_refuses_bad_values_by_name(options, error, match):
    with pytest.raises(error, match=match):
        SuffixConfig(**options)


def test_create_and_registry(target):
    d = specdec.make_drafter("suffix", target, max_depth=np.int64(16), min_token_prob=0.2)
    assert isinstance(d, SuffixDrafter) and d.config.max_depth == 16 and type(d.config.max_depth) is int
    assert d.cache is global_cache(target, 16)
    assert SuffixDrafter.tiny(target).cache is None  # the conformance instance keeps rows independent


@pytest.mark.slow
def test_smollm2_greedy_equals_plain_decoding(smollm2):
    prompt = "Write a Python function that returns the sum of a list, then explain it in two sentences."
    plain = specdec.generate(smollm2, prompt, None, max_new_tokens=48, chat=True, eos_token_ids=set())
    first = specdec.generate(smollm2, prompt, "suffix", k=4, max_new_tokens=48, chat=True, eos_token_ids=set())
    again = specdec.generate(smollm2, prompt, "suffix", k=4, max_new_tokens=48, chat=True, eos_token_ids=set())
    assert first.tokens == plain.tokens and again.tokens == plain.tokens
    assert again.summary.mean_accepted_length > first.summary.mean_accepted_length + 1.0

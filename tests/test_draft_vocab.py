"""Draft vocabularies (token maps, FR-Spec): ranking, the file, the checks, the restricted head, the drafters.

Losslessness with a draft vocabulary is the conformance suite's (``*[draft_vocab]`` cases in
conftest.py); here: that nothing outside the map is ever drafted, and the pieces on their own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specdec
from specdec.draft_vocab import (coverage, draft_vocabulary, rank_tokens, read_token_map, save_token_map,
                                 token_counts)
from specdec.registry import DRAFTERS
from specdec.sampling import SamplingParams
from specdec.target import Target
from specdec.testing import Recording
from specdec.testing.tiny import tiny_model
from specdec.data.corpus import corpus_token_counts, read_corpus
from specdec.data.sequences import TokenSeq, held_out_seq

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "experiments" / "data" / "smollm2-135m"
MAP = CORPUS / "token_map.safetensors"


def test_tokens_rank_most_frequent_first_ties_to_the_lower_id_and_unseen_ids_are_left_out():
    seqs = [TokenSeq(torch.tensor([9, 9, 4, 4, 7, 7, 7, 2]), 2), TokenSeq(torch.tensor([1, 2, 5]), 1)]
    counts = token_counts(seqs, 10)  # responses only: [4, 4, 7, 7, 7, 2] and [2, 5]
    assert counts.tolist() == [0, 0, 2, 0, 2, 1, 0, 3, 0, 0]
    assert rank_tokens(counts).tolist() == [7, 2, 4, 5]
    assert coverage(counts, torch.tensor([7, 2])) == pytest.approx(5 / 8)


def test_a_token_map_round_trips_as_int32_safetensors(tmp_path):
    path = tmp_path / "map.safetensors"
    save_token_map(path, torch.tensor([7, 2, 4, 5]), {"source": "test"})
    assert read_token_map(path).tolist() == [7, 2, 4, 5]
    assert draft_vocabulary(str(path), 3, 10).tolist() == [2, 4, 7]  # the first 3, sorted
    assert draft_vocabulary(path, 0, 10).tolist() == [2, 4, 5, 7]  # 0: all of it


def test_bad_token_maps_and_sizes_are_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="needs a token_map"):
        draft_vocabulary("", 8, 32)
    assert draft_vocabulary("", 0, 32) is None and draft_vocabulary(None, 0, 32) is None
    with pytest.raises(FileNotFoundError, match="no file"):
        draft_vocabulary(tmp_path / "missing.safetensors", 0, 32)
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file
    save_file({"ids": torch.arange(3)}, str(other))
    with pytest.raises(ValueError, match="holds no 'token_ids'"):
        draft_vocabulary(other, 0, 32)
    with pytest.raises(ValueError, match="more than the token map's 3 ids"):
        draft_vocabulary([1, 2, 3], 4, 32)
    with pytest.raises(ValueError, match=r"lie in \[0, 32\)"):
        draft_vocabulary([1, 2, 32], 0, 32)
    with pytest.raises(ValueError, match="distinct"):
        draft_vocabulary([1, 2, 1], 0, 32)
    with pytest.raises(TypeError, match="draft_vocab must be an integer"):
        draft_vocabulary([1, 2], 1.0, 32)
    with pytest.raises(TypeError, match="token_map id must be an integer"):
        draft_vocabulary([1, 2.5], 0, 32)
    with pytest.raises(TypeError, match="1-D integer tensor"):
        draft_vocabulary(torch.tensor([1.0, 2.0]), 0, 32)
    with pytest.raises(ValueError, match="draft_vocab must be >= 0"):
        draft_vocabulary([1, 2], -1, 32)


@pytest.mark.parametrize("family", ["llama", "gemma4"])  # gemma4: the head's soft-capping applies to the kept rows
def test_the_head_over_a_draft_vocabulary_is_the_full_head_at_those_ids_and_minus_inf_elsewhere(family):
    target = Target(tiny_model(family, vocab_size=32, init_scale=0.3, seed=0))
    hidden = torch.randn(2, 3, target.hidden_size)
    vocab = torch.tensor([0, 4, 9, 31])
    full, part = target.logits(hidden), target.logits(hidden, vocab=vocab)
    assert part.shape == full.shape and part.dtype == torch.float32
    torch.testing.assert_close(part[..., vocab], full[..., vocab])
    others = torch.ones(32, dtype=torch.bool)
    others[vocab] = False
    assert torch.isneginf(part[..., others]).all()
    bf16 = target.logits(hidden, torch.bfloat16, vocab)
    torch.testing.assert_close(bf16[..., vocab], full[..., vocab], atol=0.05, rtol=0.05)
    with torch.no_grad():
        target.lm_head.weight.mul_(2.0)  # the copy of the rows follows the weight
    torch.testing.assert_close(target.logits(hidden, vocab=vocab)[..., vocab], target.logits(hidden)[..., vocab])


@pytest.mark.parametrize("family", ["mtp", "dflash", "dspark"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafters_never_propose_outside_their_draft_vocabulary(target, family, temperature):
    ranked = [5, 0, 17, 3, 30, 9]
    drafter = Recording(DRAFTERS.get(family).tiny(target, token_map=ranked, draft_vocab=4))
    out = specdec.generate(target, [[1, 2, 3], [4, 5, 6, 7]], drafter, k=3, max_new_tokens=12,
                           sampling=SamplingParams(temperature=temperature, seed=0), eos_token_ids=set(), progress=False)
    drafted = torch.cat([p.tokens.flatten() for p in drafter.proposals])
    assert drafted.numel() > 0 and set(drafted.tolist()) <= {0, 3, 5, 17}
    for p in drafter.proposals:  # sampled drafts declare q = 0 outside the vocabulary
        if p.q is not None:
            outside = torch.ones(p.q.shape[-1], dtype=torch.bool)
            outside[[0, 3, 5, 17]] = False
            assert (p.q[..., outside] == 0).all()
    assert all(len(t) == 12 for t in out.tokens)


def test_a_tree_needs_as_many_drafted_ids_as_first_branches(target):
    with pytest.raises(ValueError, match="tree_top_k=3 needs as many drafted ids"):
        DRAFTERS.get("mtp").tiny(target, token_map=[1, 2], tree_top_k=3)


def test_corpus_counts_split_by_the_one_held_out_rule():
    seqs = list(read_corpus(CORPUS))[:256]  # the first four shards
    train, held = token_counts([s for s in seqs if not held_out_seq(s, 20)], 49152), \
        token_counts([s for s in seqs if held_out_seq(s, 20)], 49152)
    assert held.sum() > 0 and train.sum() > 10 * held.sum()
    full_train, full_held = corpus_token_counts(CORPUS, 49152)
    assert (full_train >= train).all() and (full_held >= held).all()


def test_the_committed_token_map_is_what_its_command_makes(tmp_path):
    committed = read_token_map(MAP)
    assert committed.unique().numel() == committed.numel() and 0 <= committed.min() and committed.max() < 49152
    out = tmp_path / "map.safetensors"
    subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), "--config-name", "lab/token_map", f"out={out}",
                    f"hydra.run.dir={tmp_path / 'run'}"], check=True, capture_output=True, cwd=ROOT)
    assert torch.equal(read_token_map(out), committed)


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_block_drafters_read_only_their_checkpoints_draft_vocabulary_rows(target, family):
    """A checkpoint's own draft vocabulary (t2d) is the head's only rows read, alone or within a map."""
    d = DRAFTERS.get(family).tiny(target)
    assert d.drafted_ids() is None
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[[3, 5, 7, 17]] = True
    d.model.set_draft_vocab(t2d)
    assert d.drafted_ids().tolist() == [3, 5, 7, 17]
    mapped = DRAFTERS.get(family).tiny(target, token_map=[5, 0, 17, 3, 30], draft_vocab=3)
    mapped.model.set_draft_vocab(t2d)
    assert mapped.drafted_ids().tolist() == [5, 17]  # the map's first three within t2d
    mapped.model.set_draft_vocab(torch.arange(target.vocab_size) == 30)
    with pytest.raises(ValueError, match="no id of the token map"):
        mapped.drafted_ids()


def test_the_rows_copy_goes_with_the_vocabulary_that_asked_for_it():
    """Drafters come and go over one target: a copy of head rows lives as long as its vocabulary."""
    import gc

    target = Target(tiny_model("llama", vocab_size=32, init_scale=0.3, seed=0))
    hidden = torch.randn(1, 1, target.hidden_size)
    for n in range(3, 8):
        target.logits(hidden, vocab=torch.arange(n))  # each vocabulary dropped right after
        gc.collect()
    kept = torch.arange(4)
    target.logits(hidden, vocab=kept)
    rows = [c[1].shape[0] for c in target._head_copies.values()]
    assert rows == [4]

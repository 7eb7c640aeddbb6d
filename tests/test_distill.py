"""Self-distillation data: benchmark items held out, responses are the target's greedy output, cache exact."""

from __future__ import annotations

import pytest
import torch

from specdec.eval.config import DatasetConfig
from specdec.eval.datasets import load_dataset
from specdec.training.data import HELD_OUT, extract_features, self_distill, target_features, training_conversations
from specdec.testing import assert_greedy_equivalent, greedy_reference


def test_benchmark_items_are_held_out():
    texts = {m[0]["content"] for m in training_conversations(300)}
    held = load_dataset(DatasetConfig(name="mtbench", num_prompts=HELD_OUT["mtbench"], turns=2))
    held_code = load_dataset(DatasetConfig(name="humaneval", num_prompts=HELD_OUT["humaneval"]))
    assert not texts & {t for s in held for t in s.turns}
    assert not texts & {s.turns[0] for s in held_code}
    later = load_dataset(DatasetConfig(name="humaneval", num_prompts=164))[HELD_OUT["humaneval"]:]
    assert texts & {s.turns[0] for s in later}  # the rest is used


def test_conversations_are_seeded():
    assert training_conversations(20, seed=1) == training_conversations(20, seed=1)
    assert training_conversations(20, seed=1) != training_conversations(20, seed=2)
    with pytest.raises(ValueError, match="offline prompts"):
        training_conversations(10**7)


@pytest.mark.slow
def test_self_distill_is_the_targets_greedy_output_and_caches(smollm2, tmp_path):
    path = tmp_path / "d.safetensors"
    seqs = self_distill(smollm2, 3, max_new_tokens=6, batch=2, path=path)
    assert path.exists() and len(seqs) == 3
    for s in seqs:
        prompt = s.tokens[: s.response_start].tolist()
        ref, logits = greedy_reference(smollm2.model, prompt, 6)
        ours = s.tokens[s.response_start:].tolist()
        assert_greedy_equivalent(ours, ref[: len(ours)], logits)
        assert len(ours) == 6 or ours[-1] in smollm2.eos_token_ids
    again = self_distill(smollm2, 3, max_new_tokens=6, batch=2, path=path)
    assert all(torch.equal(a.tokens, b.tokens) and a.response_start == b.response_start for a, b in zip(seqs, again))

    hs, final = target_features(smollm2, seqs[0].tokens, [0, 2, smollm2.num_layers])
    out = smollm2.model(input_ids=seqs[0].tokens[None], output_hidden_states=True)
    torch.testing.assert_close(hs[:, 1], out.hidden_states[2][0])
    torch.testing.assert_close(smollm2.lm_head(final), out.logits[0])
    with pytest.raises(ValueError, match="outside"):
        target_features(smollm2, seqs[0].tokens, [smollm2.num_layers + 1])

    cached = tmp_path / "f.safetensors"
    feats = extract_features(smollm2, seqs, [2, 5], cached, max_len=9, dtype=torch.float32)
    assert cached.exists() and all(f.tokens.numel() == min(9, s.tokens.numel()) for f, s in zip(feats, seqs))
    torch.testing.assert_close(feats[0].features, target_features(smollm2, seqs[0].tokens[:9], [2, 5])[0].flatten(1))
    # read back, not recomputed: the file holds float32, a recomputation would give bfloat16
    for a, b in zip(feats, extract_features(smollm2, seqs, [2, 5], cached)):
        assert torch.equal(a.tokens, b.tokens) and a.response_start == b.response_start
        assert torch.equal(a.features, b.features) and torch.equal(a.final, b.final)

"""The transformers door: model.generate(custom_generate=specdec.custom_generate(...))."""

from __future__ import annotations

import pytest
import torch

import specdec
from specdec.testing.tiny import tiny_model


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", vocab_size=32, init_scale=0.3, seed=0)
    m.generation_config.pad_token_id = 0
    return m


@pytest.mark.parametrize("drafter", [None, "ngram", "draft_model"])
@pytest.mark.parametrize("policy", [None, "adaptive"])
def test_greedy_equals_transformers_generate(model, drafter, policy):
    options = {"model": model} if drafter == "draft_model" else {}
    ids = torch.tensor([[3, 7, 3, 7, 3, 9], [5, 6, 7, 5, 6, 7]])
    for eos in (2, 31):  # 2 ends row 0 at once; with 31 both rows run the whole length
        ref = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=eos)
        ours = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                              custom_generate=specdec.custom_generate(drafter, k=3, policy=policy, **options))
        assert torch.equal(ours, ref)
    assert ref.shape == (2, 18)


def test_left_padded_batch_gives_each_rows_own_output(model):
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    door = specdec.custom_generate("ngram", k=2)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, custom_generate=door)
    for b in range(2):
        alone = model.generate(ids[b: b + 1, mask[b].bool()], max_new_tokens=6, do_sample=False)
        new = alone[0, int(mask[b].sum()):].tolist()
        assert out[b, 5: 5 + len(new)].tolist() == new and set(out[b, 5 + len(new):].tolist()) <= {0}


def test_sampling_follows_the_generation_config_and_torch_seed(model):
    ids = torch.tensor([[3, 7, 3, 7]])
    door = specdec.custom_generate("ngram", k=2)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(model.generate(ids, max_new_tokens=8, do_sample=True, temperature=0.7, top_k=5, top_p=0.9,
                                   custom_generate=door))
    assert torch.equal(runs[0], runs[1]) and 4 < runs[0].shape[1] <= 12


def test_settings_the_loop_cannot_reproduce_are_refused(model):
    ids = torch.tensor([[3, 7, 3, 7]])
    door = specdec.custom_generate("ngram")
    with pytest.raises(ValueError, match="RepetitionPenaltyLogitsProcessor"):
        model.generate(ids, max_new_tokens=4, repetition_penalty=1.3, custom_generate=door)
    with pytest.raises(ValueError, match="return_dict_in_generate"):
        model.generate(ids, max_new_tokens=4, return_dict_in_generate=True, custom_generate=door)
    with pytest.raises(ValueError, match="unknown drafter 'eagle'"):
        specdec.custom_generate("eagle")
    with pytest.raises(ValueError, match="policy must be"):
        specdec.custom_generate("ngram", policy="adaptve")

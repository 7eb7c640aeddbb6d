"""Bad input fails with a clear error before any work starts."""

from __future__ import annotations

import pytest
import torch

import specdec
from specdec.loop import Request, run
from specdec.target import Target
from specdec.testing.tiny import tiny_model
from specdec.types import DraftProposal
from specdec.verifiers import RejectionVerifier


class _Tok:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return self.vocab


def test_unknown_names(target):
    with pytest.raises(ValueError, match="unknown drafter 'eagle9'"):
        specdec.make_drafter("eagle9", target)
    with pytest.raises(ValueError, match="unknown verifier 'maybe'"):
        specdec.make_verifier("maybe")


def test_a_misspelt_drafter_option_is_named_with_the_drafters_options(target):
    with pytest.raises(ValueError, match=r"drafter 'ngram' has no option 'chekpoint'; its options are: max_ngram, min_ngram$"):
        specdec.make_drafter("ngram", target, chekpoint="x")
    with pytest.raises(ValueError, match=r"'eagle3' has no option 'tre'; its options are: model, checkpoint, tree, "):
        specdec.make_drafter("eagle3", target, tre="chain")
    with pytest.raises(ValueError, match=r"'dspark' has no option 'schedular'; .*checkpoint, greedy_draft, scheduler"):
        specdec.make_drafter("dspark", target, schedular=True)
    with pytest.raises(ValueError, match=r"'gemma_mtp' has no option 'greedy'; its options are: model, checkpoint, greedy_draft$"):
        specdec.generate(target, [[1, 2]], drafter="gemma_mtp", greedy=True)
    assert specdec.make_drafter("ngram", target, max_ngram=2).config.max_ngram == 2


def test_a_misspelt_verifier_option_is_named_with_the_verifiers_options():
    with pytest.raises(ValueError, match=r"verifier 'rejection' has no option 'in_kernel_temp'; its options are:"
                                         r" in_kernel_temperature$"):
        specdec.make_verifier("rejection", in_kernel_temp=True)
    with pytest.raises(ValueError, match=r"verifier 'greedy' has no option 'x'; its options are: none$"):
        specdec.make_verifier("greedy", x=1)
    assert specdec.make_verifier("rejection", in_kernel_temperature=True).in_kernel_temperature


def test_vocabulary_and_tokenizer_mismatch(target):
    with pytest.raises(ValueError, match="vocabulary"):
        specdec.make_drafter("draft_model", target, model=tiny_model("llama", vocab_size=40))
    a = Target(target.model, _Tok({"a": 0}))
    with pytest.raises(ValueError, match="tokenizer"):
        specdec.make_drafter("draft_model", a, model=target.model, tokenizer=_Tok({"b": 0}))


def test_k_below_one_empty_prompt_too_long_and_out_of_range(target):
    d = specdec.make_drafter("ngram", target)
    v = RejectionVerifier()
    with pytest.raises(ValueError, match="k .* must be >= 1"):
        run(target, d, v, [Request([1, 2])], k=0)
    with pytest.raises(ValueError, match="empty prompt"):
        run(target, d, v, [Request([1, 2]), Request([])], k=2)
    with pytest.raises(ValueError, match="context window"):
        run(target, d, v, [Request([1] * 500, 20)], k=2)
    with pytest.raises(ValueError, match="token ids"):
        run(target, d, v, [Request([1, 99])], k=2)
    with pytest.raises(ValueError, match="no requests"):
        run(target, d, v, [], k=2)


def test_unbound_drafter_is_refused(target):
    other = Target(tiny_model("llama", vocab_size=32, seed=9))
    d = specdec.make_drafter("ngram", other)
    with pytest.raises(ValueError, match="not bound"):
        run(target, d, RejectionVerifier(), [Request([1, 2])], k=2)


def test_greedy_verifier_with_sampling_is_refused(target):
    with pytest.raises(ValueError, match="temperature 0"):
        specdec.generate(target, [[1, 2, 3]], verifier="greedy", sampling=specdec.SamplingParams(temperature=1.0))


def test_malformed_proposals_are_caught():
    with pytest.raises(ValueError, match="lie in"):
        DraftProposal.chain(torch.tensor([[1, 40]])).validate(1, 32)
    with pytest.raises(ValueError, match="parent"):
        DraftProposal(torch.tensor([[1, 2]]), torch.tensor([[-1, 1]])).validate(1, 32)
    with pytest.raises(ValueError, match="q shape"):
        DraftProposal.chain(torch.tensor([[1, 2]]), torch.ones(1, 2, 31)).validate(1, 32)


@pytest.mark.parametrize("family,option", [("eagle3", "dtype"), ("mtp", "head_dtype"), ("dflash", "head_dtype"),
                                           ("dspark", "head_dtype")])
def test_a_drafters_dtype_is_a_float_dtype_name(target, family, option):
    tiny = specdec.registry.DRAFTERS.get(family).tiny
    with pytest.raises(ValueError, match=f"{option} must be one of .*'float32', 'bfloat16', 'float16'.*got 'int8'"):
        tiny(target, **{option: "int8"})
    with pytest.raises(TypeError, match=f"{option} must be a dtype name"):
        tiny(target, **{option: torch.bfloat16})

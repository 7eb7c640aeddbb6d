"""Grouped-query attention (specdec.gqa_attention): inside the target's forward each KV head's
query heads are one block of rows over it (one query, or a block under a mask the heads share), or
``enable_gqa`` under per-head masks, with transformers' values; everything else goes to the
function it wraps."""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface, DynamicCache

from specdec import gqa_attention
from specdec.gqa_attention import _GroupedSDPA, grouped, packed_rows
from specdec.target import Target
from specdec.testing.tiny import tiny_model
from specdec.transformers_versions import cache_kwargs


class _SDPA(TorchFunctionMode):
    """Records each SDPA call: (its enable_gqa, query heads, key heads, query rows)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[bool, int, int, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k = args[0], args[1]
            self.calls.append((bool(kwargs.get("enable_gqa")), q.shape[1], k.shape[1], q.shape[2]))
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
    # fast: each KV head's 2 query heads × 3 tokens as 6 rows over it; general: transformers repeats the KV heads
    assert all(c == ((False, 2, 2, 6) if fast else (False, 4, 4, 3)) for c in spy.calls), spy.calls
    if parents is None:  # transformers over the same tokens, its own causal attention
        with torch.inference_mode():
            want = model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), **cache_kwargs(DynamicCache())).logits[:, 5:]
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
        model(input_ids=torch.tensor([[1, 2, 3, 4]]), **cache_kwargs(cache))
        model(input_ids=torch.tensor([[5, 6]]), **cache_kwargs(cache))  # masked multi-query block, not in grouped()
    layers = model.config.num_hidden_layers  # the masked block's calls: KV heads repeated, as transformers does
    assert len(spy.calls) == 2 * layers and spy.calls[layers:] == [(False, 4, 4, 2)] * layers
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 6, 8)
    mask = torch.ones(1, 1, 3, 6, dtype=torch.bool)
    route = _GroupedSDPA.route
    with grouped():
        assert route(q, k, k, mask, 0.0, {}) == "packed"  # a mask the heads share
        assert route(q[:, :, :1], k, k, None, 0.0, {}) == "packed"  # one query (decoding)
        assert route(q[:, :, :1], k, k, mask[:, :, :1], 0.0, {}) == "packed"
        assert route(q, k, k, mask.expand(1, 4, 3, 6), 0.0, {}) == "gqa"  # per-head masks
        assert route(q, torch.randn(1, 4, 6, 8), k, mask, 0.0, {}) is None  # no grouping
        assert route(q, k, torch.randn(1, 2, 6, 4), mask, 0.0, {}) is None  # MLA's narrower values
        assert route(q, k, k, None, 0.0, {}) is None  # transformers' own causal path
        assert route(q, k, k, mask, 0.0, {"softcap": 30.0}) is None
        assert route(q, k, k, mask[..., :5], 0.0, {}) is None  # a mask over other keys
        assert route(q, k, k, mask, 0.1, {}) is None  # dropout
        with packed_rows(False):  # every head its own (the roofline's library_gqa)
            assert route(q, k, k, mask, 0.0, {}) == "gqa" and route(q[:, :, :1], k, k, None, 0.0, {}) is None
        assert route(q, k, k, mask, 0.0, {}) == "packed"
    assert route(q, k, k, mask, 0.0, {}) is None  # outside the block


@pytest.mark.parametrize("how", ["packed", "gqa"])
@pytest.mark.parametrize("m", [1, 4])
def test_packed_rows_and_enable_gqa_give_the_repeated_heads_values(how, m):
    """Each KV head's query group as rows (under a shared mask, or none for one query) and
    ``enable_gqa`` (per-head masks) give what transformers' repeated heads give, per row and head."""
    torch.manual_seed(0)
    B, H, Hkv, S, d = 2, 6, 2, 9, 8
    q, k, v = torch.randn(B, H, m, d), torch.randn(B, Hkv, S, d), torch.randn(B, Hkv, S, d)
    mask = torch.rand(B, 1, m, S) > 0.3
    mask[..., 0] = True  # every row sees something
    if how == "gqa":
        mask = mask.expand(B, H, m, S).clone()
        mask[:, 1, :, 1] = ~mask[:, 1, :, 1]  # heads differ
    elif m == 1:
        mask = None
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(H // Hkv, 1),
                                                            v.repeat_interleave(H // Hkv, 1), attn_mask=mask)
    gqa_attention.install()
    with grouped():
        assert _GroupedSDPA.route(q, k, v, mask, 0.0, {}) == how
        got, _ = AttentionInterface().get("sdpa")(None, q, k, v, mask)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-6)


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
            want = model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9]]), **cache_kwargs(DynamicCache())).logits[:, 6:]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=family)

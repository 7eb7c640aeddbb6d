"""The target adapter: tree forwards equal per-path forwards, captured features equal the
model's own hidden states, and the ragged cache (holes, rollback, compaction, retirement)
never changes a logit. Run on every supported family."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specdec.target import Target, layer_output_ids
from specdec.testing.tiny import FAMILIES, tiny_model
from specdec.transformers_versions import cache_kwargs
from specdec.types import Requirements, chain_parents, padded_ids


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), **cache_kwargs(DynamicCache())).logits[0].float()


@pytest.fixture(params=sorted(FAMILIES))
def family_target(request):
    return Target(tiny_model(request.param, vocab_size=48, init_scale=0.2, seed=3))


@pytest.fixture(params=[True, False], ids=["fast", "general"])
def fast(request) -> bool:
    return request.param


def test_tree_logits_equal_per_path_logits(family_target, fast):
    t, m = family_target, family_target.model
    t.fast = fast
    s = t.new_session(2)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]
    out, _, _ = t.prefill(s, prompts)
    for b, p in enumerate(prompts):
        torch.testing.assert_close(out.logits[b, 0], full_logits(m, p)[-1], atol=1e-4, rtol=1e-4)
    tokens = torch.tensor([[11, 12, 13, 14, 15], [16, 17, 18, 19, 20]])
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 0, 3]])
    o = t.forward(s, tokens, parents)
    for b in range(2):
        for i in range(5):
            path, j = [], i
            while j >= 0:
                path.append(int(tokens[b, j]))
                j = int(parents[b, j])
            ref = full_logits(m, prompts[b] + path[::-1])[-1]
            torch.testing.assert_close(o.logits[b, i], ref, atol=1e-4, rtol=1e-4)


def test_ragged_commits_rollback_and_compaction_keep_logits_exact(family_target, fast):
    """Rows keep different paths; holes, a rollback and a compaction leave logits unchanged.
    The sequences run past gemma3's sliding window of 4, so the per-type masks are exercised."""
    t, m = family_target, family_target.model
    t.fast = fast
    s = t.new_session(2)
    seqs = [[1, 2, 3], [4, 5]]
    t.prefill(s, seqs)
    steps = [
        (torch.tensor([[6, 7, 8], [9, 10, 11]]), torch.tensor([[-1, 0, 0], [-1, 0, 1]]),
         torch.tensor([[1, 0, 1], [1, 1, 1]])),
        (torch.tensor([[12, 13], [14, 15]]), None, torch.tensor([[1, 1], [1, 0]])),
    ]
    for tokens, parents, keep in steps:
        t.forward(s, tokens, parents)
        t.commit(s, keep.bool())
        for b in range(2):
            seqs[b] += [int(x) for x, k in zip(tokens[b], keep[b]) if k]
    s.cache.rollback(torch.tensor([1, 0]))
    seqs[0] = seqs[0][:-1]
    for compact in (False, True):
        if compact:
            s.cache.compact()
            assert s.cache.num_slots == max(len(x) for x in seqs)
        o = t.forward(s, torch.tensor([[21], [22]]))
        for b in range(2):
            torch.testing.assert_close(o.logits[b, 0], full_logits(m, seqs[b] + [21 + b])[-1], atol=1e-4, rtol=1e-4)
        t.commit(s, torch.zeros(2, 1, dtype=torch.bool))
    s.cache.select_rows(torch.tensor([1]))
    o = t.forward(s, torch.tensor([[23]]))
    torch.testing.assert_close(o.logits[0, 0], full_logits(m, seqs[1] + [23])[-1], atol=1e-4, rtol=1e-4)


def test_chain_fast_path_equals_the_tree_path_and_the_model(family_target, fast):
    """Equal-length prompts and whole-block commits keep the store dense, where a chain runs with
    no mask (the model's own causal attention); a hole turns the mask back on. Every logit equals
    a cache-free forward, with the fast paths on and off, past gemma3's sliding window of 4."""
    t, m = family_target, family_target.model
    t.fast = fast
    s = t.new_session(2)
    seqs = [[1, 2, 3, 4], [5, 6, 7, 8]]
    out, _, _ = t.prefill(s, seqs)
    for b in range(2):
        torch.testing.assert_close(out.logits[b, 0], full_logits(m, seqs[b])[-1], atol=1e-4, rtol=1e-4)
    blocks = [(torch.tensor([[9], [10]]), None), (torch.tensor([[11, 12, 13], [14, 15, 16]]), None),
              (torch.tensor([[17, 18], [19, 20]]), torch.tensor([[1, 0], [1, 1]]).bool()),
              (torch.tensor([[21, 22], [23, 24]]), None)]
    for i, (tokens, keep) in enumerate(blocks):
        assert s.cache.dense == (i < 3)  # until the hole
        o = t.forward(s, tokens)
        for b in range(2):
            for j in range(tokens.shape[1]):
                ref = full_logits(m, seqs[b] + tokens[b, : j + 1].tolist())[-1]
                torch.testing.assert_close(o.logits[b, j], ref, atol=1e-4, rtol=1e-4)
        t.commit(s, keep)
        for b in range(2):
            seqs[b] += [int(x) for j, x in enumerate(tokens[b]) if keep is None or keep[b, j]]
    assert not s.cache.dense


def test_captured_features_are_layer_inputs(family_target):
    t, m = family_target, family_target.model
    L = t.num_layers
    s = t.new_session(1)
    ids = [3, 1, 4, 1, 5]
    with t.capturing(Requirements(layer_inputs=(0, 1, L), final_hidden=True)):
        out, _, _ = t.prefill(s, [ids])
    with torch.inference_mode():
        ref = m(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.hidden[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.hidden[1], ref[1], atol=1e-5, rtol=1e-5)
    # transformers' last tuple entry is after the final norm: that is our final_hidden
    torch.testing.assert_close(out.final_hidden, ref[L], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(t.final_norm(out.hidden[L]), ref[L], atol=1e-5, rtol=1e-5)


def test_cache_free_features_agree_with_the_loops_hooks_at_every_id(family_target):
    """``features`` serves training (the store, online featurizing) and the hooks serve decoding:
    a drafter trained on one and run on the other must see the same tensor at every id, the last
    layer's output (before the final norm) included."""
    t = family_target
    L = t.num_layers
    ids = [3, 1, 4, 1, 5]
    with t.capturing(Requirements(layer_inputs=(0, 1, L), final_hidden=True)):
        out, _, _ = t.prefill(t.new_session(1), [ids])
    with torch.inference_mode():
        feats, final = t.features(torch.tensor([ids]), (0, 1, L))
    for i in (0, 1, L):
        torch.testing.assert_close(feats[i], out.hidden[i], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, out.final_hidden, atol=1e-5, rtol=1e-5)


def test_layer_ids_are_checked_and_converted():
    t = Target(tiny_model("llama", vocab_size=32))
    with pytest.raises(ValueError, match="layer id 7"):
        t.check(Requirements(layer_inputs=(7,)))
    assert layer_output_ids([1, 9, 17]) == (2, 10, 18)


def test_padded_ids_right_pads_ragged_rows_and_refuses_overlong_ones():
    out = padded_ids([[3, 4], [], (5, 6, 7)], 4, -1)
    assert out.dtype == torch.long and out.tolist() == [[3, 4, -1, -1], [-1, -1, -1, -1], [5, 6, 7, -1]]
    with pytest.raises(ValueError, match="width=2"):
        padded_ids([[1, 2, 3]], 2, 0)


def test_compaction_gathers_valid_slots_to_the_front():
    t = Target(tiny_model("llama", vocab_size=32))
    s = t.new_session(2)
    t.prefill(s, [[1, 2], [3]])
    t.forward(s, torch.tensor([[4, 5], [6, 7]]))
    t.commit(s, torch.tensor([[1, 0], [1, 1]]).bool())
    s.cache.compact()
    assert s.cache.valid.tolist() == [[True, True, True], [True, True, True]]
    assert s.cache.slot_pos.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert s.cache.lengths.tolist() == [3, 3]


def test_new_layers_are_built_like_the_layer_they_imitate(family_target):
    """A layer from ``layer_config(i)`` has layer i's weights (no more: no per-layer input, Gemma 4's
    per-layer embeddings have no rows for it), runs on the rotary of layer i's type and keeps its own
    K/V of layer i's shape in the cache it is handed, even where layer i reads another layer's (Gemma 4)."""
    t = family_target
    x = torch.randn(1, 3, t.hidden_size)
    for spec in t.layer_specs():
        layer = t.new_layer(t.layer_config(spec.index, 2), 1)
        t.init_weights(layer)
        mine = {n: p.shape for n, p in layer.named_parameters()}
        theirs = {n: p.shape for n, p in t.layers[spec.index].named_parameters()}
        if not spec.kv_shared:
            assert mine.items() <= theirs.items(), (spec, set(mine.items()) - set(theirs.items()))
        store = t.new_store(1, 2)
        plan = store.plan(chain_parents(3))
        mask = plan.attention_mask[spec.layer_type] if isinstance(plan.attention_mask, dict) else plan.attention_mask
        with torch.inference_mode():
            out = layer(x, attention_mask=mask, position_ids=plan.position_ids, **cache_kwargs(t.kv_cache(store)),
                        use_cache=True, position_embeddings=t.rotary(x, plan.position_ids, spec.layer_type))
        store.commit(torch.ones(1, 3, dtype=torch.bool))
        assert (out[0] if isinstance(out, tuple) else out).shape == x.shape
        keys, _ = store.layer(1)
        if spec.head_dim is not None:  # MLA keeps latent K/V of its own shape
            assert keys.shape == (1, spec.num_kv_heads, 3, spec.head_dim), spec


def test_layer_specs_carry_each_layer_types_rope(family_target):
    """A Llama rotary built from a spec's flat RoPE parameters gives the target's own cos/sin for
    that layer type (Gemma 3/4 keep one RoPE per type: 10⁴ sliding, 10⁶ full, Gemma 4's proportional)."""
    t = family_target
    x, pos = torch.zeros(1), torch.arange(0, 400, 9).unsqueeze(0)
    for spec in t.layer_specs():
        if spec.head_dim is None:  # MLA: the rotary covers only part of a head
            continue
        cfg = LlamaConfig(hidden_size=t.hidden_size, num_attention_heads=spec.num_heads, head_dim=spec.head_dim,
                          rope_parameters=spec.rope_parameters)
        for got, want in zip(LlamaRotaryEmbedding(cfg)(x, pos), t.rotary(x, pos, spec.layer_type)):
            torch.testing.assert_close(got, want)
def test_threads_come_from_the_machine_unless_the_user_chose(monkeypatch):
    import specdec.target as target_module
    from specdec.target import set_threads

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(target_module, "machine_threads", lambda: 1)
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(target_module, "_THREADS_AT_IMPORT", 2)  # torch's default counted more cores
        assert set_threads() == 1  # lowered to the machine's share
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert set_threads() == 2  # the environment chose
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(target_module, "_THREADS_AT_IMPORT", 3)  # set_num_threads(2) was called since import
        assert set_threads() == 2
        assert set_threads(1) == 1  # the argument wins
        with pytest.raises(ValueError, match="threads must be >= 1"):
            set_threads(0)
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow  # torch.compile (inductor) on two CPU cores: about two minutes
def test_a_compiled_target_gives_the_eager_logits():
    m = tiny_model("llama", vocab_size=48, init_scale=0.2, seed=3)
    outs = []
    for t in (Target(m), Target(m, compile=True)):
        s = t.new_session(2)
        o, _, _ = t.prefill(s, [[1, 2, 3], [4, 5, 6]])
        logits = [o.logits]
        for tokens, parents, keep in [(torch.tensor([[7], [8]]), None, None),
                                      (torch.tensor([[9, 10, 11], [12, 13, 14]]), torch.tensor([[-1, 0, 0], [-1, 0, 1]]),
                                       torch.tensor([[1, 1, 0], [1, 1, 1]]).bool())]:
            logits.append(t.forward(s, tokens, parents).logits)
            t.commit(s, keep)
        outs.append(logits)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("drafter", [None, "ngram", "draft_model", "random_tree"])
def test_greedy_decoding_equals_transformers_with_fast_paths_on_and_off(fast, drafter):
    """Equal-length prompts (a dense store: the mask-free chain path while nothing is rejected)
    and ragged ones (masks from the start), every token equal to transformers' greedy decoding."""
    import specdec
    from specdec.loop import Request, run
    from specdec.testing import RandomDrafter, greedy_reference
    from specdec.verifiers import GreedyVerifier

    model = tiny_model("llama", vocab_size=32, init_scale=0.3, seed=0)
    t = Target(model, fast=fast)
    for prompts in ([[3, 7, 3, 7, 3, 9], [5, 6, 7, 5, 6, 7]], [[3, 7, 3, 7], [5, 6, 7, 5, 6, 7, 1]]):
        if drafter == "random_tree":
            d = RandomDrafter.create(t, siblings="deterministic", branching=[2, 2])
        elif drafter is not None:
            d = specdec.make_drafter(drafter, t, **({"model": model} if drafter == "draft_model" else {}))
        res = run(t, None if drafter is None else d, GreedyVerifier(), [Request(p, 12) for p in prompts], k=3,
                  eos_token_ids=set())
        for p, r in zip(prompts, res.requests):
            assert r.tokens == greedy_reference(model, p, 12)[0]


def test_logits_in_another_dtype_read_a_copy_of_the_head_made_once():
    """What drafters draft through: the head in bf16, float32 out, close to the target's own; the
    copy is made once and again only when the weight changes."""
    t = Target(tiny_model("llama", vocab_size=48, init_scale=0.2, seed=3))
    h = torch.randn(2, 3, t.hidden_size)
    own, low = t.logits(h), t.logits(h, torch.bfloat16)
    assert low.dtype == torch.float32 and low.shape == own.shape and not torch.equal(low, own)
    torch.testing.assert_close(low, own, atol=0.05, rtol=0.05)
    assert torch.equal(t.logits(h, torch.float32), own)  # the head's own dtype: no copy
    copy = t._head_copy(torch.bfloat16)[0]
    assert t._head_copy(torch.bfloat16)[0] is copy
    with torch.no_grad():
        t.lm_head.weight.mul_(2)
    assert t._head_copy(torch.bfloat16)[0] is not copy
    torch.testing.assert_close(t.logits(h, torch.bfloat16), 2 * low, atol=0.1, rtol=0.05)

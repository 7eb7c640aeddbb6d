"""The EAGLE-3 drafter: feature layers and shapes, the reduced vocabulary (exact q over the full
vocabulary), static and dynamic tree structure, the draft cache after acceptance, training-time
test against decoding, checkpoint interchange (speculators round trip, SafeAILab layout) and bad
input (the committed SmolLM2 checkpoint: tests/test_checkpoints.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdec import SamplingParams
from specdec.training.data import FeatureSeq
from specdec.drafters.eagle3.drafter import Eagle3Config, Eagle3Drafter
from specdec.drafters.eagle3.checkpoint import load_eagle3, save_eagle3, serving_config
from specdec.drafters.eagle3.model import default_layer_ids, vocab_map
from specdec.drafters.eagle3.tree import MAX_TREE_DEPTH, parse_tree, rerank
from specdec.kv import KVStore
from specdec.loop import Request, run
from specdec.sampling import RowSampling
from specdec.target import Target
from specdec.testing import Recording
from specdec.testing.tiny import tiny_model
from specdec.drafters.eagle3.train import ttt_loss
from specdec.types import node_depths
from specdec.verifiers import GreedyVerifier, RejectionVerifier

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12, 3]]


@pytest.fixture(scope="module")
def deep_target() -> Target:
    """8 layers, so the default feature layers (2, 4, 5) are distinct."""
    return Target(tiny_model("llama", vocab_size=32, init_scale=0.3, seed=3, num_hidden_layers=8))


def first_proposal(target, drafter, prompt, sampling=SamplingParams(), k=3, anchor=False):
    """The proposal made right after the prefill (and, with ``anchor``, the token it follows)."""
    rec = Recording(drafter)
    run(target, rec, GreedyVerifier() if sampling.greedy else RejectionVerifier(), [Request(prompt, 2, sampling)],
        k=k, eos_token_ids=set())
    return (rec.proposals[0], int(rec.anchors[0])) if anchor else rec.proposals[0]


# --- shapes and the feature-layer convention -----------------------------------------------------
def test_default_feature_layers_are_eagle3s():
    assert default_layer_ids(30) == (2, 15, 27)  # SmolLM2: inputs of layers 2, L//2, L-3
    assert default_layer_ids(32) == (2, 16, 29)  # Llama-3.1-8B, as vLLM and SafeAILab pick them


def test_drafter_reads_the_layer_inputs_it_declares(deep_target):
    ids = default_layer_ids(8)
    d = Eagle3Drafter.tiny(deep_target, layer_ids=ids)
    assert d.requirements().layer_inputs == ids
    assert d.model.fc.in_features == 3 * deep_target.hidden_size
    q_proj = d.model.layers[0].self_attn.q_proj
    assert q_proj.in_features == 2 * d.model.config.hidden_size  # cat[emb, hidden]
    # the target hands out the residual stream at the *input* of each layer: HF hidden_states[i]
    ids_t = torch.tensor([PROMPTS[1]])
    out = deep_target.model(ids_t, output_hidden_states=True)
    session = deep_target.new_session(1)
    with deep_target.capturing(d.requirements()):
        mine = deep_target.forward(session, ids_t)
    for i in ids:  # the target's linear layers over a few rows round differently (specdec.few_rows)
        torch.testing.assert_close(mine.hidden[i], out.hidden_states[i], rtol=1e-4, atol=1e-4)


# --- reduced vocabulary ----------------------------------------------------------------------------
def test_vocab_map_keeps_the_most_frequent_tokens_sorted():
    counts = torch.tensor([5, 0, 9, 1, 9, 3])
    d2t, t2d = vocab_map(counts, 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 2, 4]
    assert t2d.tolist() == [True, False, True, False, True, False]


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0, seed=0),
                                      SamplingParams(temperature=0.7, top_k=5, seed=1)], ids=["t1", "topk5"])
def test_q_is_exact_over_the_full_vocabulary(target, sampling):
    d = Eagle3Drafter.tiny(target)
    p, anchor = first_proposal(target, d, PROMPTS[0], sampling, anchor=True)
    assert p.q is not None and p.q.shape == (1, 3, target.vocab_size)
    outside = ~d.model.t2d
    assert float(p.q[..., outside].abs().max()) == 0.0  # nothing outside the draft vocabulary
    torch.testing.assert_close(p.q.sum(-1), torch.ones(1, 3))
    assert bool(d.model.t2d[p.tokens].all())
    # node 0's q is the warped full-vocabulary logits of the draft head at the root
    state = d.start(*_prefill(target, d, PROMPTS[0], anchor))
    rows = RowSampling([sampling])
    torch.testing.assert_close(p.q[0, 0], rows.probs(d.model.full_logits(state.root))[0])


def test_a_greedy_draft_is_the_draft_vocabularys_best_and_the_sampled_one_scatters(target):
    """Greedy drafting ranks the draft vocabulary alone and maps the winners to target ids: the
    same tokens as ranking the full-vocabulary logits (−inf outside)."""
    d = Eagle3Drafter.tiny(target)
    state = d.start(*_prefill(target, d, PROMPTS[0]))
    draft, full = d.model.draft_logits(state.root), d.model.full_logits(state.root)
    assert draft.shape == (1, d.model.spec.draft_vocab_size)
    assert torch.equal(full[:, d.model.draft_ids], draft)
    p = d.propose(state, 1, RowSampling([SamplingParams()]))
    assert p.q is None and int(p.tokens[0, 0]) == int(full[0].argmax())


def test_a_bf16_draft_keeps_its_weights_and_cache_in_bf16_for_an_fp32_target(target):
    d = Eagle3Drafter.tiny(target, dtype="bfloat16")
    assert target.dtype == torch.float32 and d.model.fc.weight.dtype == torch.bfloat16
    state = d.start(*_prefill(target, d, PROMPTS[0]))
    assert state.root.dtype == torch.bfloat16 and state.cache.layer(0)[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        Eagle3Config(dtype="int8")


def _prefill(target, drafter, prompt, anchor=None):
    """A drafter's start() inputs for one prompt followed by ``anchor`` (default: the target's argmax)."""
    from specdec.types import Committed

    session = target.new_session(1)
    with target.capturing(drafter.requirements()):
        out, padded, lengths = target.prefill(session, [prompt])
    nxt = out.logits[:, -1].argmax(-1) if anchor is None else torch.tensor([anchor])
    c = Committed(tokens=padded, num_tokens=lengths, positions=torch.arange(padded.shape[1]).expand_as(padded),
                  next_tokens=nxt, active=torch.ones(1, dtype=torch.bool), hidden=out.hidden)
    return c, RowSampling([SamplingParams()])


# --- trees -------------------------------------------------------------------------------------------
def test_static_tree_parsing_orders_nodes_parents_first():
    t = parse_tree("[(1,), (0, 0), (0,), (0, 1), (0, 0, 0)]")
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert t.parents == (-1, -1, 0, 0, 2)
    assert t.ranks == (0, 1, 0, 1, 0)
    assert t.cut(2).paths == t.paths[:4] and t.depth == 3
    assert parse_tree(t.to_vllm()) == t


@pytest.mark.parametrize("bad, match", [
    ("[(0, 0)]", "no parent"), ("[(0,), (2,)]", "sibling ranks"), ("[(0,), (0,)]", "duplicate"),
    ("[]", "at least one"), ("[(0, -1)]", "non-negative"), ("nonsense", "list of tuples"),
    (str([(0,) * d for d in range(1, MAX_TREE_DEPTH + 2)]), "deeper than"),
])
def test_bad_static_trees_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_tree(bad)
    with pytest.raises(ValueError, match=match):
        Eagle3Config(tree="static", static_tree=bad)


@pytest.mark.parametrize("tree, words", [("chain", "a chain of"), ("dynamic", "a dynamic tree of depth")])
def test_k_past_the_depth_cap_is_refused_in_the_modes_own_words(target, tree, words):
    d = Recording(Eagle3Drafter.tiny(target, tree=tree))
    d.inner.check_k(MAX_TREE_DEPTH)  # the cap itself is allowed
    for k in (MAX_TREE_DEPTH + 1, 1000):
        with pytest.raises(ValueError, match=f"tree={tree!r} drafts {words} k; k={k} exceeds its cap of {MAX_TREE_DEPTH}"):
            run(target, d, GreedyVerifier(), [Request(PROMPTS[0], 2)], k=k, eos_token_ids=set())
    assert d.proposals == []  # refused before any work


def test_a_static_tree_takes_any_k(target):
    d = Recording(Eagle3Drafter.tiny(target, tree="static"))
    run(target, d, GreedyVerifier(), [Request(PROMPTS[0], 2)], k=MAX_TREE_DEPTH + 1, eos_token_ids=set())
    assert d.proposals[0].n == len(parse_tree(d.inner.config.static_tree).paths)


def test_static_tree_proposal_follows_the_tree(target):
    tree = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"
    d = Eagle3Drafter.tiny(target, tree="static", static_tree=tree)
    greedy = first_proposal(target, d, PROMPTS[1], k=3)
    assert greedy.q is None and greedy.parents[0].tolist() == [-1, -1, -1, 0, 0, 1, 3]
    state = d.start(*_prefill(target, d, PROMPTS[1]))
    top3 = d.model.full_logits(state.root).topk(3).indices[0]
    assert greedy.tokens[0, :3].tolist() == top3.tolist()  # root's children: the 3 best draft tokens
    assert first_proposal(target, d, PROMPTS[1], k=2).n == 6  # cut at depth k
    sampled = first_proposal(target, d, PROMPTS[1], SamplingParams(temperature=1.0, seed=4), k=3)
    assert sampled.q is not None
    assert len(set(sampled.tokens[0, :3].tolist())) == 3  # siblings drawn without replacement
    q = sampled.q[0]
    for j in (1, 2):  # q of a later sibling excludes the earlier ones
        assert float(q[j, sampled.tokens[0, :j]].sum()) == 0.0


def test_dynamic_tree_respects_budget_and_reranks(target):
    K, budget, k = 3, 10, 4
    d = Eagle3Drafter.tiny(target, tree="dynamic", tree_top_k=K, tree_budget=budget)
    rec = Recording(d)
    run(target, rec, GreedyVerifier(), [Request(p, 6) for p in PROMPTS], k=k, eos_token_ids=set())
    for p in rec.proposals:
        assert p.q is None and p.n == budget
        depth = node_depths(p.parents)
        assert int(depth.max()) <= k
        idx = torch.arange(p.n)
        assert bool((p.parents < idx).all())  # parents before children
        for b in range(p.tokens.shape[0]):  # siblings are distinct tokens
            pairs = set(zip(p.parents[b].tolist(), p.tokens[b].tolist()))
            assert len(pairs) == p.n
    one = first_proposal(target, d, PROMPTS[0], k=1)
    assert one.n == K  # depth 1 has only K candidates


def test_rerank_keeps_the_best_and_their_ancestors():
    # candidates: 0,1 at depth 1 (root children); 2,3 children of 0; 4 child of 1; 5 child of 2
    scores = torch.tensor([[-0.1, -1.0, -0.1, -0.5, -1.2, -0.3]])
    depths = torch.tensor([[1, 1, 2, 2, 2, 3]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2]])
    kept, par = rerank(scores, depths, parents, budget=4)
    assert kept.tolist() == [[0, 2, 3, 5]]  # ties (-0.1) go to the shallower node first
    assert par.tolist() == [[-1, 0, 0, 1]]


# --- the draft cache after acceptance ----------------------------------------------------------------
class _Trace(Recording):
    """Records every proposal and how many tokens each row committed after it."""

    def __init__(self, inner):
        super().__init__(inner)
        self.committed: list[list[int]] = []

    def observe(self, state, committed):
        self.committed.append(committed.num_tokens.tolist())
        super().observe(state, committed)


@pytest.mark.parametrize("tree", ["chain", "static", "dynamic"])
def test_drafts_after_acceptance_equal_drafts_from_a_fresh_start(target, tree, monkeypatch):
    """Every proposal made mid-generation (after rollbacks and compactions) equals the proposal a
    new generation makes on the same committed context."""
    d = Eagle3Drafter.tiny(target, tree=tree, tree_top_k=2, tree_budget=6)
    monkeypatch.setattr(KVStore, "compact_at", 0.0)  # compact whenever there are holes
    rec, n = _Trace(d), 10
    res = run(target, rec, GreedyVerifier(), [Request(p, n) for p in PROMPTS], k=3, eos_token_ids=set())
    assert any(r.metrics.accepted for r in res.requests), "nothing accepted: the test would prove little"
    emitted, live = [1] * len(PROMPTS), list(range(len(PROMPTS)))  # the prefill emits one token
    for prop, counts in zip(rec.proposals, rec.committed):
        for row, b in enumerate(live):
            context = PROMPTS[b] + res.requests[b].tokens[: emitted[b] - 1]  # the anchor is emitted[b]-1
            fresh = first_proposal(target, d, context, k=3)
            assert torch.equal(fresh.tokens[0], prop.tokens[row]), (b, emitted[b])
            assert torch.equal(fresh.parents[0], prop.parents[row])
        for row, b in enumerate(live):
            emitted[b] += counts[row]
        live = [b for b in live if emitted[b] < n]


# --- training-time test is what decoding runs ----------------------------------------------------------
@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle3.1"])
def test_ttt_steps_equal_chain_drafting(target, eagle31):
    """Teacher-forced on the drafter's own greedy chain, TTT's step-s logits at the last context
    slot are the logits the drafter drafted node s from (EAGLE-3.1: per-feature norms, and each
    step reading the previous one's norm(y), in both)."""
    d = Eagle3Drafter.tiny(target, draft_vocab_size=target.vocab_size, fc_norm=eagle31, norm_output=eagle31)
    _randomise_norms(d)
    prompt, k = PROMPTS[1], 4
    prop = first_proposal(target, d, prompt, k=k)
    state = d.start(*_prefill(target, d, prompt))
    anchor_tok = int(target.model(torch.tensor([prompt])).logits[0, -1].argmax())
    seq = torch.tensor(prompt + [anchor_tok] + prop.tokens[0].tolist())
    with torch.no_grad():
        out = target.model(seq[None], output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i][0] for i in d.model.spec.layer_ids], -1)
    fs = FeatureSeq(seq, 0, feats, out.hidden_states[-1][0])
    head = target.lm_head.weight[d.model.draft_ids]
    a = len(prompt) - 1
    r = ttt_loss(d.model, target.embed_tokens, head, d.model.t2d, fs, torch.tensor([a]), steps=k)
    torch.testing.assert_close(r.logits[0][0], d.model.full_logits(state.root)[0], atol=1e-4, rtol=1e-4)
    assert [int(d.model.draft_ids[lg[0].argmax()]) for lg in r.logits] == prop.tokens[0].tolist()


# --- interchange -------------------------------------------------------------------------------------
def _same_drafts(target, a, b, tree="dynamic"):
    for s in (SamplingParams(), SamplingParams(temperature=1.0, seed=3)):
        ra = run(target, a, RejectionVerifier(), [Request(p, 8, s) for p in PROMPTS], k=3, eos_token_ids=set())
        rb = run(target, b, RejectionVerifier(), [Request(p, 8, s) for p in PROMPTS], k=3, eos_token_ids=set())
        assert [r.tokens for r in ra.requests] == [r.tokens for r in rb.requests]
        pa = first_proposal(target, a, PROMPTS[1], s)
        pb = first_proposal(target, b, PROMPTS[1], s)
        assert torch.equal(pa.tokens, pb.tokens)


@pytest.mark.parametrize("variant", [{}, dict(own_embedding=True, norm_before_fc=True, norm_before_residual=False)])
def test_speculators_round_trip(target, tmp_path, variant):
    d = Eagle3Drafter.tiny(target, tree="static", **variant)
    save_eagle3(d.model, tmp_path, verifier="tiny", dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] == d.model.spec.draft_vocab_size
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(d.model.spec.layer_ids)
    assert cfg["transformer_layer_config"]["hidden_size"] == target.hidden_size
    e = Eagle3Drafter.create(target, checkpoint=str(tmp_path), tree="static")
    for (ka, va), (kb, vb) in zip(d.model.state_dict().items(), e.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    _same_drafts(target, d, e)


def _randomise_norms(d: Eagle3Drafter) -> None:
    """Norm weights away from 1 (tiny() randomises matrices only), so a norm read wrongly shows."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in d.model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))


def test_eagle3_1_flags_round_trip_as_speculators_writes_them(target, tmp_path):
    """fc_norm and norm_output (EAGLE-3.1) as speculators names them: two config.json flags and
    one ``fc_norm.<i>.weight`` per feature layer."""
    d = Eagle3Drafter.tiny(target, tree="static", fc_norm=True, norm_output=True)
    _randomise_norms(d)
    save_eagle3(d.model, tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["fc_norm"], cfg["norm_output"], cfg["norm_before_fc"]) == (True, True, False)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert {k for k in f.keys() if "fc_norm" in k} == {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}
        assert f.get_tensor("fc_norm.0.weight").shape == (target.hidden_size,)
    e = Eagle3Drafter.create(target, checkpoint=str(tmp_path), tree="static")
    assert e.model.spec.fc_norm and e.model.spec.norm_output
    for (ka, va), (kb, vb) in zip(d.model.state_dict().items(), e.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    _same_drafts(target, d, e)
    # the fused input is concat(Norm_i(h_i)) before fc, as speculators' forward computes it
    h = torch.randn(2, 5, 3 * target.hidden_size)
    m = e.model
    manual = m.fc(torch.cat([norm(c) for norm, c in zip(m.fc_norm, h.chunk(3, -1))], -1))
    torch.testing.assert_close(m.fuse(h), manual)
    y = torch.randn(2, 5, m.config.hidden_size)
    torch.testing.assert_close(m.carry(y), m.norm(y))


def test_an_eagle3_checkpoint_without_the_eagle3_1_flags_is_plain_eagle3(target, tmp_path):
    d = Eagle3Drafter.tiny(target, tree="static")
    _randomise_norms(d)
    save_eagle3(d.model, tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg.pop("fc_norm"), cfg.pop("norm_output")) == (False, False)
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # as written before the flags existed
    e = Eagle3Drafter.create(target, checkpoint=str(tmp_path), tree="static")
    assert not e.model.spec.fc_norm and not e.model.spec.norm_output and e.model.fc_norm is None
    y = torch.randn(2, e.model.config.hidden_size)
    assert torch.equal(e.model.carry(y), y)
    _same_drafts(target, d, e)
    # the same weights read as EAGLE-3.1 draft differently: the flags are not ignored
    cfg["norm_output"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    f = Eagle3Drafter.create(target, checkpoint=str(tmp_path), tree="static")
    assert not torch.equal(first_proposal(target, f, PROMPTS[1], k=4).tokens,
                           first_proposal(target, d, PROMPTS[1], k=4).tokens)
    with pytest.raises(ValueError, match="exclusive"):
        Eagle3Drafter.tiny(target, fc_norm=True, norm_before_fc=True)


def test_bf16_checkpoint_is_small_and_loads(target, tmp_path):
    d = Eagle3Drafter.tiny(target)
    save_eagle3(d.model, tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert "embed_tokens.weight" not in f.keys()  # the target's embedding is shared
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    e = Eagle3Drafter.create(target, checkpoint=str(tmp_path))
    assert e.model.fc.weight.dtype == target.dtype


def test_safeailab_layout_loads_into_identical_drafts(deep_target, tmp_path):
    d = Eagle3Drafter.tiny(deep_target, layer_ids=default_layer_ids(8), norm_before_residual=False, tree="dynamic")
    c = d.model.config
    weights = {("midlayer." + k[len("layers.0."):]) if k.startswith("layers.0.") else k: v.clone()
               for k, v in d.model.state_dict().items()}
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size, "rope_theta": c.rope_parameters["rope_theta"],
        "max_position_embeddings": c.max_position_embeddings, "draft_vocab_size": d.model.spec.draft_vocab_size}))
    e = Eagle3Drafter.create(deep_target, checkpoint=str(tmp_path), tree="dynamic")
    assert e.model.spec.layer_ids == (2, 4, 5) and not e.model.spec.norm_before_residual
    _same_drafts(deep_target, d, e)


def test_serving_config():
    chain = serving_config("/ckpt", k=5)
    vllm = json.loads(chain["vllm"].split("'")[1])
    assert vllm == {"method": "eagle3", "model": "/ckpt", "num_speculative_tokens": 5}
    assert "--speculative-algorithm EAGLE3" in chain["sglang"] and "--speculative-num-draft-tokens 6" in chain["sglang"]
    static = serving_config("/ckpt", k=2, tree="static", static_tree="[(0,), (1,), (0, 0), (0, 0, 0)]")
    cfg = json.loads(static["vllm"].split("'")[1])
    assert cfg["num_speculative_tokens"] == 3 and cfg["speculative_token_tree"] == "[(0,), (1,), (0, 0)]"
    dyn = serving_config("/ckpt", k=6, tree="dynamic", tree_top_k=8, tree_budget=47)
    assert "--speculative-num-steps 6 --speculative-eagle-topk 8 --speculative-num-draft-tokens 48" in dyn["sglang"]


# --- bad input -----------------------------------------------------------------------------------------
def test_bad_input_errors(target, deep_target, tmp_path):
    d = Eagle3Drafter.tiny(deep_target)
    with pytest.raises(ValueError, match="hidden size"):
        bad = Eagle3Drafter(d.model)
        wide = Target(tiny_model("llama", vocab_size=32, hidden_size=48, num_attention_heads=4))
        bad.bind(wide)
    with pytest.raises(ValueError, match="tree must be"):
        Eagle3Config(tree="forest")
    with pytest.raises(ValueError, match="checkpoint"):
        Eagle3Drafter.create(target)
    save_eagle3(Eagle3Drafter.tiny(target).model, tmp_path, dtype=torch.float32)
    from safetensors.torch import load_file

    w = load_file(str(tmp_path / "model.safetensors"))
    w["d2t"] = w["d2t"][:-1]
    save_file(w, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t has"):
        load_eagle3(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="pickled"):
        load_eagle3(tmp_path)


def test_a_chain_is_proposed_as_a_chain(target):
    """tree=chain proposals say so, so the target verifies them on its chain fast path."""
    p = first_proposal(target, Eagle3Drafter.tiny(target), PROMPTS[0], k=3)
    assert p.is_chain and p.parents[0].tolist() == [-1, 0, 1]
    assert not first_proposal(target, Eagle3Drafter.tiny(target, tree="static"), PROMPTS[0], k=3).is_chain


def test_the_chain_estimate_is_what_decoding_accepts_and_never_above_the_per_position_one(deep_target):
    """experiments/benchmarks/eagle3_chain_estimate.py on a tiny head: the training-time test's chain figure is
    at most its per-position one and falls with depth; both are shares of the same anchors."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chain_estimate", ROOT / "experiments" / "benchmarks" / "eagle3_chain_estimate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    d = Eagle3Drafter.tiny(deep_target, layer_ids=default_layer_ids(8), init_scale=0.05)
    out = module.estimates(deep_target, d, [[1, 2, 3, 4, 5], [6, 7, 8]], max_new_tokens=24, k=3)
    per, chain, dec = out["per_position"], out["chain"], out["decoded"]
    assert len(per) == len(chain) == len(dec) == 3
    assert chain[0] == per[0] and all(c <= p for c, p in zip(chain, per))
    assert all(a >= b for a, b in zip(chain, chain[1:])) and all(a >= b for a, b in zip(dec, dec[1:]))


def test_the_chain_count_is_the_anchors_whose_every_step_so_far_matched(deep_target):
    """TTTResult.chain[s]: anchors whose steps 0..s all match, recomputed here from the step
    logits; at most the per-step count, falling with depth. The labels are made to be step 0's own
    drafts (a crafted final hidden state), so step 0 always matches and later steps sometimes do."""
    d = Eagle3Drafter.tiny(deep_target, layer_ids=default_layer_ids(8), draft_vocab_size=deep_target.vocab_size)
    seq = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16])
    with torch.no_grad():
        out = deep_target.model(seq[None], output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i][0] for i in d.model.spec.layer_ids], -1)
    V, T = deep_target.vocab_size, seq.numel()
    head = torch.eye(V)  # labels: the argmax of each final row
    anchors = torch.arange(0, T - 4)
    probe = ttt_loss(d.model, deep_target.embed_tokens, head, d.model.t2d,
                     FeatureSeq(seq, 0, feats, torch.zeros(T, V)), torch.arange(0, T - 2), steps=1)
    final = torch.zeros(T, V)
    final[torch.arange(1, T - 1), probe.logits[0].argmax(-1)] = 1.0  # the label at p: step 0's draft at anchor p-1
    r = ttt_loss(d.model, deep_target.embed_tokens, head, d.model.t2d, FeatureSeq(seq, 0, feats, final), anchors,
                 steps=3)
    labels = [final[anchors + s + 1].argmax(-1) for s in range(3)]
    match = torch.stack([r.logits[s].argmax(-1) == labels[s] for s in range(3)], 1)
    assert r.chain[0] == r.correct[0] == anchors.numel()
    assert r.chain == match.long().cumprod(1).sum(0).tolist()
    assert all(c <= k for c, k in zip(r.chain, r.correct)) and r.chain[1] < r.chain[0]

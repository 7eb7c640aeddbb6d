"""DFlash 2: the convolution and the selector as vLLM's qwen3_dflash2.py computes them, the walk,
training blocks equal to the drafter's block pass, the z-lab DFlash2DraftModel layout field by
field (and a plain DFlash file still DFlash), and the recipe end to end on a tiny target.
The conformance suite runs the drafter through tests/test_conformance.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from specdec.drafters.dflash.checkpoint import checkpoint_family, config_from_dict, load_block_draft, save_block_draft
from specdec.drafters.dflash.drafter import DFlashDrafter
from specdec.drafters.dflash.model import BlockDraftModel, BlockLayer
from specdec.drafters.dflash2.drafter import DFlash2Drafter, walk
from specdec.drafters.dflash2.model import DFlash2Config, DFlash2Layer, DFlash2Model, GroupedDynamicConv, block_links
from specdec.sampling import RowSampling, SamplingParams
from specdec.target import Target
from specdec.types import Committed

GREEDY = RowSampling([SamplingParams()])

# the z-lab DFlash 2 fixture's config (z-lab/dflash's dflash2-config.json), its sliding
# layers left out: what this loader must read from each field
ZLAB_DFLASH2 = {
    "architectures": ["DFlash2DraftModel"], "is_causal": False, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 6656, "intermediate_size": 19968, "max_position_embeddings": 131072, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 52,
    "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "tie_word_embeddings": False, "vocab_size": 202048,
    "dflash_config": {"block_size": 16, "conv_group_size": 16, "conv_kernel_size": 2, "final_logit_softcapping": 20.0,
                      "mask_token_id": 201818, "output_multiplier": 0.19611613513818404, "selector_rank": 256,
                      "selector_top_k": 16, "target_layer_ids": [1, 13, 25, 37, 49]}}


def _committed(target: Target, hidden_ids, prefix: list[int], new: list[int], nxt: int) -> Committed:
    with torch.no_grad():
        out = target.model(torch.tensor([prefix + new]), output_hidden_states=True)
    P, n = len(prefix), len(new)
    return Committed(tokens=torch.tensor([new]), num_tokens=torch.tensor([n]), positions=(P + torch.arange(n))[None],
                     next_tokens=torch.tensor([nxt]), active=torch.ones(1, dtype=torch.bool),
                     hidden={i: out.hidden_states[i][:, P:P + n] for i in hidden_ids})


def _vllm_grouped_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block: int, groups: int,
                       taps: int) -> torch.Tensor:
    """vLLM's _grouped_conv written out per element: rows flattened [N, D], blocks of ``block`` rows."""
    N, D = x.shape
    gs = D // groups
    out = torch.zeros_like(x)
    for i in range(N):
        for t in range(taps):
            if i % block < t:
                continue
            coef = base[t] + delta[i, t].repeat_interleave(gs)
            out[i] += coef * x[i - t]
    return out


def test_convolution_is_vllms_within_each_block():
    torch.manual_seed(0)
    D, taps, gs, b, nblocks = 16, 3, 4, 5, 2
    conv = GroupedDynamicConv(D, taps, gs)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(1, nblocks * b, D)
    q_block = torch.arange(nblocks * b) // b
    own = (q_block[:, None] == q_block[None, :])[None]  # blocks side by side, as in training
    mask = torch.cat([torch.ones(1, nblocks * b, 3, dtype=torch.bool), own], -1)
    links = block_links(mask, taps)
    with torch.no_grad():
        got, coef = conv.prepare(x, links)
        delta = conv.kernel_projection(x[0]).view(-1, 2, taps, D // gs)
        want = _vllm_grouped_conv(x[0], delta[:, 0], conv.base_kernel[0], b, D // gs, taps)
        torch.testing.assert_close(got[0], want)
        y = torch.randn_like(x)
        want_finish = _vllm_grouped_conv(y[0], delta[:, 1], conv.base_kernel[1], b, D // gs, taps)
        torch.testing.assert_close(conv.finish(y, coef, links)[0], want_finish)


def test_identity_convolutions_leave_dflashs_layer(target):
    """Base kernels at the identity and zero projections: DFlash 2's layer is DFlash's exactly."""
    d = DFlash2Drafter.tiny(target)
    layer: DFlash2Layer = d.model.layers[0]
    with torch.no_grad():
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.kernel_projection.weight.zero_()
            conv.base_kernel.zero_()
            conv.base_kernel[:, 0] = 1.0
    plain = BlockLayer(d.cfg, d.cfg.layer_config())
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if "_conv." not in k})
    D, G, h = d.cfg.hidden_size, d.cfg.num_key_value_heads, d.cfg.head_dim
    x, k, v = torch.randn(2, 4, D), torch.randn(2, G, 3, h), torch.randn(2, G, 3, h)
    cos, sin = d.model.rope(x, torch.arange(3, 7).expand(2, 4))
    mask = torch.ones(2, 4, 7, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, k, v, cos, sin, mask), plain(x, k, v, cos, sin, mask))
        conv = layer.attention_conv
        conv.kernel_projection.weight.normal_()  # a live convolution: position 0 unchanged, the others differ
        y, ref = layer(x, k, v, cos, sin, mask), plain(x, k, v, cos, sin, mask)
    assert not torch.allclose(y[:, 1:], ref[:, 1:])


def test_edge_scores_are_unary_plus_the_low_rank_bilinear_term(target):
    d = DFlash2Drafter.tiny(target)
    sel = d.model.candidate_selector
    B, L, K, D = 2, 3, 4, d.cfg.hidden_size
    cand = torch.randint(0, target.vocab_size, (B, L, K))
    unary, hidden, anchors = torch.randn(B, L, K), torch.randn(B, L, D), torch.tensor([5, 9])
    with torch.no_grad():
        s = sel.edge_scores(cand, unary, hidden, anchors)
        z = sel.hidden_projection(hidden)
        for b in range(B):
            for j in range(L):
                for p in range(K):
                    prev = anchors[b] if j == 0 else cand[b, j - 1, p]
                    for c in range(K):
                        want = unary[b, j, c] + (sel.predecessor_codebook[prev] * z[b, j]
                                                 * sel.successor_codebook[cand[b, j, c]]).sum()
                        torch.testing.assert_close(s[b, j, p, c], want, atol=1e-5, rtol=1e-5)
        # teacher-forced scores (training) are the rows of the true predecessors
        prev = torch.cat([anchors[:, None], cand[:, :-1, 1]], 1)
        tf = sel.scores(prev, hidden, cand, unary)
    torch.testing.assert_close(tf[:, 0], s[:, 0, 0])
    torch.testing.assert_close(tf[:, 1:], s[:, 1:, 1])


def test_greedy_walk_follows_the_best_edge_from_each_pick():
    scores = torch.full((1, 3, 3, 3), -1.0)
    scores[0, 0, :, 2] = 5.0  # slot 0: candidate 2 (from the anchor)
    scores[0, 1, 2, 0] = 4.0  # from candidate 2: candidate 0, though candidate 1 wins from the others
    scores[0, 1, :2, 1] = 9.0
    scores[0, 2, 0, 1] = 3.0
    scores[0, 2, 0, 2] = 3.0  # a tie: the first candidate
    cand = torch.tensor([[[10, 11, 12], [20, 21, 22], [30, 31, 32]]])
    tokens, q = walk(scores, cand, None, None)
    assert tokens.tolist() == [[12, 20, 31]] and q is None


def test_sampled_walk_q_is_the_tempered_softmax_over_the_candidates(target):
    d = DFlash2Drafter.tiny(target)
    prompt = [3, 5, 7, 11, 2]
    rows = RowSampling([SamplingParams(temperature=0.8, top_k=3, seed=1), SamplingParams(temperature=0.0)])
    committed = _committed(target, d.hidden_ids, [], prompt, 9)
    two = Committed(committed.tokens.repeat(2, 1), committed.num_tokens.repeat(2), committed.positions.repeat(2, 1),
                    committed.next_tokens.repeat(2), committed.active.repeat(2),
                    {i: h.repeat(2, 1, 1) for i, h in committed.hidden.items()})
    state = d.start(two, rows)
    prop = d.propose(state, 4, rows)
    assert prop.q is not None
    # the same block again, scored by hand
    hidden = d.block_hidden(d.start(two, rows), 5)[:, 1:]
    values, cand = target.logits(hidden).topk(d.cfg.selector_top_k, dim=-1)
    scores = d.model.candidate_selector.edge_scores(cand, d.model.unary(values), hidden, state.anchors)
    prev = torch.zeros(2, dtype=torch.long)
    for j in range(4):
        s = scores[torch.arange(2), j, prev]  # [2, K]
        q0 = torch.softmax(s[0] / 0.8, -1)  # temperature only: the request's top-k shapes the target's side
        torch.testing.assert_close(prop.q[0, j, cand[0, j]], q0)
        assert prop.q[0, j].sum().item() == pytest.approx(1.0, abs=1e-5)
        assert prop.q[1, j, cand[1, j, s[1].argmax()]] == 1.0  # a greedy row among sampled ones: one-hot
        outside = torch.ones(target.vocab_size, dtype=torch.bool)
        outside[cand[0, j]] = False
        assert prop.q[0, j][outside].abs().sum() == 0  # zero outside the candidates
        prev = (cand[torch.arange(2), j] == prop.tokens[:, j, None]).float().argmax(-1)


def test_training_forward_equals_the_drafters_block_pass(target):
    """Training blocks side by side (their convolutions never cross a block) compute exactly what
    the drafter computes from the committed prefix before each anchor."""
    from specdec.drafters.dflash.train import BlockBatch, block_forward

    d = DFlash2Drafter.tiny(target)
    tokens = [3, 5, 7, 11, 2, 9, 1, 4, 6, 8, 10, 12]
    T = len(tokens)
    with torch.no_grad():
        hs = target.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i] for i in d.hidden_ids], -1)
    batch = BlockBatch(torch.tensor([tokens]), feats, torch.zeros(1, T, d.cfg.hidden_size), torch.tensor([T]),
                       torch.tensor([0]))
    anchors = torch.tensor([[2, 5, 7]])  # 5 and 7 closer than a block: positions overlap, blocks must not
    with torch.no_grad():
        hidden, _ = block_forward(d.model, target.embed_tokens, batch, anchors, torch.ones(1, 3, dtype=torch.bool))
        for i, a in enumerate(anchors[0].tolist()):
            state = d.start(_committed(target, d.hidden_ids, [], tokens[:a], tokens[a]), GREEDY)
            torch.testing.assert_close(hidden[:, i], d.block_hidden(state, d.cfg.block_size), atol=1e-5, rtol=1e-5)


# --- the checkpoint layout ------------------------------------------------------------------------

def test_reads_every_field_of_a_zlab_dflash2_config():
    cfg = config_from_dict(ZLAB_DFLASH2)
    assert isinstance(cfg, DFlash2Config)
    assert checkpoint_family(ZLAB_DFLASH2) == ("dflash2", "architectures: ['DFlash2DraftModel']")
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (2, 16, 256, 16)
    assert cfg.output_multiplier == pytest.approx(0.19611613513818404) and cfg.final_logit_softcapping == 20.0
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (16, 201818, [1, 13, 25, 37, 49])
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_target_layers, cfg.head_dim) == (6656, 5, 52, 128)
    for key in ("conv_kernel_size", "selector_top_k"):  # vLLM indexes these without a default
        dc = {k: v for k, v in ZLAB_DFLASH2["dflash_config"].items() if k != key}
        with pytest.raises(ValueError, match=f"dflash_config.{key}"):
            config_from_dict({**ZLAB_DFLASH2, "dflash_config": dc})


def test_a_plain_dflash_config_resolves_as_before():
    dc = {k: ZLAB_DFLASH2["dflash_config"][k] for k in ("block_size", "mask_token_id", "target_layer_ids")}
    plain = {**ZLAB_DFLASH2, "architectures": ["DFlashDraftModel"], "dflash_config": dc}
    assert checkpoint_family(plain) == ("dflash", "architectures: ['DFlashDraftModel']")
    assert type(config_from_dict(plain)).__name__ == "BlockDraftConfig"
    assert checkpoint_family({**plain, "architectures": None})[0] == "dflash"
    # no architectures, DFlash 2's fields: DFlash 2; the multiplier stays refused for DFlash
    assert checkpoint_family({**ZLAB_DFLASH2, "architectures": None}) == ("dflash2", "dflash_config.selector_rank")
    with pytest.raises(ValueError, match="output_multiplier"):
        config_from_dict({**plain, "dflash_config": {**dc, "output_multiplier": 0.5}})


def test_export_round_trips_with_zlabs_names_and_shapes(target, tmp_path):
    d = DFlash2Drafter.tiny(target)
    d.model.cfg.output_multiplier, d.model.cfg.final_logit_softcapping = 0.5, 7.0
    folder = save_block_draft(d.model, tmp_path / "ckpt", dtype=torch.float32)
    c = json.loads((folder / "config.json").read_text())
    cfg = d.cfg
    assert c["architectures"] == ["DFlash2DraftModel"]
    assert c["dflash_config"] == {"block_size": cfg.block_size, "conv_group_size": 8, "conv_kernel_size": 2,
                                  "mask_token_id": cfg.mask_token_id, "output_multiplier": 0.5, "selector_rank": 4,
                                  "selector_top_k": 8, "target_layer_ids": cfg.target_layer_ids,
                                  "final_logit_softcapping": 7.0}
    D, V, G = cfg.hidden_size, cfg.vocab_size, cfg.hidden_size // 8
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    new = {k: v for k, v in shapes.items() if "conv" in k or k.startswith("candidate_selector")}
    assert new == {"layers.0.attention_conv.base_kernel": (2, 2, D),
                   "layers.0.attention_conv.kernel_projection.weight": (2 * 2 * G, D),
                   "layers.0.mlp_conv.base_kernel": (2, 2, D), "layers.0.mlp_conv.kernel_projection.weight": (2 * 2 * G, D),
                   "candidate_selector.hidden_projection.weight": (4, D),
                   "candidate_selector.predecessor_codebook": (V, 4), "candidate_selector.successor_codebook": (V, 4)}
    plain = save_block_draft(DFlashDrafter.tiny(target).model, tmp_path / "plain", dtype=torch.float32)
    with safe_open(str(plain / "model.safetensors"), framework="pt") as f:
        assert set(shapes) - set(f.keys()) == set(new)  # the rest: DFlash's names
    loaded = load_block_draft(folder)
    assert type(loaded) is DFlash2Model and loaded.cfg == d.cfg
    for k, v in d.model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)
    again = DFlash2Drafter.create(target, checkpoint=str(folder))
    rows = RowSampling([SamplingParams(temperature=1.0, seed=3)])
    c1 = _committed(target, d.hidden_ids, [], [3, 5, 7], 2)
    p1, p2 = d.propose(d.start(c1, rows), 4, rows), again.propose(again.start(c1, RowSampling([SamplingParams(
        temperature=1.0, seed=3)])), 4, RowSampling([SamplingParams(temperature=1.0, seed=3)]))
    assert p1.q is not None and p2.q is not None
    torch.testing.assert_close(p1.q, p2.q)
    with pytest.raises(ValueError, match="speculators"):
        save_block_draft(d.model, tmp_path / "spec", layout="speculators")


def test_each_drafter_refuses_the_others_checkpoint(target, tmp_path):
    two = save_block_draft(DFlash2Drafter.tiny(target).model, tmp_path / "two", dtype=torch.float32)
    one = save_block_draft(DFlashDrafter.tiny(target).model, tmp_path / "one", dtype=torch.float32)
    with pytest.raises(ValueError, match="dflash2 checkpoint.*DFlash2DraftModel"):
        DFlashDrafter.create(target, checkpoint=str(two))
    with pytest.raises(ValueError, match="dflash checkpoint"):
        DFlash2Drafter.create(target, checkpoint=str(one))
    with pytest.raises(ValueError, match="DFlash 2 model"):
        DFlash2Drafter(BlockDraftModel(DFlashDrafter.tiny(target).cfg))
    with pytest.raises(ValueError, match="conv_group_size"):
        DFlash2Drafter.tiny(target, conv_group_size=5)


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_loss_trains_the_selector_and_the_convolutions(target, loss):
    """The recipe's loss reaches every new weight, and a few steps on one batch lower the selector's term."""
    from specdec.drafters.dflash.train import BlockBatch
    from specdec.drafters.dflash2.train import dflash2_loss

    torch.manual_seed(0)
    m = DFlash2Drafter.tiny(target, init_std=0.05).model.train()
    for layer in m.layers:  # as the recipe builds it: the convolutions start at the identity
        with torch.no_grad():
            layer.attention_conv.kernel_projection.weight.zero_()
            layer.mlp_conv.kernel_projection.weight.zero_()
    tokens = torch.randint(0, target.vocab_size, (2, 16))
    with torch.no_grad():
        out = target.model(tokens, output_hidden_states=True)
    hidden_ids = [i + 1 for i in m.cfg.target_layer_ids]
    feats = torch.cat([out.hidden_states[i] for i in hidden_ids], -1)
    batch = BlockBatch(tokens, feats, out.hidden_states[-1], torch.tensor([16, 16]), torch.tensor([0, 0]))
    head = target.lm_head.weight.detach().float()
    anchors, keep = torch.tensor([[1, 4, 8, 10], [0, 3, 6, 9]]), torch.ones(2, 4, dtype=torch.bool)

    def step() -> tuple[torch.Tensor, dict]:
        res = dflash2_loss(m, target.embed_tokens, head, batch, anchors, keep, kl=loss == "kl")
        return res.loss, res.metrics

    first, metrics = step()
    assert torch.isfinite(first) and len(metrics["accept"]) == m.cfg.num_drafts
    first.backward()
    for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.kernel_projection.weight",
                 "layers.0.mlp_conv.base_kernel", "fc.weight"):
        grad = dict(m.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(20):
        opt.zero_grad()
        value, _ = step()
        value.backward()
        opt.step()
    assert step()[1]["selector"] < 0.8 * metrics["selector"]


def test_a_draft_vocabulary_smaller_than_k_keeps_every_draft_inside_it(target):
    token_map = (5, 0, 17, 3, 30, 9, 12, 1)
    d = DFlash2Drafter.tiny(target, token_map=token_map, draft_vocab=6)  # 6 ids, K = 8: K shrinks to 6
    rows = RowSampling([SamplingParams(temperature=1.0, seed=0)])
    state = d.start(_committed(target, d.hidden_ids, [], [3, 5, 7, 11], 2), rows)
    allowed = torch.zeros(target.vocab_size, dtype=torch.bool)
    allowed[list(token_map[:6])] = True
    for _ in range(5):
        prop = d.propose(state, 4, rows)
        assert prop.q is not None and allowed[prop.tokens].all()
        assert prop.q[..., ~allowed].abs().sum() == 0
        torch.testing.assert_close(prop.q.sum(-1), torch.ones(1, 4))
    greedy = d.propose(state, 4, GREEDY)
    assert greedy.q is None and allowed[greedy.tokens].all()

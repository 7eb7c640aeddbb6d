"""DFlash: layer ids, the block forward, the context cache, checkpoint layouts, training masks, and a
cross-check against transformers' own DFlash candidate generator on the same random weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F_
from safetensors.torch import save_file

from specdec.drafters.dflash.drafter import DFlashDrafter
from specdec.drafters.dflash.peer import to_transformers
from specdec.drafters.dflash.checkpoint import config_from_dict, load_block_draft, save_block_draft
from specdec.drafters.dflash.model import BlockDraftModel, build_target_layer_ids
from specdec.sampling import RowSampling, SamplingParams
from specdec.target import Target, layer_output_ids
from specdec.testing.tiny import tiny_model
from specdec.types import Committed


def _committed(target: Target, drafter, prefix: list[int], new: list[int], nxt: int) -> Committed:
    """Committed for tokens ``new`` following ``prefix``, with the HF hidden states at them."""
    with torch.no_grad():
        out = target.model(torch.tensor([prefix + new]), output_hidden_states=True)
    P, n = len(prefix), len(new)
    hidden = {i: out.hidden_states[i][:, P:P + n] for i in drafter.hidden_ids}
    return Committed(tokens=torch.tensor([new]), num_tokens=torch.tensor([n]), positions=(P + torch.arange(n))[None],
                     next_tokens=torch.tensor([nxt]), active=torch.ones(1, dtype=torch.bool), hidden=hidden)


GREEDY = RowSampling([SamplingParams()])


def test_default_layer_ids_follow_dflash():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(30, 3) == [1, 14, 27]
    assert build_target_layer_ids(36, 1) == [18]
    ids = build_target_layer_ids(2, 2)  # tiny targets: clamped, still increasing and in range
    assert ids == sorted(set(ids)) and all(0 <= i < 2 for i in ids)


def test_layer_output_ids_read_the_next_layers_input(target):
    d = DFlashDrafter.tiny(target)
    assert d.requirements().layer_inputs == tuple(i + 1 for i in d.cfg.target_layer_ids)
    session = target.new_session(1)
    with target.capturing(d.requirements()):
        out, _, _ = target.prefill(session, [[1, 2, 3, 4]])
    with torch.no_grad():
        ref = target.model(torch.tensor([[1, 2, 3, 4]]), output_hidden_states=True).hidden_states
    for i in d.cfg.target_layer_ids:  # "output of layer i" is HF hidden_states[i + 1]
        torch.testing.assert_close(out.hidden[layer_output_ids([i])[0]], ref[i + 1])


def test_block_attention_is_non_causal_and_reads_only_the_context(target):
    d = DFlashDrafter.tiny(target)
    m, cfg = d.model, d.cfg
    ctx = torch.randn(1, 6, cfg.hidden_size)
    kv = m.context_kv(ctx, torch.arange(6)[None])
    block = torch.randn(1, 4, cfg.hidden_size)
    pos = torch.arange(6, 10)[None]
    mask = torch.ones(1, 4, 10, dtype=torch.bool)
    with torch.no_grad():
        h = m(block, pos, kv, mask)
        changed = block.clone()
        changed[:, 3] += 1.0
        h2 = m(changed, pos, kv, mask)
        masked = mask.clone()
        masked[..., 4] = False  # hide one context slot: every position changes
        h3 = m(block, pos, kv, masked)
    assert not torch.allclose(h[:, 0], h2[:, 0])  # position 0 sees position 3: non-causal
    assert not torch.allclose(h[:, 0], h3[:, 0])


def test_context_cache_extended_over_steps_equals_a_fresh_start(target):
    d = DFlashDrafter.tiny(target)
    prompt, nxt = [3, 5, 7, 11, 2], 9
    state = d.start(_committed(target, d, [], prompt, nxt), GREEDY)
    seq = list(prompt)
    for accepted in (0, 3, 1, 2):  # a few steps; the drafts are "accepted" arbitrarily
        drafts = d.propose(state, 4, GREEDY).tokens[0].tolist()
        new = [nxt] + drafts[:accepted]
        nxt = (drafts[accepted] + 1) % target.vocab_size if accepted < 4 else 4
        d.observe(state, _committed(target, d, seq, new, nxt))
        seq += new
    with torch.no_grad():
        h_stateful = d.block_hidden(state, 5)
        fresh = d.start(_committed(target, d, [], seq, nxt), GREEDY)
        h_fresh = d.block_hidden(fresh, 5)
    torch.testing.assert_close(h_stateful, h_fresh, atol=1e-5, rtol=1e-5)


def test_same_drafts_as_transformers_dflash_candidate_generator(target):
    """transformers' DFlash generator (its DFlash draft model, same weights) drafts what we draft,
    over two steps: the second reads a context extended by accepted tokens and its crop."""
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    d = DFlashDrafter.tiny(target, seed=3, init_std=0.5)
    gen = DFlashTokenCandidateGenerator(to_transformers(d), target.embed_tokens, target.lm_head,
                                        GenerationConfig(do_sample=False, max_length=256))
    b, prompt = d.cfg.block_size, [3, 5, 7, 11, 2, 9, 1]
    P = len(prompt)

    def hf_step(ids: list[int], hidden_states, accepted: int):
        x = torch.tensor([ids])
        kw = {"position_ids": torch.arange(x.shape[1])[None], "attention_mask": torch.ones_like(x)}
        out = type("Out", (), {"hidden_states": hidden_states})()
        cand, logits = gen.get_candidates(x, kw, out, False, accepted)
        return cand[0, x.shape[1]:].tolist(), logits[0]

    with torch.no_grad():
        out = target.model(torch.tensor([prompt]), output_hidden_states=True)
    nxt = int(out.logits[0, -1].argmax())
    hf_drafts, hf_logits = hf_step(prompt + [nxt], out.hidden_states, 0)
    state = d.start(_committed(target, d, [], prompt, nxt), GREEDY)
    prop = d.propose(state, b - 1, GREEDY)
    assert prop.tokens[0].tolist() == hf_drafts
    with torch.no_grad():
        ours = target.logits(d.block_hidden(state, b)[:, 1:])[0]
    torch.testing.assert_close(ours, hf_logits.float(), atol=1e-4, rtol=1e-4)

    block, accepted, new_next = [nxt] + hf_drafts, 2, 4
    with torch.no_grad():
        out2 = target.model(torch.tensor([prompt + block]), output_hidden_states=True)
    hs = tuple(h[:, P:] for h in out2.hidden_states)  # what the target's verify pass hands over
    hf_drafts2, hf_logits2 = hf_step(prompt + block[: accepted + 1] + [new_next], hs, accepted)
    d.observe(state, _committed(target, d, prompt, block[: accepted + 1], new_next))
    with torch.no_grad():
        ours2 = target.logits(d.block_hidden(state, b)[:, 1:])[0]
    assert d.propose(state, b - 1, GREEDY).tokens[0].tolist() == hf_drafts2
    torch.testing.assert_close(ours2, hf_logits2.float(), atol=1e-4, rtol=1e-4)


def _write(folder: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def _arch(cfg) -> dict:
    return {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": 10000.0, "max_position_embeddings": 512}


def _same(a: BlockDraftModel, b: BlockDraftModel) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k].float(), sb[k].float())


def test_reads_zlab_and_speculators_layouts_and_round_trips(target, tmp_path):
    d = DFlashDrafter.tiny(target)
    cfg, weights = d.cfg, d.model.state_dict()
    extra = {"embed_tokens.weight": torch.zeros(cfg.vocab_size, cfg.hidden_size)}  # skipped: the target's is used
    zlab = _write(tmp_path / "zlab", {"architectures": ["DFlashDraftModel"], **_arch(cfg), "block_size": cfg.block_size,
                                      "num_target_layers": target.num_layers,
                                      "dflash_config": {"mask_token_id": cfg.mask_token_id,
                                                        "target_layer_ids": cfg.target_layer_ids}},
                  {**weights, **extra})
    spec = _write(tmp_path / "spec", {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
                                      "transformer_layer_config": {"model_type": "qwen3", **_arch(cfg)},
                                      "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
                                      "block_size": cfg.block_size,
                                      "mask_token_id": cfg.mask_token_id, "draft_vocab_size": cfg.vocab_size},
                  {**weights, "verifier_lm_head.weight": torch.zeros(cfg.vocab_size, cfg.hidden_size)})
    for folder in (zlab, spec):
        loaded = load_block_draft(folder)
        assert type(loaded) is BlockDraftModel and loaded.cfg.target_layer_ids == cfg.target_layer_ids
        _same(loaded, d.model)
        DFlashDrafter.create(target, checkpoint=str(folder))  # binds
    # a speculators DFlash file whose anchor drafts is a DSpark backbone without heads (DSpark registers it)
    anchored = _write(tmp_path / "spec_anchor", {**json.loads((spec / "config.json").read_text()),
                                                 "sample_from_anchor": True}, weights)
    loaded = load_block_draft(anchored)
    assert loaded.cfg.anchor_predicts and loaded.cfg.markov_rank == 0 and not loaded.cfg.enable_confidence_head
    _same(loaded, d.model)
    saved = save_block_draft(d.model, tmp_path / "ours", dtype=torch.float32)
    assert json.loads((saved / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    _same(load_block_draft(saved), d.model)


def test_bad_inputs_raise(target, tmp_path):
    d = DFlashDrafter.tiny(target)
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashDrafter.tiny(target, mask_token_id=target.vocab_size)
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashDrafter.tiny(target, target_layer_ids=[0, 5])
    with pytest.raises(ValueError, match="hidden size"):
        DFlashDrafter(BlockDraftModel(d.cfg.__class__(**{**d.cfg.to_dict(), "hidden_size": 16}))).bind(target)
    with pytest.raises(ValueError, match="checkpoint"):
        DFlashDrafter.create(target, checkpoint=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="draft_vocab_size 0 outside"):
        config_from_dict({"speculators_model_type": "dflash", "transformer_layer_config": {**_arch(d.cfg)},
                          "aux_hidden_state_layer_ids": [0], "block_size": 4, "mask_token_id": 1, "draft_vocab_size": 0})
    with pytest.raises(ValueError, match="not a DFlash"):
        config_from_dict({"architectures": ["LlamaForCausalLM"]})


def test_training_blocks_see_only_context_before_their_anchor(target):
    from specdec.drafters.dflash.train import BlockBatch, block_loss

    d = DFlashDrafter.tiny(target)
    cfg, T = d.cfg, 12
    F = len(cfg.target_layer_ids) * cfg.hidden_size
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.vocab_size - 1, (1, T), generator=gen)
    feats = torch.randn(1, T, F, generator=gen)
    batch = BlockBatch(tokens, feats, torch.zeros(1, T, cfg.hidden_size), torch.tensor([T]), torch.tensor([2]))
    embed, head = target.embed_tokens, target.lm_head.weight
    anchors, keep = torch.tensor([[4]]), torch.ones(1, 1, dtype=torch.bool)
    with torch.no_grad():
        base = block_loss(d.model, embed, head, batch, anchors, keep).loss
        later = feats.clone()
        later[:, 4:] += 5.0  # features at and after the anchor: invisible to its block
        same = block_loss(d.model, embed, head, BlockBatch(tokens, later, batch.final_hidden, batch.lengths,
                                                           batch.response_start), anchors, keep).loss
        earlier = feats.clone()
        earlier[:, 3] += 5.0
        moved = block_loss(d.model, embed, head, BlockBatch(tokens, earlier, batch.final_hidden, batch.lengths,
                                                            batch.response_start), anchors, keep).loss
    torch.testing.assert_close(base, same)
    assert not torch.allclose(base, moved)


def test_kl_loss_learns_the_targets_own_distribution_where_each_draft_is_verified(target):
    """``kl``: block position j of the block at anchor a learns softmax(lm_head(final[a + j − 1])),
    the target's distribution of x_{a+j}, whatever token the sequence holds there; weighted as CE is."""
    from specdec.drafters.dflash.train import BlockBatch, DFlashOptions, block_loss, block_predictions

    d = DFlashDrafter.tiny(target)
    cfg, T = d.cfg, 14
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, target.vocab_size - 1, (1, T), generator=gen)
    feats = torch.randn(1, T, len(cfg.target_layer_ids) * cfg.hidden_size, generator=gen)
    final = torch.randn(1, T, cfg.hidden_size, generator=gen)
    batch = BlockBatch(tokens, feats, final, torch.tensor([T]), torch.tensor([2]))
    embed, head = target.embed_tokens, target.lm_head.weight
    anchors, keep = torch.tensor([[3, 9]]), torch.ones(1, 2, dtype=torch.bool)
    with torch.no_grad():
        out = block_loss(d.model, embed, head, batch, anchors, keep, kl=True)
        p = block_predictions(d.model, embed, head, batch, anchors, keep)
        other = tokens.clone()
        labels_only = torch.tensor([4, 5, 6, 7, 8, 10, 11, 12, 13])  # not the anchors (the blocks' inputs)
        other[0, labels_only] = (other[0, labels_only] + 1) % (target.vocab_size - 1)  # same target distributions
        again = block_loss(d.model, embed, head, BlockBatch(other, feats, final, batch.lengths, batch.response_start),
                           anchors, keep, kl=True)
    num = den = 0.0
    for i, a in enumerate(anchors[0].tolist()):
        for j in range(1, cfg.block_size):
            if a + j >= T:
                continue
            p_t = F_.linear(final[0, a + j - 1], head).detach().softmax(-1)
            q = p.logits[0, i, j - 1].log_softmax(-1)
            w = float(p.weight[0, i, j - 1])
            num, den = num + w * float((p_t * (p_t.log() - q)).sum()), den + w
    assert float(out.loss) == pytest.approx(num / den, rel=1e-4)
    torch.testing.assert_close(again.loss, out.loss)
    assert float(out.metrics["kl"]) == pytest.approx(float(out.loss))
    with pytest.raises(ValueError, match="loss must be"):
        DFlashOptions(loss="l2")


@pytest.mark.parametrize("group", [0, 2], ids=["one-forward", "groups-of-2"])
def test_training_forward_equals_the_drafters_block_pass(target, group):
    """Each training block computes exactly what the drafter computes at inference from the
    committed prefix before its anchor, its blocks in one forward or in groups (2, then 1)."""
    from specdec.drafters.dflash.train import BlockBatch, block_forward

    d = DFlashDrafter.tiny(target)
    tokens = [3, 5, 7, 11, 2, 9, 1, 4, 6, 8, 10, 12]
    T = len(tokens)
    with torch.no_grad():
        hs = target.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i] for i in d.hidden_ids], -1)
    batch = BlockBatch(torch.tensor([tokens]), feats, torch.zeros(1, T, d.cfg.hidden_size), torch.tensor([T]),
                       torch.tensor([0]))
    anchors = torch.tensor([[2, 5, 7]])
    with torch.no_grad():
        hidden, _ = block_forward(d.model, target.embed_tokens, batch, anchors, torch.ones(1, 3, dtype=torch.bool),
                                  group)
        for i, a in enumerate(anchors[0].tolist()):
            state = d.start(_committed(target, d, [], tokens[:a], tokens[a]), GREEDY)
            torch.testing.assert_close(hidden[:, i], d.block_hidden(state, d.cfg.block_size), atol=1e-5, rtol=1e-5)


def test_draft_vocabulary_masks_drafts_and_round_trips(target, tmp_path):
    d = DFlashDrafter.tiny(target)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[[3, 5, 7]] = True
    d.model.set_draft_vocab(t2d)
    rows = RowSampling([SamplingParams(temperature=1.0, seed=0)])
    state = d.start(_committed(target, d, [], [1, 2, 3, 4], 6), rows)
    prop = d.propose(state, 4, rows)
    assert set(prop.tokens[0].tolist()) <= {3, 5, 7}
    assert prop.q is not None and float(prop.q[..., ~t2d].sum()) == 0.0  # q is the masked distribution
    loaded = load_block_draft(save_block_draft(d.model, tmp_path / "v", dtype=torch.float32))
    assert loaded.t2d is not None and torch.equal(loaded.t2d, t2d)
    with pytest.raises(ValueError, match="t2d"):
        d.model.set_draft_vocab(torch.zeros(target.vocab_size, dtype=torch.bool))


def _drafts(d: DFlashDrafter, target: Target) -> tuple[torch.Tensor, torch.Tensor]:
    rows = RowSampling([SamplingParams(temperature=1.0, seed=0)])
    prop = d.propose(d.start(_committed(target, d, [], [1, 2, 3, 4], 6), rows), 3, rows)
    return prop.tokens, prop.q


def test_speculators_layer_ids_index_hidden_states(target, tmp_path):
    """speculators' aux ids are hidden_states indices (z-lab id + 1): the same weights under both
    layouts draft from the same layers, and our speculators export writes them that way."""
    d = DFlashDrafter.tiny(target)
    cfg, weights = d.cfg, d.model.state_dict()
    aux = [i + 1 for i in cfg.target_layer_ids]
    spec = _write(tmp_path / "spec", {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
                                      "transformer_layer_config": {"model_type": "qwen3", **_arch(cfg)},
                                      "aux_hidden_state_layer_ids": aux, "block_size": cfg.block_size,
                                      "mask_token_id": cfg.mask_token_id, "draft_vocab_size": cfg.vocab_size}, weights)
    loaded = DFlashDrafter.create(target, checkpoint=str(spec))
    assert loaded.cfg.target_layer_ids == cfg.target_layer_ids and loaded.hidden_ids == tuple(aux)
    for a, b in zip(_drafts(loaded, target), _drafts(d, target)):
        torch.testing.assert_close(a, b)
    out = save_block_draft(d.model, tmp_path / "ours", dtype=torch.float32, layout="speculators", verifier="tiny")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == aux
    assert config["draft_vocab_size"] == cfg.vocab_size and not config["sample_from_anchor"]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == cfg.block_size - 1
    again = DFlashDrafter.create(target, checkpoint=str(out))
    for a, b in zip(_drafts(again, target), _drafts(d, target)):
        torch.testing.assert_close(a, b)


def test_dflash_refuses_a_dspark_checkpoint(target, tmp_path):
    from specdec.drafters.dspark.drafter import DSparkDrafter

    m = DSparkDrafter.tiny(target).model
    for layout, field in (("native", "Qwen3DSparkModel"), ("speculators", 'speculators_model_type: "dspark"')):
        folder = save_block_draft(m, tmp_path / layout, dtype=torch.float32, layout=layout)
        with pytest.raises(ValueError, match=field):
            DFlashDrafter.create(target, checkpoint=str(folder))
    with pytest.raises(ValueError, match="anchor_predicts"):
        DFlashDrafter(m)


def test_newer_zlab_fields_are_read_or_refused(target, tmp_path):
    d = DFlashDrafter.tiny(target)
    cfg = d.cfg
    base = {"architectures": ["DFlashDraftModel"], **_arch(cfg),
            "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.target_layer_ids,
                              "block_size": 6}}
    assert config_from_dict(base).block_size == 6  # newer files keep block_size inside dflash_config
    neutral = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None,
               "is_causal": False, "layer_types": ["full_attention"] * cfg.num_hidden_layers, "sliding_window": 4}
    assert config_from_dict({**base, **neutral}).block_size == 6
    for key, value in (("input_embedding_scale", 2.0), ("output_multiplier", 0.5), ("final_logit_softcapping", 30.0),
                       ("is_causal", True), ("layer_types", ["sliding_attention"] * cfg.num_hidden_layers)):
        with pytest.raises(ValueError, match=key):
            config_from_dict({**base, key: value})
        with pytest.raises(ValueError, match=f"dflash_config.{key}"):
            config_from_dict({**base, "dflash_config": {**base["dflash_config"], key: value}})
    with pytest.raises(ValueError, match="disagree"):
        config_from_dict({**base, "block_size": 8})


def test_exports_are_what_vllm_reads(target, tmp_path):
    """vLLM's DFlash model reads ``draft_vocab_size`` as the rows of a draft LM head (with a d2t
    map when smaller than the target's vocabulary): z-lab exports with a t2d mask must not write it;
    speculators' write the reduced one with its head rows and d2t, as speculators saves a draft
    vocabulary; z-lab's MLX loader reads ``rope_theta``."""
    d = DFlashDrafter.tiny(target)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[[3, 5, 7]] = True
    d.model.set_draft_vocab(t2d)
    native = json.loads((save_block_draft(d.model, tmp_path / "z", dtype=torch.float32) / "config.json").read_text())
    assert "draft_vocab_size" not in native
    assert native["rope_theta"] == native["rope_parameters"]["rope_theta"]
    spec = json.loads((save_block_draft(d.model, tmp_path / "s", dtype=torch.float32, layout="speculators",
                                        lm_head=target.lm_head.weight) / "config.json").read_text())
    assert spec["draft_vocab_size"] == 3  # speculators' reduced vocabulary: its rows of the head, t2d and d2t
    assert spec["transformer_layer_config"]["rope_theta"] == native["rope_theta"]
    assert torch.equal(load_block_draft(tmp_path / "s").t2d, t2d)

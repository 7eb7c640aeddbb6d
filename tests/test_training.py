"""The one trainer: its schedule, bit-identical resumption, the one data pipeline and held-out rule,
every recipe end to end on tiny targets (two steps, a checkpoint the drafter's own ``create()``
loads), the metadata file, the Hydra configs and entry point, two data-parallel processes (the same
weights as one, resumable bit-identically), and (slow) self-distillation on SmolLM2.

The training-equals-inference checks of each loss live beside their drafters' tests
(``test_eagle3.py``: TTT steps equal chain drafting; ``test_dflash.py``: training blocks equal the
drafter's block pass); the MTP one is here.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from accelerate import PartialState, debug_launcher
from accelerate.state import AcceleratorState
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import specdec
from specdec.drafters import DRAFTERS
from specdec.drafters.mtp.train import PostHocMTPRecipe
from specdec.data.config import DatasetConfig
from specdec.data.datasets import load_dataset
from specdec.loop import Request, run
from specdec.target import Target
from specdec.testing import assert_greedy_equivalent, greedy_reference
from specdec.testing.tiny import tiny_model
from specdec.training import trainer
from specdec.training.config import DataConfig, OptimConfig, TrainConfig
from specdec.data.datasets import HELD_OUT, held_out
from specdec.data.sequences import TokenSeq, load_sequences, save_sequences, self_distill, training_conversations
from specdec.training.data import Batch, load_data, target_features
from specdec.training.recipe import load_recipe
from specdec.data.text import stdlib_files
from specdec.training.trainer import RECORD_FILE, STATE_FILE, TrainingRecord, lr_at, train
from specdec.verifiers import GreedyVerifier

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "experiments" / "conf" / "train"
CHECKPOINTS = ROOT / "experiments" / "checkpoints"
V = 32
TINY_DEEPSEEK = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                     n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
                     kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
# every recipe, small: (registry name, recipe path, options)
RECIPES = {
    "eagle3": ("specdec.drafters.eagle3.train.Eagle3Recipe", dict(layer_ids=[0, 1, 2], draft_vocab=24, anchors=4)),
    "dflash": ("specdec.drafters.dflash.train.DFlashRecipe", dict(layers=1, intermediate=32, features=2, block=4,
                                                                  anchors=4)),
    "dspark": ("specdec.drafters.dspark.train.DSparkRecipe", dict(layers=1, intermediate=32, features=2, block=4,
                                                                  anchors=4, markov_rank=4)),
    "gemma_mtp": ("specdec.drafters.gemma_mtp.train.GemmaMTPRecipe", dict(hidden=16, intermediate=32, anchors=4)),
    "mtp": ("specdec.drafters.mtp.train.PostHocMTPRecipe", dict(depth=2)),
}


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    """A private cache folder (distilled data, features) for the test."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_target() -> Target:
    return Target(tiny_model("llama", vocab_size=V, init_scale=0.3, seed=0))


def random_data(path: Path, n: int = 24, seed: int = 0, length: int | None = None) -> Path:
    """``n`` sequences of random tokens (``length`` each, else 12 to 23) with a 5-token prompt each,
    stored as a data set file."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(12, 24, (n,), generator=g).tolist() if length is None else [length] * n
    save_sequences(path, [TokenSeq(torch.randint(0, V - 1, (t,), generator=g), 5) for t in lengths])
    return path


def tiny_config(tmp_path: Path, name: str, **changes) -> TrainConfig:
    recipe, options = RECIPES[name]
    data = DataConfig(path=str(random_data(tmp_path / "data.safetensors")), held_out_every=4, feature_dtype="float32")
    cfg = dict(recipe=recipe, options=options, out=str(tmp_path / "out"), work=str(tmp_path / "work"), data=data,
               optim=OptimConfig(steps=2, batch=2), log_every=1, progress=False)
    return TrainConfig(**{**cfg, **changes})


# --- the schedule --------------------------------------------------------------------------------

def test_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    steps, peak = 100, 2e-3
    lrs = [lr_at(s, steps, peak, warmup=0.1, floor=0.1) for s in range(steps)]
    assert lrs[:10] == pytest.approx([peak * (s + 1) / 10 for s in range(10)])
    assert lrs[9] == pytest.approx(peak) and lrs[-1] == pytest.approx(0.1 * peak)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # never rises after the warm-up
    mid = 10 + (steps - 1 - 10) / 2  # half way through the cosine: half way down
    assert lr_at(int(mid), steps, peak, 0.1, 0.0) == pytest.approx(peak / 2, rel=0.02)
    assert lr_at(0, 10, 1.0, warmup=0.0, floor=0.0) == 1.0  # no warm-up still starts at the peak


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="recipe"):
        TrainConfig(out="x")
    with pytest.raises(ValueError, match="stop_after"):
        OptimConfig(steps=10, stop_after=11)
    with pytest.raises(ValueError, match="warmup"):
        OptimConfig(warmup=2)
    with pytest.raises(ValueError, match="source"):
        DataConfig(source="web")
    with pytest.raises(ValueError, match="not a Recipe"):
        load_recipe("specdec.training.trainer.TrainResult", {})
    with pytest.raises(TypeError):  # unknown options fail
        load_recipe(RECIPES["eagle3"][0], {"draft_vocabulary": 8})
    with pytest.raises(ValueError, match="profile_step"):
        TrainConfig(recipe="x", out="x", optim=OptimConfig(steps=3), profile_step=4)


# --- data: one pipeline, one held-out rule -------------------------------------------------------------

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


def test_held_out_rule_is_by_item_and_stable_as_the_data_grows(tmp_path, cache):
    names = [f"item-{i}" for i in range(2000)]
    marked = [n for n in names if held_out(n, 20)]
    assert 60 < len(marked) < 140  # about one in 20
    # the standard-library split is the same rule on file names (the tiny DeepSeek-V3's held-out files)
    train, held = stdlib_files("train"), stdlib_files("heldout")
    assert held and not set(train) & set(held) and all(held_out(f.name, 20) for f in held)
    # distilled sequences: held out by their prompt, the same ones whatever else is in the data set
    seqs = load_sequences(random_data(tmp_path / "all.safetensors", n=80))
    save_sequences(tmp_path / "a.safetensors", seqs[:40])
    save_sequences(tmp_path / "b.safetensors", seqs[::-1])  # grown, in another order
    cfg = DataConfig(path=str(tmp_path / "a.safetensors"), held_out_every=4)
    small, grown = load_data(cfg, None), load_data(DataConfig(path=str(tmp_path / "b.safetensors"), held_out_every=4), None)
    key = lambda s: tuple(s.tokens.tolist())  # noqa: E731
    assert small.held and small.train and not {key(s) for s in small.held} & {key(s) for s in small.train}
    assert {key(s) for s in small.held} <= {key(s) for s in grown.held}
    assert {key(s) for s in small.train} <= {key(s) for s in grown.train}
    assert len(load_data(DataConfig(path=cfg.path, held_out_every=4, use=10), None).train) <= 10


def test_batches_are_a_function_of_the_step_and_features_cached_or_not_agree(tiny_target, tmp_path, cache):
    path = random_data(tmp_path / "d.safetensors")
    featurize = lambda tokens: target_features(tiny_target, tokens, (0, 2))  # noqa: E731
    cached = load_data(DataConfig(path=str(path), held_out_every=4, feature_dtype="float32"), tiny_target,
                       featurize, "inputs0_2-final")
    fly = load_data(DataConfig(path=str(path), held_out_every=4, feature_dtype="float32", cache_features=False),
                    tiny_target, featurize, "inputs0_2-final")
    assert list((cache / "features").glob("inputs0_2-final-*.safetensors"))
    n = len(cached.train)
    idx = cached.indices(0, 3 * n, seed=5)
    assert sorted(idx[:n]) == list(range(n)) and sorted(idx[n: 2 * n]) == list(range(n))  # epochs
    assert idx[:n] != idx[n: 2 * n] and cached.indices(n + 2, 4, seed=5) == idx[n + 2: n + 6]
    a, b = cached.batch([cached.train[i] for i in idx[:3]]), fly.batch([fly.train[i] for i in idx[:3]])
    assert torch.equal(a.tokens, b.tokens) and a.num_tokens == int(a.lengths.sum())
    for name in ("features", "final"):
        for r in range(3):  # real positions agree; padding is zero in the cached batch
            m = int(a.lengths[r])
            torch.testing.assert_close(a.features[name][r, :m], b.features[name][r, :m], atol=1e-5, rtol=1e-5)
    hidden, final = tiny_target.features(a.tokens[:1, : int(a.lengths[0])], (0, 2))
    torch.testing.assert_close(a.features["features"][0, : int(a.lengths[0])], torch.cat([hidden[0], hidden[2]], -1)[0])
    # the same settings over data that grew (a corpus folder resumed) key another cache file, not an error
    save_sequences(path, load_sequences(path) + load_sequences(random_data(tmp_path / "more.safetensors", n=8, seed=1)))
    load_data(DataConfig(path=str(path), held_out_every=4, feature_dtype="float32"), tiny_target, featurize,
              "inputs0_2-final")
    assert len(list((cache / "features").glob("inputs0_2-final-*.safetensors"))) == 2


# --- the trainer ---------------------------------------------------------------------------------------

def test_resumed_run_is_bit_identical_to_an_uninterrupted_one(tiny_target, tmp_path, cache):
    """Stopped after 2 of 5 steps and resumed (different folders), with gradient accumulation and
    periodic held-out evaluation: the same weights, to the bit, and the same record of the run."""
    optim = dict(steps=5, batch=2, accumulate=2, lr=5e-3)
    whole = train(tiny_config(tmp_path / "a", "eagle3", optim=OptimConfig(**optim), eval_every=2), target=tiny_target)
    part = tiny_config(tmp_path / "b", "eagle3", optim=OptimConfig(**optim, stop_after=2), eval_every=2)
    first = train(part, target=tiny_target)
    assert (Path(part.work) / STATE_FILE).exists() and first.record.steps == 2
    resumed = train(tiny_config(tmp_path / "b", "eagle3", optim=OptimConfig(**optim), eval_every=2, resume=True),
                    target=tiny_target)
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc.weight"], first.model.state_dict()["fc.weight"])  # the resumed part trained
    ra, rb = whole.record, resumed.record
    assert (ra.steps, ra.tokens, ra.held_out) == (rb.steps, rb.tokens, rb.held_out)
    timeless = lambda log: [{k: v for k, v in e.items() if k != "seconds"} for e in log]  # noqa: E731
    assert timeless(ra.log) == timeless(rb.log) and [e["step"] for e in ra.log if "held_out" in e] == [2, 4, 5]
    assert all(e["seconds"] >= 0 and e["response_tokens"] <= e["tokens"] for e in ra.log if "held_out" in e)
    assert len(rb.parts) == 2 and rb.parts[0]["steps"] == [0, 2] and rb.parts[1]["steps"] == [2, 5]
    # each part's loop time and, inside it, its held-out evaluations' (steps 2 and 4, 5): both evaluated
    assert all(0 < p["eval_seconds"] < p["loop_seconds"] for p in rb.parts) and resumed.part == rb.parts[-1]
    with pytest.raises(ValueError, match="other settings"):
        train(tiny_config(tmp_path / "b", "eagle3", optim=OptimConfig(**{**optim, "lr": 1e-3}), resume=True),
              target=tiny_target)


def test_a_profiled_step_writes_its_operator_table_and_trains_as_any_other(tiny_target, tmp_path, cache):
    """profile_step=2 of 3: the same weights to the bit as the unprofiled run, the step's table
    (the loss's matrix products among its operators) in the work folder, and its wall time
    recorded apart, so a timed loop can leave it out."""
    optim = OptimConfig(steps=3, batch=2, lr=5e-3)
    plain = train(tiny_config(tmp_path / "a", "eagle3", optim=optim), target=tiny_target)
    cfg = tiny_config(tmp_path / "b", "eagle3", optim=optim, profile_step=2)
    profiled = train(cfg, target=tiny_target)
    a, b = plain.model.state_dict(), profiled.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    table = (Path(cfg.work) / "profile-step2.txt").read_text()
    assert table.startswith(f"{cfg.recipe} step 2, batch 2, cpu") and "aten::mm" in table and "Self CPU" in table
    assert 0 < profiled.part["profile_seconds"] < profiled.part["loop_seconds"] and plain.part["profile_seconds"] == 0
    assert not list(Path(plain.record.config["work"]).glob("profile-step*"))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_trains_and_its_checkpoint_loads_in_its_drafter(name, tiny_target, tmp_path, cache):
    cfg = tiny_config(tmp_path, name, optim=OptimConfig(steps=2, batch=2, bf16=name == "eagle3"))
    result = train(cfg, command="python experiments/train.py test", target=tiny_target)
    assert result.record.steps == 2 and result.record.tokens > 0
    assert result.record.held_out["accept"] and result.record.held_out["loss"] > 0
    drafter = DRAFTERS[name].create(tiny_target, checkpoint=cfg.out)
    prompt = [1, 2, 3, 4, 5]
    res = run(tiny_target, drafter, GreedyVerifier(), [Request(prompt, 8)], k=2, eos_token_ids=set())
    ref, logits = greedy_reference(tiny_target.model, prompt, 8)
    assert_greedy_equivalent(res.requests[0].tokens, ref, logits)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_run_starts_from_a_checkpoints_weights_with_init(name, tiny_target, tmp_path, cache):
    """``init=`` reads back what ``save`` wrote: a run from it that does not move (lr 0) saves the same
    weights (block drafters to a bf16 rounding: their feature scale is unfolded and folded again),
    and a fresh run's differ."""
    first = tiny_config(tmp_path / "a", name, optim=OptimConfig(steps=2, batch=2, lr=5e-3))
    train(first, target=tiny_target)
    still = OptimConfig(steps=1, batch=2, lr=0.0)
    again = tiny_config(tmp_path / "b", name, optim=still, init=first.out)
    fresh = tiny_config(tmp_path / "c", name, optim=still, seed=1)
    for cfg in (again, fresh):
        train(cfg, target=tiny_target)
    saved, reread, other = (load_file(str(Path(c.out) / "model.safetensors")) for c in (first, again, fresh))
    assert saved.keys() == reread.keys()
    for k in saved:
        torch.testing.assert_close(reread[k].float(), saved[k].float(), rtol=2 ** -7, atol=0, msg=k)
    assert any(not torch.equal(saved[k], other[k]) for k in saved if saved[k].is_floating_point())


def test_init_refuses_a_folder_without_a_checkpoint_and_one_of_another_shape(tiny_target, tmp_path, cache):
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        train(tiny_config(tmp_path, "eagle3", init=str(tmp_path / "nothing")), target=tiny_target)
    first = tiny_config(tmp_path / "a", "eagle3")
    train(first, target=tiny_target)
    recipe, options = RECIPES["eagle3"]
    wider = tiny_config(tmp_path / "b", "eagle3", options={**options, "draft_vocab": 28}, init=first.out)
    with pytest.raises(ValueError, match="does not fit this run's model"):
        train(wider, target=tiny_target)
    scratch = TrainConfig(recipe="specdec.drafters.mtp.train.JointMTPRecipe", out=str(tmp_path / "c"),
                          target=None, init=first.out)
    with pytest.raises(ValueError, match="cannot start from a checkpoint"):
        train(scratch)


def test_a_model_trained_from_scratch_with_its_mtp_modules_loads_as_a_target(tmp_path, cache):
    cfg = TrainConfig(recipe="specdec.drafters.mtp.train.JointMTPRecipe", options=dict(depth=2, model=TINY_DEEPSEEK),
                      target=None, out=str(tmp_path / "out"), work=str(tmp_path / "work"), eval_sequences=4,
                      data=DataConfig(source="stdlib", window=33, vocab_size=300, max_files=1, use=16),
                      optim=OptimConfig(steps=2, batch=2), progress=False)
    result = train(cfg)
    assert {"main_ce", "main_acc", "accept"} <= set(result.record.held_out)
    target = specdec.load_target(cfg.out)
    assert target.vocab_size == 300 and target.config.num_nextn_predict_layers == 2
    drafter = DRAFTERS["mtp"].create(target)
    prompt = target.tokenizer.encode("def f(x):\n    return")
    res = run(target, drafter, GreedyVerifier(), [Request(prompt, 6)], k=2, eos_token_ids=set())
    ref, logits = greedy_reference(target.model, prompt, 6)
    assert_greedy_equivalent(res.requests[0].tokens, ref, logits)


def test_mtp_training_logits_are_the_drafters(tiny_target):
    """Depth 1 of the MTP loss at the last prompt slot computes the distribution the drafter drew
    its first token from, right after the prefill (sampled at temperature 1, so q is those logits'
    softmax)."""
    from specdec.drafters.mtp.train import mtp_loss
    from specdec.sampling import SamplingParams
    from specdec.testing import Recording
    from specdec.verifiers import RejectionVerifier

    drafter = DRAFTERS["mtp"].tiny(tiny_target, depth=1)
    prompt = [3, 1, 4, 1, 5, 9]
    rec = Recording(drafter)
    run(tiny_target, rec, RejectionVerifier(), [Request(prompt, 2, SamplingParams(temperature=1.0, seed=0))], k=1,
        eos_token_ids=set())
    nxt = int(rec.anchors[0])  # the token the target sampled after the prompt
    tokens = torch.tensor([prompt + [nxt, 0]])
    final = target_features(tiny_target, tokens, ())["final"]
    seen: list[torch.Tensor] = []
    mtp_loss(tokens, final, drafter.modules, tiny_target.embed, lambda h: seen.append(h) or tiny_target.logits(h),
             tiny_target.rotary, torch.ones_like(tokens, dtype=torch.bool))
    logits = tiny_target.logits(seen[0])[0, len(prompt) - 1]  # slot i = len-1 reads emb(t_{i+1}) = nxt
    q = rec.proposals[0].q
    assert q is not None
    torch.testing.assert_close(q[0, 0], logits.softmax(-1), atol=1e-5, rtol=1e-4)


def test_mtp_kl_loss_is_the_forward_kl_to_the_targets_own_next_distribution(tiny_target):
    """``kl``: depth d at slot i learns the target's distribution of t_{i+d+1}, taken from the
    target's own logits at position i+d (a forward pass, not the features), and its accuracy is
    agreement of the two argmaxes."""
    from specdec.drafters.mtp.train import mtp_loss

    drafter = DRAFTERS["mtp"].tiny(tiny_target, depth=2)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (2, 11), generator=g)
    final = target_features(tiny_target, tokens, ())["final"]
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[0, :4] = False
    drafts: list[torch.Tensor] = []
    record = lambda h: drafts.append(tiny_target.logits(h)) or drafts[-1]  # noqa: E731
    r = mtp_loss(tokens, final, drafter.modules, tiny_target.embed, record, tiny_target.rotary, mask, lam=0.3,
                 kl=True)
    with torch.no_grad():
        target_logits = tiny_target.model(tokens).logits.float()
    assert len(drafts) == 3  # the head over the target's hidden once (the labels of every depth), then each depth's
    for d, q in enumerate(drafts[1:], start=1):
        q = q.detach()
        n = tokens.shape[1] - d - 1
        p = target_logits[:, d: d + n].softmax(-1)
        m = mask[:, d + 1: d + 1 + n]
        kl = (p * (p.log() - q.float().log_softmax(-1))).sum(-1)
        assert float(r.mtp_ce[d - 1]) == pytest.approx(float((kl * m).sum() / m.sum()), rel=1e-4, abs=1e-6)
        agree = (q.argmax(-1) == p.argmax(-1)) & m
        assert float(r.mtp_acc[d - 1]) == pytest.approx(float(agree.sum() / m.sum()))
    assert float(r.loss.detach()) == pytest.approx(0.3 / 2 * float(r.mtp_ce.sum()), rel=1e-5)


def test_mtp_recipe_over_a_draft_vocabulary_reads_those_rows_and_counts_labels_inside(tiny_target, tmp_path):
    from specdec.draft_vocab import save_token_map
    from specdec.drafters.mtp.train import mtp_loss

    ranked = torch.tensor([7, 3, 30, 12, 0, 19, 25, 4, 9, 1])
    save_token_map(tmp_path / "map.safetensors", ranked)
    recipe = load_recipe(RECIPES["mtp"][0], dict(depth=1, token_map=str(tmp_path / "map.safetensors"), draft_vocab=8))
    modules = recipe.build(tiny_target, None)  # type: ignore[arg-type]
    vocab = ranked[:8].sort().values
    torch.testing.assert_close(recipe.head, tiny_target.lm_head.weight.detach()[vocab].float())
    tokens = torch.tensor([[7, 3, 30, 12, 5, 0, 19, 25, 6, 4, 9, 7]])
    final = target_features(tiny_target, tokens, ())["final"]
    mask = torch.ones_like(tokens, dtype=torch.bool)
    r = mtp_loss(tokens, final, modules, tiny_target.embed, lambda h: torch.nn.functional.linear(h, recipe.head),
                 tiny_target.rotary, mask, vocab_index=recipe.vocab_index)
    full = mtp_loss(tokens, final, modules, tiny_target.embed,
                    lambda h: tiny_target.logits(h).masked_fill(~torch.isin(torch.arange(V), vocab), -1e9),
                    tiny_target.rotary, mask & torch.isin(tokens, vocab))  # labels 5 and 6 are outside: not counted
    assert r.mtp_ce.tolist() == pytest.approx(full.mtp_ce.tolist(), rel=1e-5)
    assert r.mtp_acc.tolist() == pytest.approx(full.mtp_acc.tolist())
    for bad, err in ((dict(loss="mse"), ValueError), (dict(draft_vocab=4), ValueError),
                     (dict(token_map=[1, 2]), TypeError), (dict(token_map="x", draft_vocab="4"), TypeError)):
        with pytest.raises(err):
            load_recipe(RECIPES["mtp"][0], bad)


def test_mtp_recipe_can_start_its_layer_as_a_copy_of_the_targets_last_layer(tiny_target):
    """The lever ``init_layer="last"``: every weight of the MTP layer equals the target's last layer's
    (which a random start does not), and the copy is the module's own (training it leaves the target's alone)."""
    last = tiny_target.layer_weights(-1)
    copied = load_recipe(RECIPES["mtp"][0], dict(depth=1, init_layer="last")).build(tiny_target, None)  # type: ignore[arg-type]
    fresh = load_recipe(RECIPES["mtp"][0], dict(depth=1)).build(tiny_target, None)  # type: ignore[arg-type]
    for name, w in copied[0].mtp_block.state_dict().items():
        torch.testing.assert_close(w, last[name].float())
    assert any(not torch.equal(w, last[n].float()) for n, w in fresh[0].mtp_block.state_dict().items())
    with torch.no_grad():
        next(copied[0].mtp_block.parameters()).add_(1.0)
    torch.testing.assert_close(tiny_target.layer_weights(-1), last)
    with pytest.raises(ValueError, match="init_layer"):
        load_recipe(RECIPES["mtp"][0], dict(init_layer="first"))


def test_mtp_recipe_trains_with_the_kl_loss_over_a_draft_vocabulary(tiny_target, tmp_path, cache):
    """End to end: the KL recipe over a draft vocabulary trains, its held-out figures are KL, and the
    checkpoint drafts losslessly through the drafter over the same vocabulary."""
    from specdec.draft_vocab import save_token_map

    save_token_map(tmp_path / "map.safetensors", torch.arange(V - 1, -1, -1))
    opts = dict(depth=1, loss="kl", token_map=str(tmp_path / "map.safetensors"), draft_vocab=24)
    cfg = tiny_config(tmp_path, "mtp", options=opts, optim=OptimConfig(steps=3, batch=2, lr=5e-3))
    result = train(cfg, target=tiny_target)
    assert "mtp_kl" in result.record.held_out and result.record.held_out["loss"] > 0
    drafter = DRAFTERS["mtp"].create(tiny_target, checkpoint=cfg.out, token_map=opts["token_map"], draft_vocab=24)
    prompt = [1, 2, 3, 4, 5]
    res = run(tiny_target, drafter, GreedyVerifier(), [Request(prompt, 8)], k=2, eos_token_ids=set())
    ref, logits = greedy_reference(tiny_target.model, prompt, 8)
    assert_greedy_equivalent(res.requests[0].tokens, ref, logits)


def test_metadata_file_has_its_fields(tiny_target, tmp_path, cache):
    cfg = tiny_config(tmp_path, "dspark")
    result = train(cfg, command="python experiments/train.py --config-name smollm2_dspark optim.steps=2",
                   target=tiny_target)
    info = json.loads((Path(cfg.out) / RECORD_FILE).read_text())
    assert info["command"] == "python experiments/train.py --config-name smollm2_dspark optim.steps=2"
    assert info["revision"] == specdec.provenance.git_sha() and isinstance(info["dirty"], bool)
    assert info["config"] == json.loads(json.dumps(asdict(cfg))) and info["steps"] == 2
    data = load_data(cfg.data, None)
    assert 0 < info["response_tokens"] < info["tokens"] <= 2 * 2 * max(s.tokens.numel() for s in data.train)
    assert info["wall_seconds"] > 0 and {"torch", "transformers", "python"} <= set(info["versions"])
    assert len(info["held_out"]["accept"]) == 4 and {"ce", "l1", "bce"} <= set(info["held_out"])
    assert len(info["extra"]["confidence_temperatures"]) == 4  # DSpark's calibration, also in its config
    assert json.loads((Path(cfg.out) / "config.json").read_text())["confidence_temperatures"] == \
        info["extra"]["confidence_temperatures"]
    assert [(e["step"], "held_out" in e) for e in info["log"]] == [(1, False), (2, False), (2, True)]
    assert info["log"][-1]["held_out"] == info["held_out"] and info["log"][1]["lr"] > 0
    assert TrainingRecord.read(cfg.out) == result.record


# --- the Hydra entry point -----------------------------------------------------------------------------

def _entry():
    """experiments/run.py as a module (importing it registers ``train/train_schema``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("specdec_experiments_run_train", ROOT / "experiments" / "run.py")
    assert spec is not None and spec.loader is not None
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    return entry


def compose_train(name: str, overrides: list[str] = ()) -> TrainConfig:
    """``experiments/run.py --config-name train/<name> <overrides>``'s config, without running it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    entry = _entry()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF.parent), version_base="1.3"):
            return entry.to_train_config(compose(config_name=f"train/{name}", overrides=list(overrides)))
    finally:
        GlobalHydra.instance().clear()


def compose_lab(name: str, overrides: list[str]):
    """A lab preset's function and checked parameters (``experiments/run.py --config-name <name> ...``), not run."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    entry = _entry()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF.parent), version_base="1.3"):
            return entry.lab_job(compose(config_name=name, overrides=list(overrides)))
    finally:
        GlobalHydra.instance().clear()


def test_every_train_config_composes_and_names_a_recipe_with_valid_options():
    names = sorted(p.stem for p in CONF.glob("*.yaml"))
    assert names == ["smollm2_dflash", "smollm2_dflash2", "smollm2_dspark", "smollm2_eagle3", "smollm2_gemma_mtp", "smollm2_mtp",
                     "tiny_deepseek_v3_mtp"]
    for name in names:
        cfg = compose_train(name)
        recipe = load_recipe(cfg.recipe, cfg.options)
        assert cfg.out.startswith("experiments/checkpoints/") and type(recipe).__module__.startswith(
            "specdec.drafters."), name
    with pytest.raises(Exception, match="stepz"):
        compose_train("smollm2_eagle3", ["optim.stepz=3"])


@pytest.mark.parametrize("folder", sorted(p.name for p in CHECKPOINTS.iterdir() if p.is_dir() and p.name != "__pycache__"))
def test_every_committed_checkpoint_records_how_it_was_made(folder):
    """One ``training.json`` per checkpoint: the command that made it at a revision of this
    repository, and the one trainer's command for the same recipe (which writes to this folder)."""
    path = CHECKPOINTS / folder
    assert sorted(p.name for p in path.glob("*.json") if p.name.startswith("train")) == [RECORD_FILE]
    record = TrainingRecord.read(path)
    assert record.steps > 0 and record.held_out["accept"] and record.config
    assert subprocess.run(["git", "cat-file", "-e", f"{record.revision}^{{commit}}"], cwd=ROOT).returncode == 0
    command = record.equivalent_command or record.command
    prefix = "python experiments/run.py --config-name train/"
    reads = None  # the folder the next command's init= names: the one the command before it writes
    chain = [*record.remake_first, command]
    if chain[0].startswith("python experiments/run.py --config-name lab/store "):  # a store-trained chain: the store's first
        fn, params = compose_lab("lab/store", shlex.split(chain[0])[4:])  # the store mode takes every key
        assert fn.__name__ == "fill" and f"data.store={params['out']}" in chain[1]  # the first part reads that store
        chain = chain[1:]
    while chain[0].startswith("python experiments/run.py --config-name lab/corpus "):  # a generated corpus first
        fn, params = compose_lab("lab/corpus", shlex.split(chain[0])[4:])  # (grown in parts: resumed, as it was)
        assert fn.__name__ == "grow" and not params["compare"] and not params["report"]
        assert any(f"data.path={params['out']}" in part for part in chain[1:])  # a later part trains on it
        chain = chain[1:]
    for i, part in enumerate(chain):
        assert part.startswith(prefix)  # the one trainer's command for this recipe
        name, *overrides = shlex.split(part[len(prefix):])
        cfg = compose_train(name, overrides)
        assert cfg.init == reads, (i, part)
        reads = cfg.out
    assert reads == f"experiments/checkpoints/{folder}"  # the last writes to this folder
    # run today, the last command trains the recorded recipe: a default changed since names the old value
    recorded = record.config
    assert "recipe" in recorded or folder == "tiny-deepseek-v3-mtp"  # that one recorded its own trainer's config
    if "recipe" in recorded:
        assert trainer._with_defaults(cfg.recipe, cfg.options) == \
            trainer._with_defaults(recorded["recipe"], recorded["options"]), chain[-1]


def test_entry_point_trains_and_records_its_command(tmp_path):
    path = random_data(tmp_path / "d.safetensors")
    args = ["experiments/run.py", "--config-name", "train/smollm2_eagle3", "target.model=tiny", "data.source=distill",
            f"data.path={path}", "data.held_out_every=4", "options.draft_vocab=16", "options.layer_ids=[0,1,2]",
            "optim.steps=2", f"out={tmp_path / 'out'}", f"work={tmp_path / 'work'}"]
    env = {**os.environ, "SPECDEC_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    record = TrainingRecord.read(tmp_path / "out")
    assert record.command == shlex.join(["python", *args])
    assert record.config["target"]["model"] == "tiny" and record.steps == 2
    assert (tmp_path / "work" / "run.log").exists()  # Hydra's log (the runner's) beside the resumable state
    assert not any(p.name.startswith(".") for p in (tmp_path / "out").iterdir())


# --- several processes -----------------------------------------------------------------------------------

class SeenMTP(PostHocMTPRecipe):
    """The post-hoc MTP recipe (it draws nothing at random), remembering the training sequences it saw."""

    seen: ClassVar[list[list[int]]] = []

    def loss(self, model: torch.nn.Module, batch: Batch, gen: torch.Generator):
        if model.training:
            SeenMTP.seen += batch.tokens.tolist()
        return super().loss(model, batch, gen)


def _launched(cfgs: list[TrainConfig], target: Target, folder: Path) -> None:
    """What each launched process runs: train every config in turn, then leave in ``folder`` the
    weights of each run and what the process saw and wrote."""
    AcceleratorState._reset_state(reset_partial_state=True)  # forked from a process that trained alone
    SeenMTP.seen, wrote = [], []

    def spy(name, fn):
        return lambda *a, **k: wrote.append(name) or fn(*a, **k)

    trainer.save_file = spy(STATE_FILE, trainer.save_file)  # the forked process's own modules: nothing leaks back
    TrainingRecord.write = spy(RECORD_FILE, TrainingRecord.write)
    SeenMTP.save = spy("checkpoint", SeenMTP.save)
    for i, cfg in enumerate(cfgs):
        weights = train(cfg, target=target).model.state_dict()
        save_file(weights, str(folder / f"{i}-{PartialState().process_index}.safetensors"))
    (folder / f"{PartialState().process_index}.json").write_text(json.dumps({"seen": SeenMTP.seen, "wrote": wrote}))


def test_two_processes_train_as_one_process_on_the_same_global_batches(tiny_target, tmp_path, cache):
    """``accelerate launch`` with two processes, here accelerate's debug launcher (two forked CPU
    processes, gloo): each trains on its own half of every batch and DDP averages the gradients,
    so the weights are a single process's on the same batches (this recipe draws nothing at random
    and every half holds as many label tokens); only the main process writes files."""
    data = DataConfig(path=str(random_data(tmp_path / "d.safetensors", n=16, length=16)), held_out_every=4,
                      feature_dtype="float32")

    def config(name: str) -> TrainConfig:
        return TrainConfig(recipe=f"{__name__}.SeenMTP", options=dict(depth=2), data=data, out=str(tmp_path / name),
                           work=str(tmp_path / f"{name}-work"), optim=OptimConfig(steps=3, batch=4, lr=5e-3),
                           save_every=1, log_every=1, progress=False)

    SeenMTP.seen = []
    alone = train(config("one"), target=tiny_target)
    debug_launcher(_launched, ([config("two")], tiny_target, tmp_path), num_processes=2)
    procs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]

    halves = [p["seen"] for p in procs]  # per process: 2 sequences a step
    assert not {tuple(t) for t in halves[0]} & {tuple(t) for t in halves[1]}
    assert [t for s in range(3) for h in halves for t in h[2 * s: 2 * s + 2]] == SeenMTP.seen  # the same batches
    assert procs[0]["wrote"] == [STATE_FILE, STATE_FILE, "checkpoint", RECORD_FILE] and procs[1]["wrote"] == []
    with safe_open(str(tmp_path / "two-work" / STATE_FILE), framework="pt") as f:
        assert {"rng.gen", "rng.torch", "rng.gen.1", "rng.torch.1"} <= set(f.keys())  # each process's draws

    weights = [load_file(str(tmp_path / f"0-{r}.safetensors")) for r in (0, 1)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # the processes stay in step
    for k, v in alone.model.state_dict().items():
        torch.testing.assert_close(weights[0][k], v, rtol=1e-4, atol=1e-6)
    two = TrainingRecord.read(tmp_path / "two")
    assert (two.steps, two.tokens, two.response_tokens) == (3, alone.record.tokens, alone.record.response_tokens)
    assert two.versions["processes"] == "2" and alone.record.versions["processes"] == "1"
    assert two.held_out["accept"] == pytest.approx(alone.record.held_out["accept"], abs=1e-3)


def test_two_processes_resume_bit_identical(tiny_target, tmp_path, cache):
    """Each process's random states are in the resumable state: two processes stopped after 2 of 4
    steps and resumed end where two that never stopped end (EAGLE-3 draws its anchors at random)."""
    optim = dict(steps=4, batch=4, accumulate=2, lr=5e-3)
    whole = tiny_config(tmp_path / "a", "eagle3", optim=OptimConfig(**optim))
    part = tiny_config(tmp_path / "b", "eagle3", optim=OptimConfig(**optim, stop_after=2))
    resumed = tiny_config(tmp_path / "b", "eagle3", optim=OptimConfig(**optim), resume=True)
    debug_launcher(_launched, ([whole, part, resumed], tiny_target, tmp_path), num_processes=2)
    for r in (0, 1):
        a, b = (load_file(str(tmp_path / f"{i}-{r}.safetensors")) for i in (0, 2))
        assert all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = TrainingRecord.read(whole.out), TrainingRecord.read(resumed.out)
    assert (ra.steps, ra.tokens, ra.held_out) == (rb.steps, rb.tokens, rb.held_out) and len(rb.parts) == 2


# --- slow: the real target -----------------------------------------------------------------------------

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
    again = load_sequences(path)
    assert all(torch.equal(a.tokens, b.tokens) and a.response_start == b.response_start for a, b in zip(seqs, again))

    f = target_features(smollm2, seqs[0].tokens[None], [0, 2])
    out = smollm2.model(input_ids=seqs[0].tokens[None], output_hidden_states=True)
    D = smollm2.hidden_size
    torch.testing.assert_close(f["features"][0, :, D:], out.hidden_states[2][0])
    torch.testing.assert_close(smollm2.logits(f["final"])[0], out.logits[0])


def test_a_run_resumes_when_its_recipe_gained_an_option_at_its_default():
    from specdec.training.trainer import _resumable

    base = dict(recipe="specdec.drafters.eagle3.train.Eagle3Recipe", out="x", target=None)
    old = TrainConfig(**base, options={"draft_vocab": 64})  # written before fc_norm existed
    new = TrainConfig(**base, options={"draft_vocab": 64, "fc_norm": False})
    assert _resumable(old) == _resumable(new)
    assert _resumable(old) != _resumable(TrainConfig(**base, options={"draft_vocab": 64, "fc_norm": True}))


def test_training_runs_torch_kernels_only_and_counts_every_loss_position(tmp_path, cache, tiny_target, monkeypatch):
    """Triton forced on CPU tensors is an error, so a run under SPECDEC_KERNELS=triton finishes only
    because the trainer runs torch code throughout (its held-out evaluation, under no_grad, would
    take the fused draft input's kernel path). EAGLE-3 trains every response position: the record
    counts them, per target token and in all, and the log's figures are read to plain numbers."""
    from specdec.kernels.dispatch import backend_for

    monkeypatch.setenv("SPECDEC_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError):
        backend_for(torch.zeros(1))
    cfg = tiny_config(tmp_path, "eagle3", options=dict(layer_ids=[0, 1, 2], draft_vocab=24))
    rec = train(cfg, target=tiny_target).record
    data = load_data(cfg.data, None)
    drawn = [data.train[i] for i in data.indices(0, 4, cfg.seed)]  # 2 steps of 2 sequences
    assert rec.positions == sum(s.tokens.numel() - 2 - max(0, s.response_start - 2) + 1 for s in drawn)
    every = sum(s.tokens.numel() - 1 - max(0, s.response_start - 2) for s in data.train)
    assert rec.positions_per_token == pytest.approx(every / sum(s.tokens.numel() for s in data.train), abs=1e-4)
    logged = [e for e in rec.log if "loss" in e]
    assert [e["step"] for e in logged] == [1, 2] and all(isinstance(e["loss"], float) for e in logged)
    assert all(len(e["accept"]) == 7 and isinstance(e["accept"][0], float) for e in logged)


@pytest.mark.parametrize("kl", [False, True], ids=["ce", "kl"])
def test_mtp_loss_on_the_label_rows_alone_is_the_same_loss(tiny_target, kl):
    """The recipe's path (``host_mask``: the head and the target's distribution on the label rows
    only, indices found on the host) gives the plain path's loss, figures and gradients."""
    from specdec.drafters.mtp.train import label_rows, mtp_loss

    drafter = DRAFTERS["mtp"].tiny(tiny_target, depth=2)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, V, (3, 12), generator=g)
    lengths, start = torch.tensor([12, 7, 10]), torch.tensor([4, 0, 9])
    final = target_features(tiny_target, tokens, ())["final"]
    vocab = torch.arange(0, V, 2)
    index = torch.full((V,), -1)
    index[vocab] = torch.arange(vocab.numel())
    head = tiny_target.lm_head.weight.detach().float()[vocab]
    args = (tokens, final, drafter.modules, tiny_target.embed, lambda h: torch.nn.functional.linear(h, head),
            tiny_target.rotary, label_rows(lengths, start, 12))
    kw = dict(kl=kl, vocab_index=None if kl else index)
    plain, rows = mtp_loss(*args, **kw), mtp_loss(*args, **kw, host_mask=label_rows(lengths, start, 12))
    torch.testing.assert_close(rows.loss, plain.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rows.mtp_ce, plain.mtp_ce, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rows.mtp_acc, plain.mtp_acc)
    params = [p for p in drafter.modules.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(rows.loss, params, allow_unused=True),
                    torch.autograd.grad(plain.loss, params, allow_unused=True)):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))


def test_gemma_assistant_head_on_the_real_anchors_alone_is_the_same_loss(tiny_target, tmp_path, cache):
    """Dense anchors pad short rows; the recipe's head runs on the real anchors only (``rows``, found
    on the host) and gives the loss, figures and gradients of the head over every padded anchor."""
    from specdec.drafters.gemma_mtp.train import response_anchors, unrolled_loss

    cfg = tiny_config(tmp_path, "gemma_mtp", options=dict(hidden=16, intermediate=32, anchors=0))
    recipe = load_recipe(cfg.recipe, cfg.options)
    data = load_data(cfg.data, tiny_target, lambda t: recipe.featurize(tiny_target, t), recipe.feature_key(tiny_target))
    torch.manual_seed(0)
    model = recipe.build(tiny_target, data)
    batch = data.batch(data.train[:3])
    anchors, keep, rows = response_anchors(batch, 0, 3, torch.Generator())
    assert 0 < rows.numel() < keep.numel()  # every position of each row's range, short rows padded
    embed = lambda ids: tiny_target.embed(ids).float()  # noqa: E731
    fast, fast_acc = unrolled_loss(model, embed, batch, anchors, keep, 3, 0.8, rows)
    full, full_acc = unrolled_loss(model, embed, batch, anchors, keep, 3, 0.8)
    torch.testing.assert_close(fast, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast_acc, full_acc)
    params = [p for p in model.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(fast, params, allow_unused=True), torch.autograd.grad(full, params, allow_unused=True)):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))

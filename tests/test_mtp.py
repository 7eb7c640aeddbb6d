"""The MTP / NextN drafter: step → module policies, the DeepSeek-V3 checkpoint loader (reads only
the MTP tensors), losslessness on a DeepSeek-V3 target (chain and tree), and, on the committed tiny
DeepSeek-V3 trained with its own MTP modules, agreement with transformers' ``generate(use_mtp=True)``
(its acceptance: tests/test_checkpoints.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import specdec
from specdec.drafters.mtp import checkpoint as mtp_checkpoint
from specdec.drafters.mtp.drafter import MTPConfig, MTPDrafter, build_mtp_modules, module_for_step
from specdec.drafters.mtp.checkpoint import from_checkpoint_layout, load_mtp_modules, to_checkpoint_layout
from specdec.loop import Request, run
from specdec.target import Target
from specdec.testing import Recording, assert_greedy_equivalent, greedy_reference, sampled_gof
from specdec.testing.tiny import tiny_model
from specdec.verifiers import GreedyVerifier, RejectionVerifier

CHECKPOINT = Path(__file__).resolve().parents[1] / "experiments" / "checkpoints" / "tiny-deepseek-v3-mtp"


# --- policies ---------------------------------------------------------------------------------
def test_policies_map_steps_to_modules():
    D, k = 2, 6
    assert [module_for_step(j, D, "cycle") for j in range(k)] == [0, 1, 0, 1, 0, 1]
    assert [module_for_step(j, D, "last") for j in range(k)] == [0, 1, 1, 1, 1, 1]
    assert [module_for_step(j, D, "first") for j in range(k)] == [0, 1, 0, 0, 0, 0]
    assert [module_for_step(j, 3, "cycle") for j in range(5)] == [0, 1, 2, 0, 1]  # no divisibility rule
    with pytest.raises(ValueError, match="policy"):
        MTPConfig(policy="round_robin")


@pytest.fixture(scope="module")
def ds_target() -> Target:
    return Target(tiny_model("deepseek_v3", vocab_size=48, init_scale=0.3, seed=3))


@pytest.mark.parametrize("policy,expected", [("cycle", [0, 1, 0, 1, 0]), ("last", [0, 1, 1, 1, 1]),
                                             ("first", [0, 1, 0, 0, 0])])
def test_each_step_runs_the_policy_module(ds_target, policy, expected):
    d = MTPDrafter.tiny(ds_target, policy=policy)
    calls: list[int] = []
    for i, m in enumerate(d.modules):
        m.register_forward_hook(lambda *_, i=i: calls.append(i))
    run(ds_target, d, GreedyVerifier(), [Request([1, 2, 3], 2)], k=5, eos_token_ids=set())
    assert calls == expected  # one propose: step j ran module policy(j)


# --- losslessness on a DeepSeek-V3 (MLA + MoE) target ------------------------------------------
@pytest.mark.parametrize("options", [{"policy": "cycle"}, {"policy": "last", "chain_hidden": "residual"},
                                     {"tree_top_k": 3}], ids=["chain-cycle", "chain-last-residual", "tree3"])
def test_greedy_equals_target_on_deepseek_v3(ds_target, options):
    d = MTPDrafter.tiny(ds_target, **options)
    prompts = [[5, 6, 7, 8], [9], [1, 2, 3, 1, 2, 3, 1]]
    res = run(ds_target, d, GreedyVerifier(), [Request(p, 10) for p in prompts], k=4, eos_token_ids=set())
    for p, r in zip(prompts, res.requests):
        ref, logits = greedy_reference(ds_target.model, p, 10)
        assert_greedy_equivalent(r.tokens, ref, logits)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "gemma4"])
def test_greedy_equals_target_across_families(family):
    """The block is the target's own decoder layer (Gemma 3: its layer type's mask and rotary;
    Gemma 4: the full-attention head size and its own K/V where the target's last layer shares them)."""
    t = Target(tiny_model(family, vocab_size=40, init_scale=0.3))
    for options in ({}, {"tree_top_k": 2}):
        res = run(t, MTPDrafter.tiny(t, **options), GreedyVerifier(), [Request([1, 2, 3], 9), Request([4], 6)], k=3,
                  eos_token_ids=set())
        for p, r in zip(([1, 2, 3], [4]), res.requests):
            ref, logits = greedy_reference(t.model, p, len(r.tokens))
            assert_greedy_equivalent(r.tokens, ref, logits)


def test_tree_is_top_k_distinct_then_chains(ds_target):
    d = Recording(MTPDrafter.tiny(ds_target, tree_top_k=3))
    run(ds_target, d, RejectionVerifier(), [Request([4, 5, 6], 3, specdec.SamplingParams(temperature=1.0, seed=0))],
        k=3, eos_token_ids=set())
    p = d.proposals[0]
    assert p.q is None and p.tokens.shape == (1, 9)
    assert p.parents[0].tolist() == [-1, -1, -1, 0, 3, 1, 5, 2, 7]
    assert len(set(p.tokens[0, :3].tolist())) == 3


def test_sampled_tree_matches_target_distribution(target):
    """A top-2 tree (deterministic q = None) verified by rejection sampling stays lossless."""
    d = MTPDrafter.tiny(target, tree_top_k=2)
    sampling = specdec.SamplingParams(temperature=1.0)
    r = sampled_gof(target, d, RejectionVerifier(), [1, 2, 3, 4], sampling, n_samples=3000)
    assert len(r.pvalues) >= 3 and r.min_p > 1e-3 / len(r.pvalues), min(zip(r.pvalues, r.tests))


# --- the checkpoint loader -------------------------------------------------------------------
class _SpyOpen:
    """Records every file opened and every tensor read through safetensors.safe_open."""

    def __init__(self, real):
        self.real, self.opened, self.read = real, [], []

    def __call__(self, file, framework="pt", **kw):
        self.opened.append(Path(file).name)
        handle, spy = self.real(file, framework=framework, **kw), self

        class Handle:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                handle.__exit__(*exc)

            def keys(self):
                return handle.keys()

            def get_tensor(self, k):
                spy.read.append(k)
                return handle.get_tensor(k)

        return Handle()


def test_loader_reads_only_the_mtp_tensors_of_a_sharded_checkpoint(ds_target, tmp_path, monkeypatch):
    L, D = ds_target.num_layers, 2
    torch.manual_seed(0)
    modules = build_mtp_modules(ds_target, D)
    main = {k: v.contiguous() for k, v in ds_target.model.state_dict().items() if "experts" not in k}
    mtp = {}
    for d, m in enumerate(modules):
        for k, v in to_checkpoint_layout(m.state_dict()).items():
            mtp[f"model.layers.{L + d}.{k}"] = v.contiguous()
        # the released files repeat the shared embedding and head in every MTP layer: never read
        mtp[f"model.layers.{L + d}.embed_tokens.weight"] = torch.zeros(3, 3)
        mtp[f"model.layers.{L + d}.shared_head.head.weight"] = torch.zeros(3, 3)
    save_file(main, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(mtp, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in main},
                  **{k: "model-00002-of-00002.safetensors" for k in mtp}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": L, "num_nextn_predict_layers": D}))

    spy = _SpyOpen(mtp_checkpoint.safe_open)
    monkeypatch.setattr(mtp_checkpoint, "safe_open", spy)
    loaded = load_mtp_modules(ds_target, tmp_path)
    assert set(spy.opened) == {"model-00002-of-00002.safetensors"}  # the main shard is never opened
    assert sorted(spy.read) == sorted(k for k in mtp if not k.endswith(("embed_tokens.weight", "head.weight")))
    for a, b in zip(modules, loaded):
        for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
            assert ka == kb and torch.equal(va, vb), ka


def test_checkpoint_layout_round_trip_and_fp8(ds_target):
    m = build_mtp_modules(ds_target, 1)[0]
    raw = to_checkpoint_layout(m.state_dict())
    assert "mlp.experts.0.gate_proj.weight" in raw and "enorm.weight" in raw and "eh_proj.weight" in raw
    back = from_checkpoint_layout(raw)
    assert all(torch.equal(back[k], v) for k, v in m.state_dict().items())
    w = torch.randn(200, 130)  # two-by-two 128-blocks, ragged at the edges
    scale = torch.tensor([[0.5, 2.0], [4.0, 0.25]])
    fp8 = (w / scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :130]).to(torch.float8_e4m3fn)
    out = from_checkpoint_layout({"eh_proj.weight": fp8, "eh_proj.weight_scale_inv": scale})
    assert torch.allclose(out["eh_proj.weight"], w, rtol=0.07, atol=0.02)


def test_bad_inputs(ds_target, tmp_path):
    with pytest.raises(ValueError, match="checkpoint"):
        MTPDrafter.create(ds_target)  # a tiny in-memory target has no folder
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="no MTP modules"):
        MTPDrafter.create(ds_target, checkpoint=str(tmp_path))


# --- the committed tiny DeepSeek-V3 with its own trained MTP modules ------------------------
@pytest.fixture(scope="module")
def trained() -> Target:
    assert (CHECKPOINT / "model.safetensors").exists(), \
        f"missing {CHECKPOINT}: run experiments/run.py --config-name train/tiny_deepseek_v3_mtp"
    return specdec.load_target(str(CHECKPOINT))


def _heldout_prompts(target: Target, n: int = 3, length: int = 48) -> list[list[int]]:
    from specdec.data.text import stdlib_files

    files = stdlib_files("heldout")[:n]
    return [target.tokenizer.encode(f.read_text())[:length] for f in files]


def test_checkpoint_is_the_real_layout(trained):
    cfg = json.loads((CHECKPOINT / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["num_nextn_predict_layers"] == 2
    L = cfg["num_hidden_layers"]
    keys = mtp_checkpoint.mtp_keys(CHECKPOINT, L, 2)
    assert {f"model.layers.{L}.eh_proj.weight", f"model.layers.{L + 1}.shared_head.norm.weight",
            f"model.layers.{L + 1}.mlp.experts.0.gate_proj.weight"} <= set(keys)
    assert sum(f.stat().st_size for f in CHECKPOINT.iterdir()) <= 30 * 2**20
    # transformers loads the main model whole and leaves exactly the MTP layers aside
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(CHECKPOINT, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert info["unexpected_keys"] and all(k.startswith((f"model.layers.{L}.", f"model.layers.{L + 1}."))
                                           for k in info["unexpected_keys"])


def test_drafts_and_output_match_transformers_generate_use_mtp(trained, monkeypatch):
    """transformers' MTPCandidateGenerator and this drafter (k = D = 2) propose the same drafts
    at every step and emit the same greedy tokens."""
    from transformers.generation.candidate_generator import MTPCandidateGenerator

    model, L = trained.model, trained.num_layers
    # transformers finds MTP weights through `_keys_to_ignore_on_load_unexpected`, which DeepSeek-V3
    # hard-codes to the 671B layout (`model.layers.61`); point it at this checkpoint's layers.
    mtp_patterns = [rf"model\.layers\.{L}.*", rf"model\.layers\.{L + 1}.*"]
    monkeypatch.setattr(model, "_keys_to_ignore_on_load_unexpected", mtp_patterns, raising=False)
    theirs: list[list[int]] = []
    original = MTPCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        if logits is not None:
            theirs.append(ids[0, input_ids.shape[1]:].tolist())
        return ids, logits

    monkeypatch.setattr(MTPCandidateGenerator, "get_candidates", recording)
    n = 24
    for prompt in _heldout_prompts(trained, 2):
        theirs.clear()
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, use_mtp=True,
                             eos_token_id=None, pad_token_id=0)
        ours = Recording(MTPDrafter.create(trained))
        res = run(trained, ours, GreedyVerifier(), [Request(prompt, n)], k=2, eos_token_ids=set())
        assert res.requests[0].tokens == out[0, len(prompt):].tolist()
        mine = [p.tokens[0].tolist() for p in ours.proposals]
        assert len(theirs) >= 3 and mine[: len(theirs)] == theirs

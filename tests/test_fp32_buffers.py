"""Rotary frequencies (and every other non-persistent buffer) of the draft networks stay float32
through dtype casts: a drafter loaded from a bf16 checkpoint computes what the same weights compute
with float32 frequencies, at every position, and a bf16 export read back is exact."""

from __future__ import annotations

import pytest
import torch

from specdec.drafters.dflash.checkpoint import load_block_draft, save_block_draft
from specdec.drafters.dflash.drafter import DFlashDrafter
from specdec.drafters.dspark.drafter import DSparkDrafter
from specdec.drafters.eagle3.checkpoint import load_eagle3, save_eagle3
from specdec.drafters.eagle3.drafter import Eagle3Drafter
from specdec.drafters.eagle3.model import Eagle3Model, attend
from specdec.drafters.gemma_mtp.drafter import GemmaMTPDrafter, tiny_assistant
from specdec.drafters.mtp.drafter import MTPDrafter
from specdec.target import Target
from specdec.testing.tiny import tiny_model

POSITIONS = 2048  # a long context: a bf16 inv_freq moved the argmax at 106 of these positions


@pytest.fixture(scope="module")
def llama() -> Target:
    return Target(tiny_model("llama", vocab_size=32, seed=3))


def _non_persistent(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    persistent = set(model.state_dict(keep_vars=True))
    return {n: b for n, b in model.named_buffers() if n not in persistent and b.is_floating_point()}


def _bf16_weights(model: torch.nn.Module) -> torch.nn.Module:
    """Round every parameter to bf16 (kept in fp32): a bf16 export of it then loses nothing."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_casts_keep_non_persistent_buffers_in_fp32(llama, family):
    model = {"eagle3": Eagle3Drafter, "dflash": DFlashDrafter, "dspark": DSparkDrafter}[family].tiny(llama).model
    before = {n: b.clone() for n, b in _non_persistent(model).items()}
    assert any("inv_freq" in n for n in before)
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float(),
                 lambda m: m.to(dtype=torch.bfloat16, device="cpu")):
        cast(model)
        after = _non_persistent(model)
        assert after.keys() == before.keys()
        for name, buf in after.items():
            assert buf.dtype == torch.float32 and torch.equal(buf, before[name]), name
    assert model.fc.weight.dtype == torch.bfloat16  # the weights themselves were cast


def test_mtp_modules_hold_no_buffer_a_cast_could_round(llama):
    """MTP rotates with the target's rotary embedding; its modules own no non-persistent buffer."""
    d = MTPDrafter.tiny(llama)
    assert _non_persistent(d.modules.to(torch.bfloat16)) == {}


def test_gemma_mtp_rebuilds_rotary_frequencies_a_cast_rounded():
    target = Target(tiny_model("gemma3", vocab_size=32))
    fresh = {n: b for n, b in _non_persistent(tiny_assistant(target)).items() if "inv_freq" in n}
    d = GemmaMTPDrafter(tiny_assistant(target).to(torch.bfloat16))
    got = _non_persistent(d.assistant)
    assert fresh and all(got[n].dtype == torch.float32 and torch.equal(got[n], b) for n, b in fresh.items())


def _eagle3_logits(model: Eagle3Model, feats: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """One causal pass of the draft layer over positions 0..T-1 → draft logits [1, T, Vd]."""
    T = feats.shape[1]
    g = model.fuse(feats)
    cos, sin = model.rope(g, torch.arange(T)[None])
    q, k, v, res = model.layer.qkv(emb.to(g.dtype), g, cos, sin)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]
    return model.draft_logits(model.layer.finish(attend(q, k, v, causal), res))


def _eagle3_inputs(model: Eagle3Model) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, POSITIONS, model.fc.in_features, generator=g),
            torch.randn(1, POSITIONS, model.config.hidden_size, generator=g))


def test_a_bf16_loaded_eagle3_matches_fp32_frequencies_up_to_2k_positions(llama, tmp_path):
    """load_eagle3 casts to the checkpoint's dtype; the drafter then binds to the fp32 target."""
    d = Eagle3Drafter.tiny(llama)
    save_eagle3(d.model, tmp_path, dtype=torch.bfloat16)
    loaded = load_eagle3(tmp_path)
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.rotary.inv_freq.dtype == torch.float32
    loaded.float()
    same = Eagle3Model(loaded.config, loaded.spec)  # the same (bf16-rounded) weights, fresh fp32 frequencies
    same.load_state_dict(loaded.state_dict())
    feats, emb = _eagle3_inputs(loaded)
    with torch.no_grad():
        torch.testing.assert_close(_eagle3_logits(loaded, feats, emb), _eagle3_logits(same, feats, emb),
                                   atol=1e-5, rtol=1e-5)


def test_eagle3_export_to_speculators_and_back_is_exact_up_to_2k_positions(llama, tmp_path):
    model = _bf16_weights(Eagle3Drafter.tiny(llama).model)
    save_eagle3(model, tmp_path, dtype=torch.bfloat16)
    back = load_eagle3(tmp_path).float()
    feats, emb = _eagle3_inputs(model)
    with torch.no_grad():
        torch.testing.assert_close(_eagle3_logits(back, feats, emb), _eagle3_logits(model, feats, emb),
                                   atol=1e-5, rtol=1e-5)


def _block_hidden(model, positions_from: int) -> torch.Tensor:
    """A block at positions ``positions_from``.. over a context at 0..positions_from-1 → [1, b, D]."""
    g = torch.Generator().manual_seed(1)
    cfg = model.cfg
    c, b = positions_from, cfg.block_size
    ctx = model.project_context(torch.randn(1, c, model.fc.in_features, generator=g))
    kv = model.context_kv(ctx, torch.arange(c)[None])
    block = torch.randn(1, b, cfg.hidden_size, generator=g)
    return model(block, torch.arange(c, c + b)[None], kv, torch.ones(1, b, c + b, dtype=torch.bool))


@pytest.mark.parametrize("family,layout", [("dflash", "native"), ("dflash", "speculators"),
                                           ("dspark", "native"), ("dspark", "speculators")])
def test_block_drafts_loaded_in_bf16_are_exact_up_to_2k_positions(llama, tmp_path, family, layout):
    """An export (native or speculators layout) in bf16, read back in bf16 and run in fp32, is the
    same network as the original at positions up to 2k."""
    model = _bf16_weights({"dflash": DFlashDrafter, "dspark": DSparkDrafter}[family].tiny(llama).model)
    save_block_draft(model, tmp_path, dtype=torch.bfloat16, layout=layout)
    back = load_block_draft(tmp_path, dtype=torch.bfloat16)
    assert back.rotary.inv_freq.dtype == torch.float32
    back.float()
    with torch.no_grad():
        torch.testing.assert_close(_block_hidden(back, POSITIONS - model.cfg.block_size),
                                   _block_hidden(model, POSITIONS - model.cfg.block_size), atol=1e-5, rtol=1e-5)

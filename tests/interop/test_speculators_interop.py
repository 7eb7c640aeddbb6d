"""Round trips with the real speculators package (``make interop``; not part of ``make test``):
our EAGLE-3, DFlash and DSpark exports loaded by speculators' own classes (config fields and every
weight compared), and speculators' own ``save_pretrained`` of them loaded back by us (the same
weights, the same drafts). speculators runs in its own environment (its transformers pin differs
from ours): ``SPECDEC_INTEROP_PYTHON`` names that python."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdec.drafters.dflash.checkpoint import load_block_draft, save_block_draft
from specdec.drafters.dflash.drafter import DFlashDrafter
from specdec.drafters.dspark.drafter import DSparkDrafter
from specdec.drafters.eagle3.checkpoint import load_eagle3, save_eagle3
from specdec.drafters.eagle3.drafter import Eagle3Drafter
from specdec.target import Target
from specdec.testing.tiny import tiny_model

SIDE = Path(__file__).with_name("speculators_side.py")
PYTHON = os.environ.get("SPECDEC_INTEROP_PYTHON", str(Path(__file__).parents[2] / ".cache/interop-venv/bin/python"))


@pytest.fixture(scope="module")
def verifier(tmp_path_factory) -> tuple[Target, str]:
    """A tiny Llama saved as a folder: speculators reads the verifier's embedding, head and norm from it."""
    model = tiny_model("llama", vocab_size=64, seed=0, init_scale=0.3, num_hidden_layers=4)
    folder = tmp_path_factory.mktemp("verifier")
    model.save_pretrained(folder)
    return Target(model), str(folder)


def _speculators(folder: Path, out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    out.mkdir()
    res = subprocess.run([PYTHON, str(SIDE), str(folder), str(out)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((out / "config.json").read_text()), load_file(str(out / "loaded.safetensors"))


def _same_weights(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], skip=()) -> None:
    for name, w in ours.items():
        if name in skip or name.startswith("rotary."):
            continue
        assert name in theirs, f"speculators has no {name}"
        torch.testing.assert_close(theirs[name].float(), w.float(), atol=0, rtol=0, msg=name)


def test_eagle3_both_ways(verifier, tmp_path):
    target, path = verifier
    d = Eagle3Drafter.tiny(target)
    ours = save_eagle3(d.model, tmp_path / "ours", verifier=path, dtype=torch.float32)
    config, theirs = _speculators(ours, tmp_path / "spec")
    assert config["_class"] == "Eagle3DraftModel" and config["_speculators_version"] == "0.9.0"
    assert config["draft_vocab_size"] == d.model.spec.draft_vocab_size
    assert config["eagle_aux_hidden_state_layer_ids"] == list(d.model.spec.layer_ids)
    assert config["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    _same_weights(d.model.state_dict(), theirs)
    saved = tmp_path / "spec" / "saved"
    back = load_eagle3(saved)  # speculators' own save, read by us
    written = json.loads((saved / "config.json").read_text())
    assert written["architectures"] == ["Eagle3DraftModel"] and "dtype" in written
    assert {"speculators_version", "speculators_model_type", "speculators_config"} <= set(written)
    _same_weights(d.model.state_dict(), back.state_dict())


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_block_drafts_both_ways_with_a_draft_vocabulary(verifier, tmp_path, family):
    target, path = verifier
    cls = {"dflash": DFlashDrafter, "dspark": DSparkDrafter}[family]
    d = cls.tiny(target)
    ids = torch.arange(0, target.vocab_size, 3)
    d.model.set_draft_vocab(torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, ids, True))
    ours = save_block_draft(d.model, tmp_path / "ours", dtype=torch.float32, layout="speculators", verifier=path,
                            lm_head=target.lm_head.weight)
    config, theirs = _speculators(ours, tmp_path / "spec")
    arch = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}[family]
    assert config["_class"] == arch and config["draft_vocab_size"] == len(ids)
    assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in d.cfg.target_layer_ids]
    assert config["block_size"] == d.cfg.block_size and config["mask_token_id"] == d.cfg.mask_token_id
    assert torch.equal(theirs["t2d"], d.model.t2d) and torch.equal(theirs["d2t"], ids - torch.arange(len(ids)))
    torch.testing.assert_close(theirs["lm_head.weight"], target.lm_head.weight[ids].detach(), atol=0, rtol=0)
    sliced = {"markov_head.markov_w2.weight": d.model.state_dict().get("markov_head.markov_w2.weight")}
    _same_weights(d.model.state_dict(), theirs, skip=set(sliced))
    if family == "dspark":
        torch.testing.assert_close(theirs["markov_head.markov_w2.weight"], sliced["markov_head.markov_w2.weight"][ids])
    saved = tmp_path / "spec" / "saved"
    written = json.loads((saved / "config.json").read_text())
    assert written["architectures"] == [arch] and "dtype" in written
    back = load_block_draft(saved)  # speculators' own save, read by us
    assert torch.equal(back.t2d, d.model.t2d)
    _same_weights(d.model.state_dict(), back.state_dict(), skip=set(sliced))
    if family == "dspark":  # rows outside the draft vocabulary are never drafted: read back as zeros
        torch.testing.assert_close(back.state_dict()["markov_head.markov_w2.weight"][ids],
                                   sliced["markov_head.markov_w2.weight"][ids])

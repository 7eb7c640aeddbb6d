"""Exports in speculators' layout carry the fields speculators 0.9.0 itself saves, field by field
(its config classes and save code): ``architectures`` as ``save_pretrained`` writes them, ``dtype``
(not ``torch_dtype``), ``speculators_version``, the verifier's architectures, ``t2d`` and ``d2t``
(DFlash/DSpark: a reduced draft vocabulary with its head rows), and the converter's layer-id rule.
Reading them back drafts exactly as before."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specdec.drafters.dflash.checkpoint import load_block_draft, save_block_draft
from specdec.drafters.dflash.drafter import DFlashDrafter
from specdec.drafters.dspark.drafter import DSparkDrafter
from specdec.drafters.eagle3.checkpoint import load_eagle3, save_eagle3
from specdec.drafters.eagle3.drafter import Eagle3Drafter
from specdec.drafters.speculators_format import SPECULATORS_VERSION
from specdec.sampling import RowSampling, SamplingParams
from specdec.types import Committed


def _verifier_folder(tmp_path) -> str:
    folder = tmp_path / "verifier"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    return str(folder)


def _common_fields(config: dict, architectures: list[str], verifier: str) -> None:
    assert config["architectures"] == architectures
    assert config["dtype"] == "bfloat16" and "torch_dtype" not in config
    assert config["speculators_version"] == SPECULATORS_VERSION == "0.9.0"
    assert config["speculators_config"]["verifier"] == {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}


def test_eagle3_export_fields(target, tmp_path):
    d = Eagle3Drafter.tiny(target)
    verifier = _verifier_folder(tmp_path)
    out = save_eagle3(d.model, tmp_path / "e", verifier=verifier)
    config = json.loads((out / "config.json").read_text())
    _common_fields(config, ["Eagle3DraftModel"], verifier)
    w = load_file(str(out / "model.safetensors"))
    assert torch.equal(w["t2d"], d.model.t2d) and torch.equal(w["d2t"], d.model.d2t)
    assert config["draft_vocab_size"] == int(d.model.t2d.sum()) < target.vocab_size
    explicit = save_eagle3(d.model, tmp_path / "x", verifier="org/model", verifier_architectures=["Qwen3ForCausalLM"])
    verifier_block = json.loads((explicit / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier_block == {"name_or_path": "org/model", "architectures": ["Qwen3ForCausalLM"]}
    assert torch.equal(load_eagle3(out).t2d, d.model.t2d)


def _context(target, drafter, tokens: list[int], nxt: int) -> Committed:
    with torch.no_grad():
        out = target.model(torch.tensor([tokens]), output_hidden_states=True)
    n = len(tokens)
    return Committed(tokens=torch.tensor([tokens]), num_tokens=torch.tensor([n]), positions=torch.arange(n)[None],
                     next_tokens=torch.tensor([nxt]), active=torch.ones(1, dtype=torch.bool),
                     hidden={i: out.hidden_states[i] for i in drafter.hidden_ids})


def _drafts(drafter, target) -> tuple[torch.Tensor, torch.Tensor]:
    rows = RowSampling([SamplingParams(temperature=1.0, seed=0)])
    prop = drafter.propose(drafter.start(_context(target, drafter, [1, 2, 3, 4], 6), rows), 3, rows)
    return prop.tokens, prop.q


@pytest.mark.parametrize("family,arch", [("dflash", "DFlashDraftModel"), ("dspark", "DSparkDraftModel")])
def test_block_draft_export_fields_and_a_reduced_vocabulary_round_trip(target, tmp_path, family, arch):
    cls = {"dflash": DFlashDrafter, "dspark": DSparkDrafter}[family]
    d = cls.tiny(target)
    ids = torch.tensor([1, 3, 5, 7, 11, 20])
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    d.model.set_draft_vocab(t2d)
    verifier = _verifier_folder(tmp_path)
    with pytest.raises(ValueError, match="lm_head"):
        save_block_draft(d.model, tmp_path / "no_head", layout="speculators", verifier=verifier)
    out = save_block_draft(d.model, tmp_path / "s", layout="speculators", verifier=verifier,
                           lm_head=target.lm_head.weight, dtype=torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    _common_fields(config, [arch], verifier)
    assert config["draft_vocab_size"] == len(ids)
    w = load_file(str(out / "model.safetensors"))
    assert torch.equal(w["t2d"], t2d) and torch.equal(w["d2t"], ids - torch.arange(len(ids)))
    assert torch.equal(w["lm_head.weight"], target.lm_head.weight[ids].to(torch.bfloat16))
    if family == "dspark":  # the Markov head scores the draft vocabulary only, as speculators' W2
        assert w["markov_head.markov_w2.weight"].shape[0] == len(ids)
    # read back (fp32 weights for an exact comparison): the same drafts and q
    exact = save_block_draft(d.model, tmp_path / "f", layout="speculators", verifier=verifier,
                             lm_head=target.lm_head.weight, dtype=torch.float32)
    again = cls(load_block_draft(exact))
    again.bind(target)
    assert torch.equal(again.model.t2d, t2d)
    for a, b in zip(_drafts(again, target), _drafts(d, target)):
        torch.testing.assert_close(a, b)


def test_a_layer_id_naming_the_verifiers_last_layer_is_dropped_as_speculators_converter_does(target, tmp_path):
    L = target.num_layers
    d = DFlashDrafter.tiny(target, target_layer_ids=[0, L - 1])  # output of the last layer: hidden_states[L]
    with pytest.warns(UserWarning, match="dropped"):
        out = save_block_draft(d.model, tmp_path / "s", layout="speculators", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["aux_hidden_state_layer_ids"] == [1]
    w = load_file(str(out / "model.safetensors"))
    D = d.cfg.hidden_size
    assert torch.equal(w["fc.weight"], d.model.fc.weight[:, :D].detach())
    assert load_block_draft(out).cfg.target_layer_ids == [0]

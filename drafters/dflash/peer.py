"""The DFlash drafter's weights as transformers' own DFlash draft model.

transformers ships DFlash drafting as ``DFlashTokenCandidateGenerator`` (``generate(...,
speculation_type="dflash")``) over its DFlash draft model class (``MuseGlimmerAssistantModel``:
the same block forward, with ``fc``/``hidden_norm`` under ``encoder.fc``/``encoder.output_norm_enc``).
Converting our weights lets the benchmark's ``hf_compare`` and the tests run both implementations on
the same numbers (:func:`transformers_peer`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from specdec.drafter import Drafter
from specdec.drafters.dflash.drafter import DFlashDrafter
from specdec.target import Target
from specdec.transformers_versions import require

__all__ = ["to_transformers", "transformers_peer"]

_RENAME = {"fc.": "encoder.fc.", "hidden_norm.": "encoder.output_norm_enc."}


def to_transformers(drafter: DFlashDrafter) -> nn.Module:
    """A transformers DFlash draft model holding this drafter's weights (full attention, sdpa)."""
    require("MuseGlimmerAssistantModel (DFlash)")
    from transformers.models.muse_glimmer_assistant.configuration_muse_glimmer_assistant import (
        MuseGlimmerAssistantConfig,
    )
    from transformers.models.muse_glimmer_assistant.modeling_muse_glimmer_assistant import MuseGlimmerAssistantModel

    cfg = drafter.cfg
    hf_cfg = MuseGlimmerAssistantConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps, rope_parameters=dict(cfg.rope_parameters),
        max_position_embeddings=cfg.max_position_embeddings, layer_types=["full_attention"] * cfg.num_hidden_layers,
        block_size=cfg.block_size, mask_token_id=cfg.mask_token_id, target_layer_ids=list(cfg.target_layer_ids),
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf_cfg._attn_implementation = "sdpa"
    model = MuseGlimmerAssistantModel(hf_cfg).eval()
    state = {next((v + k[len(p):] for p, v in _RENAME.items() if k.startswith(p)), k): w
             for k, w in drafter.model.state_dict().items()}
    model.load_state_dict(state, strict=True)
    return model.to(device=drafter.target.device, dtype=drafter.target.dtype)


def transformers_peer(target: Target, drafter: Drafter | None, k: int) -> dict[str, Any]:
    """``generate()`` arguments for transformers' DFlash candidate generator on this drafter's
    weights. It drafts a whole block (``block_size - 1`` tokens) whatever ``k``."""
    if not isinstance(drafter, DFlashDrafter):
        raise ValueError("hf_compare 'dflash' runs the dflash drafter's weights: use drafter=dflash")
    require("MuseGlimmerAssistantModel (DFlash)")
    return {"assistant_model": to_transformers(drafter), "speculation_type": "dflash"}

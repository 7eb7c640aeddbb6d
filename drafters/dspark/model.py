"""DSpark's draft network: DFlash's block backbone with the anchor predicting, plus the heads.

:class:`DSparkConfig` adds to :class:`~specdec.drafters.dflash.model.BlockDraftConfig` the fields
of the two heads (:mod:`specdec.drafters.dspark.heads`) and their calibration; :class:`DSparkModel`
builds them beside the backbone under DeepSpec's names (``markov_head.*``, ``confidence_head.*``).
The blocks differ from DFlash's in one convention: position 0 (the anchor) drafts too, so a block
of ``b`` gives ``b`` drafts.

This module also registers how the checkpoint layouts hold DSpark
(:func:`specdec.drafters.dflash.checkpoint.register_block_family`): DeepSpec's and speculators'
DSpark ``config.json`` carry the head fields (same names); a speculators DFlash file whose anchor
drafts is a DSpark backbone without heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from specdec.drafters.dflash.checkpoint import BlockFamily, register_block_family
from specdec.drafters.dflash.model import BlockDraftConfig, BlockDraftModel
from specdec.drafters.dspark.heads import ConfidenceHead, build_markov_head

__all__ = ["DSparkConfig", "DSparkModel"]


@dataclass
class DSparkConfig(BlockDraftConfig):
    """The backbone's fields plus the heads'; stored in the checkpoint's ``config.json``."""

    anchor_predicts: ClassVar[bool] = True
    markov_rank: int = 0  # 0: no causal correction
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    confidence_temperatures: list[float] | None = None  # post-hoc calibration, one per position

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_head_type not in ("vanilla", "gated", "rnn"):
            raise ValueError(f"markov_head_type must be vanilla, gated or rnn, got {self.markov_head_type!r}")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank <= 0:
            raise ValueError("a confidence head with markov features needs markov_rank > 0")


class DSparkModel(BlockDraftModel):
    """The backbone with the Markov head (``markov_rank > 0``) and the confidence head
    (``enable_confidence_head``)."""

    config_class: ClassVar[type[BlockDraftConfig]] = DSparkConfig
    cfg: DSparkConfig

    def __init__(self, cfg: DSparkConfig):
        super().__init__(cfg)
        D = cfg.hidden_size
        self.markov_head = build_markov_head(cfg.vocab_size, cfg.markov_rank, D, cfg.markov_head_type)
        self.confidence_head = (ConfidenceHead(D, cfg.markov_rank if cfg.confidence_head_with_markov else 0)
                                if cfg.enable_confidence_head else None)

    def draft_bias(self, prev: Tensor, hidden: Tensor, vocab: Tensor | None = None) -> Tensor | None:
        """The Markov head's teacher-forced bias [..., γ, V or S] (None without a head)."""
        return None if self.markov_head is None else self.markov_head.block_bias(prev, hidden, vocab)

    def confidence_logits(self, hidden: Tensor, prev: Tensor) -> Tensor | None:
        """The confidence head's logits [..., γ] (uncalibrated), reading ``W1[x_{k−1}]`` when
        configured with markov features; None without a head."""
        if self.confidence_head is None:
            return None
        markov = self.markov_head
        emb = markov.prev_embed(prev) if (self.cfg.confidence_head_with_markov and markov is not None) else None
        return self.confidence_head(hidden, emb)


# absent head fields: each layout's own defaults (speculators' DSparkSpeculatorConfig has both heads on)
_HEAD_DEFAULTS = {"deepspec": {"markov_rank": 0, "markov_head_type": "vanilla", "enable_confidence_head": False,
                               "confidence_head_with_markov": False},
                  "speculators": {"markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
                                  "confidence_head_with_markov": True}}


def _read(c: dict[str, Any], layout: str, backbone: dict[str, Any]) -> DSparkConfig:
    """The head fields of DeepSpec and speculators DSpark files; a speculators DFlash file whose
    anchor drafts (``sample_from_anchor``) is a backbone without heads."""
    if layout not in _HEAD_DEFAULTS or c.get("speculators_model_type") == "dflash":
        return DSparkConfig(**backbone)
    heads = {k: c.get(k, v) for k, v in _HEAD_DEFAULTS[layout].items()}
    return DSparkConfig(**backbone, markov_rank=int(heads["markov_rank"]),
                        markov_head_type=str(heads["markov_head_type"]).lower(),
                        enable_confidence_head=bool(heads["enable_confidence_head"]),
                        confidence_head_with_markov=bool(heads["confidence_head_with_markov"]),
                        confidence_temperatures=c.get("confidence_temperatures"))


def _heads(cfg: DSparkConfig) -> dict[str, Any]:
    return {"markov_rank": cfg.markov_rank, "markov_head_type": cfg.markov_head_type,
            "enable_confidence_head": cfg.enable_confidence_head,
            "confidence_head_with_markov": cfg.confidence_head_with_markov,
            "confidence_temperatures": cfg.confidence_temperatures}


def _write(cfg: DSparkConfig, arch: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpec layout."""
    return {"architectures": ["Qwen3DSparkModel"], **arch, "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": cfg.target_layer_ids, **_heads(cfg)}


def _speculators(cfg: DSparkConfig) -> dict[str, Any]:
    """speculators' DSparkSpeculatorConfig fields beyond the backbone's."""
    return {"architectures": ["DSparkDraftModel"], **_heads(cfg)}


# the Markov head's W2 scores the drafted vocabulary: speculators keeps a draft vocabulary's rows of it
register_block_family("dspark", BlockFamily(DSparkModel, _read, _write, _speculators,
                                            draft_vocab_rows=("markov_head.markov_w2.weight",)))

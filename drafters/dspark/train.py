"""DSpark's training loss and recipe, on DFlash's block forward (:mod:`specdec.drafters.dflash.train`).

Block position ``j ≥ 0`` predicts ``x_{a+j+1}`` (the anchor predicts too); the Markov head adds its
bias from the previous *ground-truth* token (teacher forcing) and

    L = 0.1·CE + 0.9·Σ w_k ‖p^d_k − p^t_k‖₁ + 1.0·BCE(c_k, c*_k)

with ``w_k = exp(−(k−1)/γ)`` and ``c*_k = 1 − ½‖p^d_k − p^t_k‖₁`` (each term normalised by the
weights, as DeepSpec does). ``p^t`` is the target's distribution at the predicted position, over
the training vocabulary. After training, the confidence head is calibrated on the held-out
sequences (sequential temperature scaling, :func:`~specdec.drafters.dspark.heads.calibrate_temperatures`)
and the temperatures go into the checkpoint's config (DeepSpec layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.drafters.dflash.model import BlockDraftModel
from specdec.drafters.dspark.model import DSparkModel
from specdec.drafters.dflash.train import (
    BlockBatch,
    BlockOptions,
    BlockRecipe,
    Embed,
    block_predictions,
    per_position,
    target_distribution,
    weighted_ce,
)
from specdec.drafters.dspark.heads import calibrate_temperatures, expected_calibration_error
from specdec.training.data import Batch, TrainData
from specdec.training.recipe import StepOutput, masked_mean

__all__ = ["dspark_loss", "DSparkOptions", "DSparkRecipe"]


def dspark_loss(model: DSparkModel, embed: Embed, head: Tensor, batch: BlockBatch, anchors: Tensor, keep: Tensor,
                gamma: float = 4.0, vocab: Tensor | None = None, ce_alpha: float = 0.1, l1_alpha: float = 0.9,
                conf_alpha: float = 1.0, group: int = 0) -> tuple[StepOutput, Tensor | None, Tensor, Tensor]:
    """The DSpark loss over all anchors at once; ``accept`` is the mean soft acceptance per position.
    Also returns, for calibration, the confidence logits and realised acceptances of every block
    ([B, A, γ] each, detached; logits None without a confidence head) and which blocks have a label
    at every position ([B, A]): the caller selects (a boolean selection would read the device)."""
    p = block_predictions(model, embed, head, batch, anchors, keep, gamma, vocab, group)
    logits = p.logits
    bias = model.draft_bias(p.prev, p.hidden, vocab)
    if bias is not None:
        logits = logits + bias.float()
    ce = weighted_ce(p, logits)
    p_t = target_distribution(p, batch, head)
    tv = (logits.softmax(-1) - p_t).abs().sum(-1)  # [B, A, γ] = 2·total variation
    l1 = masked_mean(tv, p.weight, 1e-6)
    accept = (1 - 0.5 * tv).clamp(0, 1)
    loss = ce_alpha * ce + l1_alpha * l1
    metrics: dict[str, Any] = {"ce": ce.detach(), "l1": l1.detach()}
    conf_logits = model.confidence_logits(p.hidden, p.prev)
    if conf_logits is not None:
        bce = masked_mean(F.binary_cross_entropy_with_logits(conf_logits, accept.detach(), reduction="none"), p.weight,
                          1e-6)
        loss = loss + conf_alpha * bce
        metrics["bce"] = bce.detach()
    metrics["accept"] = per_position(accept.detach(), p.valid)
    return (StepOutput(loss, metrics), None if conf_logits is None else conf_logits.detach(), accept.detach(),
            p.valid.all(-1))


@dataclass
class DSparkOptions(BlockOptions):
    markov_rank: int = 48
    markov_type: str = "vanilla"  # vanilla, gated or rnn
    confidence_head: bool = True


class DSparkRecipe(BlockRecipe):
    """A DSpark drafter (DFlash backbone, Markov and confidence heads) for a frozen target."""

    Options = DSparkOptions
    options: DSparkOptions
    model_class = DSparkModel

    def extra_config(self) -> dict[str, Any]:
        o = self.options
        return dict(markov_rank=o.markov_rank, markov_head_type=o.markov_type, enable_confidence_head=o.confidence_head)

    def _loss(self, model: nn.Module, batch: Batch, gen: torch.Generator
              ) -> tuple[StepOutput, Tensor | None, Tensor, Tensor]:
        assert isinstance(model, DSparkModel)
        bb = self.block_batch(batch)
        anchors, keep = self.anchors(model, batch, gen)
        return dspark_loss(model, self.embed, self.head, bb, anchors, keep, self.options.gamma, self.vocab,
                           group=self.options.group)

    def loss(self, model: nn.Module, batch: Batch, gen: torch.Generator) -> StepOutput:
        return self._loss(model, batch, gen)[0]

    @torch.no_grad()
    def finish(self, model: nn.Module, data: TrainData, gen: torch.Generator) -> dict[str, Any]:
        """Calibrate the confidence temperatures on the held-out blocks."""
        assert isinstance(model, DSparkModel)
        if model.confidence_head is None or not data.held:
            return {}
        dev = next(model.parameters()).device  # the held-out batches come from the host
        model.eval()
        found = [self._loss(model, b.to(dev), gen)[1:] for b in data.scan("held", batch=8)]
        model.train()
        # the blocks whose every position has a label: calibration data
        z = torch.cat([f[0][f[2]] for f in found if f[0] is not None])
        c = torch.cat([f[1][f[2]] for f in found])
        if not z.shape[0]:
            return {}
        temps = calibrate_temperatures(z, c)
        model.cfg.confidence_temperatures = temps
        surv = c.cumprod(-1)

        def ece(t: Tensor) -> list[float]:
            pred = torch.sigmoid(z / t).cumprod(-1)
            return [expected_calibration_error(pred[:, j], surv[:, j]) for j in range(z.shape[1])]

        return {"confidence_temperatures": temps, "calibration_ece_before": ece(torch.ones((), device=dev)),
                "calibration_ece_after": ece(torch.tensor(temps, device=dev)), "calibration_blocks": int(z.shape[0])}

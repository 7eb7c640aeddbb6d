"""DFlash 2's training loss and recipe, on DFlash's block forward (:mod:`specdec.drafters.dflash.train`).

The backbone (its convolutions included) learns DFlash's loss on the same block predictions (weighted
CE on the sequence's tokens, or forward KL to the target's distribution). The selector learns a
teacher-forced loss over the slot's top-K candidates: at slot ``j`` the predecessor is the true
previous token (the anchor first), the candidates the top-K of the draft's own logits (chosen
without gradient), and the scores ``s_j(x_{j−1}, c)`` of :meth:`CandidateSelector.scores`:

- ``loss: ce``: cross-entropy to the label's candidate, where the label is among them;
- ``loss: kl``: forward KL to the target's distribution restricted to the candidates (renormalised),

weighted by DFlash's decay ``exp(−(j−1)/γ)`` and added with ``selector_weight``. The unary term is
the draft's logits, so the selector loss also teaches the backbone to rank within its top-K. No
published recipe trains the selector (neither vLLM, SGLang nor z-lab/dflash ship training code for
DFlash 2); this one is the library's. The convolutions' projections start at zero and their base
kernels at the identity, so training starts from DFlash's layer exactly.

``accept`` is the selector's teacher-forced top-1 agreement per position (what greedy verification
of the walk accepts at a position whose predecessors were right), ``accept_unary`` DFlash's own
figure from the same logits, ``in_top_k`` how often the label is among the candidates at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.drafters.dflash.train import (
    BlockBatch,
    DFlashOptions,
    DFlashRecipe,
    Embed,
    block_predictions,
    per_position,
    target_distribution,
    weighted_ce,
)
from specdec.drafters.dflash2.model import DFlash2Model
from specdec.target import Target
from specdec.training.data import Batch, TrainData
from specdec.training.recipe import StepOutput, forward_kl

__all__ = ["dflash2_loss", "DFlash2Options", "DFlash2Recipe"]


def _weighted(values: Tensor, weight: Tensor) -> Tensor:
    return (values * weight).sum() / weight.sum().clamp(min=1e-6)


def dflash2_loss(model: DFlash2Model, embed: Embed, head: Tensor, batch: BlockBatch, anchors: Tensor, keep: Tensor,
                 gamma: float = 4.0, vocab: Tensor | None = None, kl: bool = False,
                 selector_weight: float = 1.0, group: int = 0) -> StepOutput:
    """DFlash's loss plus the selector's over all anchors at once (see the module docstring)."""
    p = block_predictions(model, embed, head, batch, anchors, keep, gamma, vocab, group)
    p_t = target_distribution(p, batch, head) if kl else None
    base = _weighted(forward_kl(p.logits, p_t), p.weight) if p_t is not None else weighted_ce(p, p.logits)
    K = min(model.cfg.selector_top_k, p.logits.shape[-1])
    cand = p.logits.detach().topk(K, dim=-1).indices  # [B, A, γ, K] indices into the training vocabulary
    ids = cand if vocab is None else vocab.to(cand.device)[cand]
    s = model.candidate_selector.scores(p.prev, p.hidden, ids, model.unary(p.logits.gather(-1, cand)))
    hit = cand == p.labels.unsqueeze(-1)
    present = hit.any(-1) & p.valid
    if p_t is None:
        w = p.weight * present.float()
        sel = _weighted(F.cross_entropy(s.flatten(0, 2), hit.float().argmax(-1).flatten(), reduction="none")
                        .view(present.shape), w)
        truth = p.labels
    else:
        t = p_t.gather(-1, cand)
        mass = t.sum(-1, keepdim=True)
        w = p.weight * (mass.squeeze(-1) > 0).float()
        sel = _weighted(forward_kl(s, t / mass.clamp(min=1e-30)), w)
        truth = p_t.argmax(-1)
    pick = cand.gather(-1, s.argmax(-1, keepdim=True)).squeeze(-1)
    metrics: dict[str, Any] = {"base": base.detach(), "selector": sel.detach(),
                               "accept": per_position((pick == truth).float(), p.valid),
                               "accept_unary": per_position((p.logits.argmax(-1) == truth).float(), p.valid),
                               "in_top_k": per_position(present.float(), p.valid)}
    return StepOutput(base + selector_weight * sel, metrics)


@dataclass
class DFlash2Options(DFlashOptions):
    conv_kernel_size: int = 2  # taps
    conv_group_size: int = 16  # channels per dynamic coefficient (must divide the hidden size)
    selector_rank: int = 16
    selector_top_k: int = 16
    selector_weight: float = 1.0


class DFlash2Recipe(DFlashRecipe):
    """A DFlash 2 drafter (DFlash backbone, convolutions, candidate selector) for a frozen target."""

    Options = DFlash2Options
    options: DFlash2Options
    model_class = DFlash2Model

    def extra_config(self) -> dict[str, Any]:
        o = self.options
        return dict(conv_kernel_size=o.conv_kernel_size, conv_group_size=o.conv_group_size,
                    selector_rank=o.selector_rank, selector_top_k=o.selector_top_k)

    def build(self, target: Target | None, data: TrainData) -> nn.Module:
        model = super().build(target, data)
        assert isinstance(model, DFlash2Model)
        with torch.no_grad():  # the convolutions start as the identity: DFlash's layer exactly
            for layer in model.layers:
                layer.attention_conv.kernel_projection.weight.zero_()
                layer.mlp_conv.kernel_projection.weight.zero_()
        return model

    def loss(self, model: nn.Module, batch: Batch, gen: torch.Generator) -> StepOutput:
        assert isinstance(model, DFlash2Model)
        bb = self.block_batch(batch)
        anchors, keep = self.anchors(model, batch, gen)
        return dflash2_loss(model, self.embed, self.head, bb, anchors, keep, self.options.gamma, self.vocab,
                            kl=self.options.loss == "kl", selector_weight=self.options.selector_weight,
                            group=self.options.group)

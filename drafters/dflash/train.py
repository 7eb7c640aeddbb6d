"""Training losses for block drafters (DFlash, DSpark), many anchors per sequence in one pass.

For each sequence, ``A`` anchor positions ``a`` are drawn at random in the response. Block ``a``
is ``[x_a, MASK × (b−1)]`` at positions ``a..a+b−1``; its queries attend non-causally to their
own block and to the context K/V of the target features at positions strictly before ``a``
(exactly what the drafter has at inference, where ``x_a`` is the token the target just sampled).
Blocks never see each other, so all ``A`` blocks of a sequence run as one masked forward.

- **DFlash** (``anchor_predicts=False``): block position ``j ≥ 1`` predicts ``x_{a+j}``;
  cross-entropy weighted ``exp(−(j−1)/γ)`` (the first draft weighs 1).
- **DSpark** (``anchor_predicts=True``): block position ``j ≥ 0`` predicts ``x_{a+j+1}``; the
  Markov head adds its bias from the previous *ground-truth* token (teacher forcing) and
  ``L = 0.1·CE + 0.9·Σ w_k ‖p^d_k − p^t_k‖₁ + 1.0·BCE(c_k, c*_k)`` with
  ``w_k = exp(−(k−1)/γ)`` and ``c*_k = 1 − ½‖p^d_k − p^t_k‖₁`` (each term normalised by the
  weights, as DeepSpec does). ``p^t`` is the target's distribution at the predicted position.

Labels are the sequence's own tokens: the training data is the target's greedy output
(:mod:`specdec.training.data`), so in the response they are the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.drafters.dflash.model import BlockDraftModel

__all__ = ["BlockBatch", "BlockLoss", "sample_anchors", "block_forward", "block_loss"]


@dataclass
class BlockBatch:
    tokens: Tensor  # [B, T] int64 (padding anywhere past each row's length)
    features: Tensor  # [B, T, m·D] target layer outputs, concatenated
    final_hidden: Tensor  # [B, T, D] the target's post-norm hidden (its logits = lm_head of it)
    lengths: Tensor  # [B]
    response_start: Tensor  # [B]


@dataclass
class BlockLoss:
    loss: Tensor
    ce: float
    l1: float
    bce: float
    accept: list[float]  # per draft position: mean soft acceptance 1 − ½‖p^d − p^t‖₁ (or top-1 match)
    conf_logits: Tensor | None  # [N, γ] detached, for calibration
    conf_target: Tensor | None  # [N, γ]


def sample_anchors(batch: BlockBatch, num_anchors: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Up to ``num_anchors`` distinct anchors per row in ``[response_start, length−2]``, sorted;
    returns anchors [B, A] and which are real [B, A]."""
    B = batch.tokens.shape[0]
    anchors = torch.zeros(B, num_anchors, dtype=torch.long)
    keep = torch.zeros(B, num_anchors, dtype=torch.bool)
    for b in range(B):
        lo, hi = int(batch.response_start[b]), int(batch.lengths[b]) - 1  # need a label after the anchor
        n = max(hi - lo, 0)
        pick = (torch.randperm(n, generator=gen)[:num_anchors] + lo).sort().values
        anchors[b, : pick.numel()] = pick
        keep[b, : pick.numel()] = True
    return anchors, keep


def _block_mask(anchors: Tensor, keep: Tensor, T: int, b: int) -> Tensor:
    """[B, A·b, T + A·b] bool: a block sees context before its anchor and its own block."""
    B, A = anchors.shape
    q_block = torch.arange(A * b) // b  # [Q]
    ctx = torch.arange(T).view(1, 1, T) < anchors[:, q_block].unsqueeze(-1)  # [B, Q, T]
    own = (q_block.view(-1, 1) == q_block.view(1, -1)).expand(B, -1, -1)  # [B, Q, Q]
    mask = torch.cat([ctx, own], -1) & keep[:, q_block].unsqueeze(-1)
    mask[..., T:] |= ~keep[:, q_block].unsqueeze(-1) & own  # padding blocks: attend to themselves only
    return mask


def block_forward(model: BlockDraftModel, embed: nn.Module, batch: BlockBatch, anchors: Tensor,
                  keep: Tensor) -> tuple[Tensor, Tensor]:
    """Every anchor's block in one masked forward: final hidden [B, A, b, D] and the block
    tokens [B, A, b] (``[x_a, MASK…]``)."""
    b, (B, T), A = model.cfg.block_size, batch.tokens.shape, anchors.shape[1]
    dev = batch.features.device
    positions = (anchors.unsqueeze(-1) + torch.arange(b)).view(B, A * b)
    block_tokens = torch.full((B, A, b), model.cfg.mask_token_id, dtype=torch.long)
    block_tokens[:, :, 0] = batch.tokens.gather(1, anchors)
    block = embed(block_tokens.view(B, A * b).to(dev)).float()
    ctx = model.project_context(batch.features.float())
    ctx_kv = model.context_kv(ctx, torch.arange(T).expand(B, T).to(dev))
    hidden = model(block, positions.to(dev), ctx_kv, _block_mask(anchors, keep, T, b).to(dev))
    return hidden.view(B, A, b, -1), block_tokens


def block_loss(model: BlockDraftModel, embed: nn.Module, lm_head: nn.Module, batch: BlockBatch, anchors: Tensor,
               keep: Tensor, gamma: float = 4.0, ce_alpha: float = 0.1, l1_alpha: float = 0.9,
               conf_alpha: float = 1.0, vocab: Tensor | None = None) -> BlockLoss:
    """The DFlash or DSpark loss (by ``model.cfg.anchor_predicts``) over all anchors at once.

    ``vocab`` [S] restricts every softmax (draft and target) to those token ids, e.g. every token
    of the training data: the LM head is most of a step's cost and the data uses few of the
    vocabulary's rows. Labels outside it are left out of the loss."""
    cfg = model.cfg
    b, (B, T), A = cfg.block_size, batch.tokens.shape, anchors.shape[1]
    dev = batch.features.device
    hidden, block_tokens = block_forward(model, embed, batch, anchors, keep)

    # which block positions draft, and the index of the token each predicts
    first = 0 if cfg.anchor_predicts else 1
    h = hidden[:, :, first:]  # [B, A, γ, D]
    n_draft = b - first
    label_idx = anchors.unsqueeze(-1) + torch.arange(1, n_draft + 1)  # [B, A, γ]
    valid = (label_idx < batch.lengths.view(B, 1, 1)) & keep.unsqueeze(-1)
    safe = label_idx.clamp(max=T - 1)
    labels = batch.tokens.unsqueeze(1).expand(B, A, T).gather(2, safe)
    prev = torch.cat([block_tokens[:, :, :1], labels[..., :-1]], -1)  # teacher-forced x_{k−1}
    head_w = lm_head.weight if vocab is None else lm_head.weight[vocab.to(dev)]
    logits = F.linear(h, head_w).float()  # [B, A, γ, V or S]
    bias = model.draft_bias(prev.to(dev), h, None if vocab is None else vocab.to(dev))
    if bias is not None:
        logits = logits + bias.float()
    if vocab is not None:  # labels as indices into the subset; outside it: out of the loss
        index = torch.full((lm_head.weight.shape[0],), -1, dtype=torch.long)
        index[vocab] = torch.arange(vocab.numel())
        labels = index[labels]
        valid = valid & (labels >= 0)
        labels = labels.clamp(min=0)
    w = torch.exp(-torch.arange(n_draft, dtype=torch.float32) / gamma).to(dev) * valid.to(dev).float()
    wsum = w.sum().clamp(min=1e-6)
    ce_tok = F.cross_entropy(logits.flatten(0, 2), labels.flatten().to(dev), reduction="none").view(B, A, n_draft)
    ce = (ce_tok * w).sum() / wsum
    if not cfg.anchor_predicts:  # DFlash: CE only
        match = (logits.argmax(-1) == labels.to(dev)).float()
        acc = [float((match[..., j] * valid[..., j].to(dev)).sum() / valid[..., j].sum().clamp(min=1))
               for j in range(n_draft)]
        return BlockLoss(ce, float(ce.detach()), 0.0, 0.0, acc, None, None)

    with torch.no_grad():  # the target's distribution where each draft is verified
        tgt_hidden = batch.final_hidden.unsqueeze(1).expand(B, A, T, -1).gather(
            2, (safe - 1).clamp(min=0).unsqueeze(-1).expand(-1, -1, -1, batch.final_hidden.shape[-1]).to(dev))
        p_t = F.linear(tgt_hidden.to(h.dtype), head_w).float().softmax(-1)
    p_d = logits.softmax(-1)
    tv = (p_d - p_t).abs().sum(-1)  # [B, A, γ] = 2·total variation
    l1 = (tv * w).sum() / wsum
    accept = (1 - 0.5 * tv).clamp(0, 1)
    loss = ce_alpha * ce + l1_alpha * l1
    bce = torch.zeros(())
    conf_logits = model.confidence_logits(h, prev.to(dev))
    if conf_logits is not None:
        bce = (F.binary_cross_entropy_with_logits(conf_logits, accept.detach(), reduction="none") * w).sum() / wsum
        loss = loss + conf_alpha * bce
    acc = [float((accept[..., j].detach() * valid[..., j].to(dev)).sum() / valid[..., j].sum().clamp(min=1))
           for j in range(n_draft)]
    full = valid.all(-1).to(dev)  # blocks whose every position has a label: calibration data
    return BlockLoss(loss, float(ce.detach()), float(l1.detach()), float(bce.detach()), acc,
                     None if conf_logits is None else conf_logits.detach()[full],
                     accept.detach()[full])

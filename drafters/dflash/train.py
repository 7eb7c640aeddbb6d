"""Training of block drafters (DFlash here, DSpark in :mod:`specdec.drafters.dspark.train`): many anchors per sequence in one pass.

For each sequence, ``A`` anchor positions ``a`` are drawn at random in the response. Block ``a``
is ``[x_a, MASK × (b−1)]`` at positions ``a..a+b−1``; its queries attend non-causally to their
own block and to the context K/V of the target features at positions strictly before ``a``
(exactly what the drafter has at inference, where ``x_a`` is the token the target just sampled).
Blocks never see each other, so all ``A`` blocks of a sequence run as one masked forward.

**DFlash** (``anchor_predicts=False``): block position ``j ≥ 1`` predicts ``x_{a+j}``;
cross-entropy weighted ``exp(−(j−1)/γ)`` (the first draft weighs 1). DSpark's anchor predicts too
and its loss adds its heads' terms on the same :func:`block_predictions`.

Labels are the sequence's own tokens: the target's own answers (:mod:`specdec.training.data`), its
argmax where they were decoded greedily and draws from it where sampled. With ``loss: kl`` the label
is the target's distribution itself (forward KL, :func:`target_distribution`). Softmaxes (draft
and target) run over the tokens the training data uses (``vocab``; 9,333 of SmolLM2's 49,152):
the LM head is most of a step's cost. The checkpoint stores that set as the draft vocabulary
``t2d`` ([V] bool), masked into the logits at inference, since the other rows were never trained
down.

:class:`DFlashRecipe` is what the one trainer (:mod:`specdec.training.trainer`) drives. A few
residual channels of SmolLM2 carry massive activations (RMS ~1500 against a median ~5) that would
swamp ``fc`` early in a short run; training reads ``features / scale`` (per-channel RMS over the
training data) and the scale is folded into ``fc`` when saving (``fc(x / s) = (W / s)·x``), so the
checkpoint is a plain DFlash ``fc``. The output norm starts at the target's final norm (its LM head
expects that scale). Checkpoints: bf16, without embeddings or LM head, z-lab layout
(:func:`~specdec.drafters.dflash.checkpoint.save_block_draft`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.draft_vocab import vocab_positions
from specdec.drafters.dflash.checkpoint import load_block_draft, save_block_draft
from specdec.drafters.dflash.model import BlockDraftConfig, BlockDraftModel, build_target_layer_ids
from specdec.data.store import StoreNeeds
from specdec.target import Target, layer_output_ids
from specdec.training.data import Batch, TrainData, target_features
from specdec.training.recipe import (Recipe, StepOutput, batch_anchors, copy_weights, forward_kl, head_rows,
                                     masked_mean, span_positions)

__all__ = ["BlockBatch", "BlockPredictions", "sample_anchors", "block_forward", "block_predictions", "block_loss",
           "target_distribution", "BlockOptions", "DFlashOptions", "BlockRecipe", "DFlashRecipe"]

Embed = Callable[[Tensor], Tensor]


@dataclass
class BlockBatch:
    tokens: Tensor  # [B, T] int64 (padding anywhere past each row's length)
    features: Tensor  # [B, T, m·D] target layer outputs, concatenated
    final_hidden: Tensor  # [B, T, D] the target's post-norm hidden (its logits = lm_head of it)
    lengths: Tensor  # [B]
    response_start: Tensor  # [B]


def sample_anchors(batch: BlockBatch, num_anchors: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Up to ``num_anchors`` distinct anchors per row in ``[response_start, length−2]`` (0: every one), sorted;
    returns anchors [B, A] and which are real [B, A], on the batch's device (drawn on the generator's)."""
    return batch_anchors(batch.response_start, batch.lengths, num_anchors, gen, anchor_span,
                         device=batch.tokens.device)


def anchor_span(start: Tensor, length: Tensor) -> tuple[Tensor, Tensor]:
    """Where a block may start: in the response, with a label after it. ([B], [B])"""
    return start, length - 2


def _block_mask(anchors: Tensor, keep: Tensor, T: int, b: int) -> Tensor:
    """[B, A·b, T + A·b] bool: a block sees context before its anchor and its own block."""
    (B, A), dev = anchors.shape, anchors.device
    q_block = torch.arange(A * b, device=dev) // b  # [Q]
    ctx = torch.arange(T, device=dev).view(1, 1, T) < anchors[:, q_block].unsqueeze(-1)  # [B, Q, T]
    own = (q_block.view(-1, 1) == q_block.view(1, -1)).expand(B, -1, -1)  # [B, Q, Q]
    mask = torch.cat([ctx, own], -1) & keep[:, q_block].unsqueeze(-1)
    mask[..., T:] |= ~keep[:, q_block].unsqueeze(-1) & own  # padding blocks: attend to themselves only
    return mask


def block_forward(model: BlockDraftModel, embed: Embed, batch: BlockBatch, anchors: Tensor,
                  keep: Tensor, group: int = 0) -> tuple[Tensor, Tensor]:
    """Every anchor's block: final hidden [B, A, b, D] and the block tokens [B, A, b] (``[x_a, MASK…]``).
    The context K/V are computed once; the blocks run ``group`` at a time (0: all in one forward).
    Blocks never see each other, so grouping changes nothing but the cost: one forward's mask is
    [A·b, T + A·b], so attention grows with A² in one forward and with A·group in groups (every
    response position as an anchor costs per block what 32 sampled ones do)."""
    b, (B, T), A = model.cfg.block_size, batch.tokens.shape, anchors.shape[1]
    dev = batch.features.device
    positions = (anchors.unsqueeze(-1) + torch.arange(b, device=dev)).view(B, A * b)
    block_tokens = torch.full((B, A, b), model.cfg.mask_token_id, dtype=torch.long, device=dev)
    block_tokens[:, :, 0] = batch.tokens.gather(1, anchors)
    block = embed(block_tokens.view(B, A * b)).float()
    ctx = model.project_context(batch.features.float())
    ctx_kv = model.context_kv(ctx, torch.arange(T, device=dev).expand(B, T))
    G = A if group <= 0 else group
    hidden = torch.cat([model(block[:, g * b: (g + G) * b], positions[:, g * b: (g + G) * b], ctx_kv,
                              _block_mask(anchors[:, g: g + G], keep[:, g: g + G], T, b))
                        for g in range(0, A, G)], 1)
    return hidden.view(B, A, b, -1), block_tokens


@dataclass
class BlockPredictions:
    """The drafting positions of every block, their logits over the training vocabulary and labels."""

    hidden: Tensor  # [B, A, γ, D] final hidden of the drafting positions
    logits: Tensor  # [B, A, γ, S] float32, S = |vocab| (V without one)
    labels: Tensor  # [B, A, γ] indices into the vocabulary subset
    label_pos: Tensor  # [B, A, γ] sequence index of each label (clamped into the row)
    prev: Tensor  # [B, A, γ] the token before each label (teacher forcing; the anchor first)
    valid: Tensor  # [B, A, γ] bool: the label exists and lies in the vocabulary
    weight: Tensor  # [B, A, γ] exp(−(k−1)/γ) on valid positions, 0 elsewhere


def block_predictions(model: BlockDraftModel, embed: Embed, head: Tensor, batch: BlockBatch, anchors: Tensor,
                      keep: Tensor, gamma: float = 4.0, vocab: Tensor | None = None, group: int = 0) -> BlockPredictions:
    """Every anchor's block in one forward, with labels. ``head`` [S, D] holds the target's LM-head
    rows of the training vocabulary ``vocab`` [S] (token ids; None: ``head`` is the whole
    vocabulary). Labels outside the vocabulary are left out of the loss."""
    cfg = model.cfg
    b, (B, T), A = cfg.block_size, batch.tokens.shape, anchors.shape[1]
    dev = batch.features.device
    hidden, block_tokens = block_forward(model, embed, batch, anchors, keep, group)
    first = 0 if cfg.anchor_predicts else 1  # which block positions draft
    h = hidden[:, :, first:]
    n_draft = b - first
    label_idx = anchors.unsqueeze(-1) + torch.arange(1, n_draft + 1, device=dev)  # [B, A, γ]
    valid = (label_idx < batch.lengths.view(B, 1, 1)) & keep.unsqueeze(-1)
    safe = label_idx.clamp(max=T - 1)
    tokens = batch.tokens.unsqueeze(1).expand(B, A, T).gather(2, safe)
    prev = torch.cat([block_tokens[:, :, :1], tokens[..., :-1]], -1)
    if vocab is None:
        labels = tokens
    else:  # labels as indices into the subset; -1 outside it
        labels = vocab_positions(vocab.to(dev), cfg.vocab_size)[tokens]
    valid = valid & (labels >= 0)
    w = torch.exp(-torch.arange(n_draft, dtype=torch.float32, device=dev) / gamma) * valid.float()
    return BlockPredictions(h, F.linear(h, head.to(h.dtype)).float(), labels.clamp(min=0), safe, prev, valid, w)


def weighted_ce(p: BlockPredictions, logits: Tensor) -> Tensor:
    """Cross-entropy of ``logits`` [B, A, γ, S] against the labels, weighted and normalised by the weights."""
    ce = F.cross_entropy(logits.flatten(0, 2), p.labels.flatten(), reduction="none").view(p.labels.shape)
    return masked_mean(ce, p.weight, 1e-6)


def per_position(values: Tensor, valid: Tensor) -> Tensor:
    """Mean of ``values`` [B, A, γ] over the valid entries, per position. [γ], on the device"""
    v = valid.float()
    return (values * v).sum((0, 1)) / v.sum((0, 1)).clamp(min=1)


def target_distribution(p: BlockPredictions, batch: BlockBatch, head: Tensor) -> Tensor:
    """The target's own distribution where each draft is verified, ``softmax(head · final[label − 1])``
    over ``head``'s rows. [B, A, γ, S] float32, no grad"""
    with torch.no_grad():
        final = batch.final_hidden
        B, A, G = p.label_pos.shape
        at = (p.label_pos - 1).clamp(min=0).view(B, A * G, 1).expand(-1, -1, final.shape[-1])
        rows = final.gather(1, at).view(B, A, G, -1).to(p.hidden.dtype)
        return F.linear(rows, head.to(p.hidden.dtype)).float().softmax(-1)


def block_loss(model: BlockDraftModel, embed: Embed, head: Tensor, batch: BlockBatch, anchors: Tensor, keep: Tensor,
               gamma: float = 4.0, vocab: Tensor | None = None, kl: bool = False, group: int = 0) -> StepOutput:
    """The DFlash loss over all anchors at once: weighted CE against the sequence's tokens, or with
    ``kl`` forward KL to the target's own distribution there (the sampled answers of a corpus then
    teach the distribution, not one draw of it). ``accept``: the top-1 match rate per position, with
    the sequence's token (CE) or with the target's argmax (KL: what greedy verification accepts)."""
    p = block_predictions(model, embed, head, batch, anchors, keep, gamma, vocab, group)
    if not kl:
        ce = weighted_ce(p, p.logits)
        return StepOutput(ce, {"accept": per_position((p.logits.argmax(-1) == p.labels).float(), p.valid)})
    p_t = target_distribution(p, batch, head)
    div = forward_kl(p.logits, p_t)
    loss = masked_mean(div, p.weight, 1e-6)
    return StepOutput(loss, {"kl": loss.detach(),
                             "accept": per_position((p.logits.argmax(-1) == p_t.argmax(-1)).float(), p.valid)})


@dataclass
class BlockOptions:
    layers: int = 2  # draft decoder layers
    intermediate: int = 1024  # MLP width
    features: int = 3  # target layers read (evenly spaced 1..L-3)
    block: int = 8  # block size (DFlash drafts block − 1 tokens, DSpark block)
    gamma: float = 4.0  # loss decay exp(−(k−1)/γ)
    anchors: int = 32  # anchors (blocks) per sequence and step; 0: every response position (dense)
    eval_anchors: int = 64  # anchors per held-out sequence; 0: every one
    group: int = 32  # blocks per forward (attention grows with anchors × group); 0: all in one
    mask_token_id: int | None = None  # the block's filler token; None: the last id of the vocabulary
    init_std: float = 0.02


class BlockRecipe(Recipe):
    """What DFlash and DSpark share: the backbone built for the target, features, the training
    vocabulary, the feature scale and the checkpoint. Subclasses give :meth:`extra_config` and :meth:`loss`."""

    options: BlockOptions
    model_class: type[BlockDraftModel] = BlockDraftModel

    def layer_ids(self, target: Target) -> list[int]:
        return build_target_layer_ids(target.num_layers, self.options.features)

    def feature_key(self, target: Target) -> str:
        return f"inputs{'_'.join(map(str, layer_output_ids(self.layer_ids(target))))}-final"

    def featurize(self, target: Target, tokens: Tensor) -> dict[str, Tensor]:
        return target_features(target, tokens, layer_output_ids(self.layer_ids(target)))

    def store_needs(self, target: Target) -> StoreNeeds:
        return StoreNeeds(layers=tuple(sorted(layer_output_ids(self.layer_ids(target)))))

    def extra_config(self) -> dict[str, Any]:
        """Config fields beyond the DFlash backbone's."""
        return {}

    def build(self, target: Target | None, data: TrainData) -> nn.Module:
        assert target is not None, "block drafters train for a target"
        o, tc, D = self.options, target.text_config, target.hidden_size
        last = target.layer_specs()[-1]  # draft layers attend to the whole context: a full-attention layer's shapes
        cfg = self.model_class.config_class(
            hidden_size=D, intermediate_size=o.intermediate, num_hidden_layers=o.layers,
            num_attention_heads=last.num_heads, num_key_value_heads=last.num_kv_heads,
            head_dim=last.head_dim or D // last.num_heads, vocab_size=target.vocab_size,
            num_target_layers=target.num_layers, target_layer_ids=self.layer_ids(target),
            mask_token_id=target.vocab_size - 1 if o.mask_token_id is None else o.mask_token_id,
            block_size=o.block, rms_norm_eps=tc.rms_norm_eps, rope_parameters=last.rope_parameters,
            max_position_embeddings=tc.max_position_embeddings, **self.extra_config())
        model = self.model_class(cfg)
        model.init_weights(o.init_std)
        with torch.no_grad():  # start the output norm where the target's is: its LM head expects that scale
            model.norm.weight.copy_(target.final_norm_weight().float())
        vocab = torch.cat([s.tokens for s in data.train]).unique()  # every token the training data uses
        t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        t2d[vocab] = True
        model.set_draft_vocab(t2d)  # trained over these tokens only: draft only these
        # what the loss reads lives with the target (the trainer places it and the model on one device)
        self.target, self.vocab, self.head = target, vocab.to(target.device), head_rows(target, vocab)
        self.scale = self.feature_scale(data).to(target.device)
        return model

    @staticmethod
    def feature_scale(data: TrainData, limit: int = 512) -> Tensor:
        """Per-channel RMS of the training features [m·D] over the first ``limit`` training
        sequences (see the module docstring)."""
        sq, n = 0.0, 0
        for b in data.scan("train", batch=16, limit=limit):
            sq = sq + b.features["features"].float().pow(2).sum((0, 1))
            n += b.num_tokens
        return (sq / n).sqrt().clamp(min=1e-3)

    def block_batch(self, batch: Batch) -> BlockBatch:
        return BlockBatch(batch.tokens, batch.features["features"].float() / self.scale, batch.features["final"].float(),
                          batch.lengths, batch.response_start)

    def embed(self, ids: Tensor) -> Tensor:
        return self.target.embed(ids).float()

    def loss_positions(self, lengths: Tensor, response_start: Tensor) -> Tensor:
        """One first draft per block: a block's position 1 (DFlash), its anchor (DSpark)."""
        return span_positions(*anchor_span(response_start, lengths), self.options.anchors)

    def anchors(self, model: nn.Module, batch: Batch, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        """The blocks' anchors, drawn from the batch's host-side lengths (no device read)."""
        lengths, start = batch.on_host()
        n = self.options.anchors if model.training else self.options.eval_anchors
        return batch_anchors(start, lengths, n, gen, anchor_span, device=batch.tokens.device)

    def save(self, model: nn.Module, out: Path) -> None:
        assert isinstance(model, BlockDraftModel)
        with torch.no_grad():
            model.fc.weight.div_(self.scale)  # fold the feature scaling: the checkpoint reads raw features
        save_block_draft(model, out)

    def load(self, model: nn.Module, folder: Path) -> None:
        """The checkpoint's weights with this run's feature scale unfolded again; the draft vocabulary
        stays this run's (the tokens of its data, which the loss's softmax covers)."""
        assert isinstance(model, BlockDraftModel)
        saved = load_block_draft(folder)
        if type(saved) is not type(model):
            raise ValueError(f"{folder} holds a {type(saved).__name__}, this recipe trains a {type(model).__name__}")
        state = saved.state_dict()
        state["t2d"] = model.t2d
        state["fc.weight"] = state["fc.weight"].to(self.scale.device) * self.scale
        copy_weights(model, state, folder)


@dataclass
class DFlashOptions(BlockOptions):
    loss: str = "ce"  # "ce": on the sequence's tokens; "kl": forward KL to the target's distribution

    def __post_init__(self) -> None:
        if self.loss not in ("ce", "kl"):
            raise ValueError(f"loss must be 'ce' or 'kl', got {self.loss!r}")


class DFlashRecipe(BlockRecipe):
    """A DFlash block drafter for a frozen target."""

    Options = DFlashOptions
    options: DFlashOptions

    def loss(self, model: nn.Module, batch: Batch, gen: torch.Generator) -> StepOutput:
        assert isinstance(model, BlockDraftModel)
        bb = self.block_batch(batch)
        anchors, keep = self.anchors(model, batch, gen)
        return block_loss(model, self.embed, self.head, bb, anchors, keep, self.options.gamma, self.vocab,
                          kl=self.options.loss == "kl", group=self.options.group)

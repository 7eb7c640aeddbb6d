"""Training a Gemma-4-style assistant (``gemma_mtp``) for a frozen target: the unrolled loss and its recipe.

For every training sequence the frozen target gives, once (cached with the data), its post-norm
hidden state, its greedy next token, and the K/V of the cache layer each assistant layer reads
(:func:`specdec.data.store.target_kv`).

Objective (what greedy verification accepts): an anchor token at position ``p`` (in the response)
with the target's hidden state at ``p-1`` predicts the target's argmax after ``p``; then
``unroll - 1`` more steps at the same position, each fed the previous step's ``post_projection``
output and the target's greedy token, predict the target's next argmax. A step's loss counts only
where the text agrees with the target's greedy choices before it (elsewhere its label was
conditioned on another prefix). Step ``j`` is weighted ``decay**j``. Queries attend to the target's
cached K/V strictly before the anchor, exactly as the drafter reads them at inference. The
checkpoint is a bf16 ``gemma4_assistant`` folder (config.json + model.safetensors).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from specdec.drafters.gemma_mtp.drafter import assistant_config, kv_source_layers
from specdec.data.store import StoreNeeds, target_kv
from specdec.target import Target
from specdec.training.data import Batch, TrainData, target_features
from specdec.training.recipe import Recipe, StepOutput, batch_anchors, copy_weights, masked_mean, span_positions

__all__ = ["target_kv", "response_anchors", "unrolled_loss", "GemmaMTPOptions", "GemmaMTPRecipe"]


def response_anchors(batch: Batch, num: int, unroll: int, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Up to ``num`` distinct anchors (0: every one) per row in ``[response_start, length − unroll − 1]`` (every
    unrolled label and the token after it exist), sorted; anchors [B, A], which are real [B, A] and
    the flat indices of the real ones [R], on the batch's device (drawn on the generator's, from the
    batch's host-side lengths: no device read)."""
    lengths, start = batch.on_host()
    anchors, keep = batch_anchors(start, lengths, num, gen, lambda s, n: anchor_span(s, n, unroll),
                                  pad=1)  # padding anchors: any position with a hidden before it
    dev = batch.tokens.device
    return anchors.to(dev), keep.to(dev), keep.flatten().nonzero().squeeze(1).to(dev)


def anchor_span(start: Tensor, length: Tensor, unroll: int) -> tuple[Tensor, Tensor]:
    """Where an anchor may lie: in the response, after a hidden state, with every unrolled label after it."""
    return start.clamp(min=1), length - unroll - 1


def unrolled_loss(assistant: PreTrainedModel, embed: Callable[[Tensor], Tensor], batch: Batch, anchors: Tensor,
                  keep: Tensor, unroll: int, decay: float = 0.8, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The unrolled loss over ``anchors`` [B, A] (``keep`` marks the real ones); returns the loss
    and the top-1 accuracy per step [unroll] (over positions whose text agrees with the target so far),
    on the device. ``rows`` [R]: the flat indices of the real anchors; the head and its softmax over
    the whole vocabulary then run on those alone (the same loss, no cost for padding).
    ``batch.features``: ``final`` [B, T, D], ``argmax`` [B, T], ``k.<type>``/``v.<type>`` [B, T, H, d]."""
    f, tokens = batch.features, batch.tokens
    T = tokens.shape[1]
    hidden, argmax = f["final"].float(), f["argmax"]
    kv = {n[2:]: (f[n].float().transpose(1, 2), f["v" + n[1:]].float().transpose(1, 2)) for n in f if n.startswith("k.")}
    allowed = torch.arange(T, device=tokens.device).view(1, 1, T) < anchors.unsqueeze(-1)  # keys strictly before the anchor
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]  # [B, 1, A, T]
    h = hidden.gather(1, (anchors - 1).unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    x_tok, agree = tokens.gather(1, anchors), keep.clone()
    total, accs = hidden.new_zeros(()), []
    for j in range(unroll):
        label = argmax.gather(1, (anchors + j).clamp(max=T - 1))
        x = assistant.pre_projection(torch.cat([embed(x_tok), h], -1))
        # output_hidden_states keeps transformers from slicing the (independent) queries as a sequence
        y = assistant.model(inputs_embeds=x, attention_mask={t: mask for t in kv}, position_ids=anchors,
                            shared_kv_states=kv, use_cache=False, output_hidden_states=True).last_hidden_state
        yr, lab, ag = y.flatten(0, 1), label.flatten(), agree.flatten()
        if rows is not None:
            yr, lab, ag = yr.index_select(0, rows), lab.index_select(0, rows), ag.index_select(0, rows)
        logits = assistant.lm_head(yr).float()
        ce = F.cross_entropy(logits, lab, reduction="none")
        total = total + decay ** j * masked_mean(ce, ag)
        accs.append(masked_mean((logits.argmax(-1) == lab).float(), ag).detach())
        h, x_tok = assistant.post_projection(y), label
        agree = agree & (tokens.gather(1, (anchors + j + 1).clamp(max=T - 1)) == label)
    return total, torch.stack(accs)


@dataclass
class GemmaMTPOptions:
    hidden: int = 128  # assistant hidden size
    intermediate: int = 512  # assistant MLP width
    unroll: int = 3  # draft steps trained per anchor
    anchors: int = 0  # anchors per sequence and step; 0: every response position (dense)
    decay: float = 0.8  # step j weighs decay**j


class GemmaMTPRecipe(Recipe):
    """A Gemma-4-style assistant (Q-only layers on the target's KV cache) for a frozen target."""

    Options = GemmaMTPOptions
    options: GemmaMTPOptions

    def feature_key(self, target: Target) -> str:
        return "final-argmax-kv" + "_".join(f"{t}{i}" for t, i in sorted(kv_source_layers(target).items()))

    def featurize(self, target: Target, tokens: Tensor) -> dict[str, Tensor]:
        final = target_features(target, tokens, ())["final"]
        out = {"final": final, "argmax": target.logits(final).argmax(-1)}
        for t, (k, v) in target_kv(target, tokens, kv_source_layers(target)).items():
            out[f"k.{t}"], out[f"v.{t}"] = k, v
        return out

    def store_needs(self, target: Target) -> StoreNeeds:
        return StoreNeeds(kv=tuple(sorted(set(kv_source_layers(target).values()))))

    def build(self, target: Target | None, data: TrainData) -> nn.Module:
        assert target is not None, "gemma_mtp trains for a target"
        self.target = target
        config = assistant_config(target, hidden_size=self.options.hidden, intermediate_size=self.options.intermediate)
        return AutoModelForCausalLM.from_config(config)

    def loss_positions(self, lengths: Tensor, response_start: Tensor) -> Tensor:
        return span_positions(*anchor_span(response_start, lengths, self.options.unroll), self.options.anchors)

    def loss(self, model: nn.Module, batch: Batch, gen: torch.Generator) -> StepOutput:
        assert isinstance(model, PreTrainedModel)
        o = self.options
        anchors, keep, rows = response_anchors(batch, o.anchors, o.unroll, gen)
        loss, accs = unrolled_loss(model, lambda ids: self.target.embed(ids).float(), batch, anchors, keep, o.unroll,
                                   o.decay, rows)
        return StepOutput(loss, {"accept": accs})

    def save(self, model: nn.Module, out: Path) -> None:
        assert isinstance(model, PreTrainedModel)
        model.to(torch.bfloat16).save_pretrained(out)

    def load(self, model: nn.Module, folder: Path) -> None:
        saved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True)
        copy_weights(model, saved.state_dict(), folder)

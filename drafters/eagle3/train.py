"""Training-time test (TTT, EAGLE-3 arXiv 2503.01840 §3.2) for one-layer draft heads on target features.

A draft head is trained on what it will meet when drafting: after the first step it reads its own
previous output, not the target's features. For a sequence ``t_0..t_{T-1}`` with target features
``f_i`` (at ``t_i``) and target logits ``z_i`` (predicting ``t_{i+1}``):

    step 0, slot i (every i):   input (emb(t_{i+1}), fc(f_i)) at position i      → predicts z_{i+1}
    step s, anchor a:           input (emb(t_{a+s+1}), y_{s-1}(a)) at position a+s → predicts z_{a+s+1}

Step ``s`` at anchor ``a`` attends to the step-0 slots ``<= a`` (the context, built from target
features) and to its own earlier steps at that anchor: exactly the cache plus the chain of
ancestors that :class:`specdec.drafters.eagle3.drafter.Eagle3Drafter` attends to. Only step 0's keys and
values are needed at every slot (they depend on the inputs alone), so the full layer runs on a
random subset of anchors, which makes training on one CPU thread affordable.

Loss: soft cross-entropy against the target distribution restricted to the draft vocabulary,
``Σ_s 0.8^s · CE_s``; positions whose target argmax lies outside the draft vocabulary are masked,
as are positions before the response (the draft is served on responses).

:class:`Eagle3Recipe` is what the one trainer (:mod:`specdec.training.trainer`) drives: data and
features come from :mod:`specdec.training.data` (the target's own responses, the inputs of layers
``(2, L//2, L-3)`` and the post-norm final hidden state, cached). The draft vocabulary is the
``draft_vocab`` most frequent response tokens of the training sequences (``d2t``/``t2d``); the
embedding is the target's (frozen, not saved). Everything else starts from PyTorch's default
initialisation: starting ``lm_head``/``norm`` from the target's rows learned more slowly in a
25-step comparison (its initial logits are far too large for the random layer below it). The
checkpoint is the speculators format (:func:`~specdec.drafters.eagle3.checkpoint.save_eagle3`, bf16).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.drafters.eagle3.checkpoint import load_eagle3, save_eagle3
from specdec.drafters.eagle3.model import Eagle3Model, Eagle3Spec, default_layer_ids, draft_layer_config, vocab_map
from specdec.draft_vocab import token_counts
from specdec.data.store import StoreNeeds
from specdec.target import Target
from specdec.training.data import Batch, FeatureSeq, TrainData, target_features
from specdec.training.recipe import Recipe, StepOutput, copy_weights, draw_anchors, head_rows

__all__ = ["sample_anchors", "TTTResult", "ttt_loss", "Eagle3Options", "Eagle3Recipe"]


def sample_anchors(seq: FeatureSeq, n: int, gen: torch.Generator) -> Tensor:
    """Up to ``n`` distinct anchors whose first prediction is a response token, sorted. [A]"""
    return draw_anchors(max(0, seq.response_start - 2), seq.tokens.numel() - 2, n, gen)  # slot a needs t_{a+1}


@dataclass
class TTTResult:
    loss: Tensor
    correct: list[int]  # per step: draft argmax == target argmax, over counted positions
    counted: list[int]  # per step: positions in the loss
    chain: list[int]  # per step s: anchors counted at step 0 whose steps 0..s all match (what decoding accepts)
    logits: list[Tensor]  # per step: draft logits over the draft vocabulary [A, Vd]


def ttt_loss(model: nn.Module, embed: Callable[[Tensor], Tensor], head: Tensor, in_draft: Tensor, seq: FeatureSeq,
             anchors: Tensor, steps: int = 7, decay: float = 0.8) -> TTTResult:
    """The TTT loss of an :class:`~specdec.drafters.eagle3.model.Eagle3Model` on one sequence.

    ``head`` [Vd, D] holds the target's LM-head rows of the draft vocabulary (in draft-id order),
    ``in_draft`` [V] is ``t2d``; ``anchors`` [A] from :func:`sample_anchors`.
    """
    T, dt = seq.tokens.numel(), model.fc.weight.dtype
    layer, tokens, dev = model.layers[0], seq.tokens, seq.tokens.device
    anchors = anchors.to(dev)  # drawn on the CPU generator; every index below lives with the batch
    # step 0 at every slot i < T-1: keys and values of the context
    g0 = model.fuse(seq.features[: T - 1].unsqueeze(0))
    emb0 = embed(tokens[1:T].unsqueeze(0)).to(dt)
    cos, sin = model.rope(g0, torch.arange(T - 1, device=dev).unsqueeze(0))
    q0, k0, v0, res0 = layer.qkv(emb0, g0, cos, sin)
    A = anchors.numel()
    ctx = torch.arange(T - 1, device=dev).unsqueeze(0) <= anchors.unsqueeze(1)  # [A, T-1]
    q, res = q0[:, :, anchors], res0[:, anchors]
    keys, values, diag = [k0], [v0], []
    total = g0.new_zeros(())
    correct, counted, chain, all_logits = [], [], [], []
    alive = None  # [A] anchors whose every step so far matched
    y = None
    for s in range(steps):
        if s > 0:
            idx = anchors + s + 1  # input token index
            emb = embed(tokens[idx.clamp(max=T - 1)].unsqueeze(0)).to(dt)
            g = model.carry(y)  # step s reads step s-1's output as decoding does
            cos, sin = model.rope(g, (anchors + s).unsqueeze(0))
            q, k, v, res = layer.qkv(emb, g, cos, sin)
            keys.append(k)
            values.append(v)
            diag.append(torch.eye(A, dtype=torch.bool, device=dev))
        allowed = torch.cat([ctx, *diag], dim=1).unsqueeze(0)  # [1, A, T-1 + s·A]
        attn = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2),
                                              attn_mask=allowed.unsqueeze(1), enable_gqa=q.shape[1] != k0.shape[1])
        y = layer.finish(attn, res)
        logits = model.lm_head(model.norm(y))[0].float()  # [A, Vd]
        pos = anchors + s + 1  # target logits z_pos are the label
        valid = (pos <= T - 1) & (pos + 1 >= seq.response_start)
        # responses are the target's greedy tokens: its argmax at pos is t_{pos+1}
        valid = valid & (in_draft[tokens[(pos + 1).clamp(max=T - 1)]] | (pos == T - 1))
        with torch.no_grad():
            z = seq.final[pos.clamp(max=T - 1)].float() @ head.T  # [A, Vd]
            p = z.softmax(-1)
        ce = -(p * logits.log_softmax(-1)).sum(-1)
        n = int(valid.sum())
        if n:
            total = total + decay ** s * (ce * valid).sum() / n
        match = (logits.argmax(-1) == z.argmax(-1)) & valid
        correct.append(int(match.sum()))
        counted.append(n)
        alive = match if alive is None else alive & match
        chain.append(int(alive.sum()))
        all_logits.append(logits)
    return TTTResult(total, correct, counted, chain, all_logits)


@dataclass
class Eagle3Options:
    draft_vocab: int = 8192  # the most frequent response tokens of the training data
    ttt_steps: int = 7  # training-time-test depth
    anchors: int = 64  # TTT anchors per sequence and step
    eval_anchors: int = 128  # anchors per held-out sequence
    decay: float = 0.8  # step s weighs decay**s
    layer_ids: list[int] | None = None  # target layer inputs fused; None: EAGLE-3's (2, L//2, L-3)
    verifier: str = ""  # the target as the speculators config names it (a hub id or a path)
    fc_norm: bool = False  # EAGLE-3.1: one RMSNorm per fused feature before fc
    norm_output: bool = False  # EAGLE-3.1: each TTT step (and draft step) reads the previous one's norm(y)


class Eagle3Recipe(Recipe):
    """An EAGLE-3 head for a frozen target, trained with the training-time test."""

    Options = Eagle3Options
    options: Eagle3Options

    def layer_ids(self, target: Target) -> tuple[int, ...]:
        return tuple(self.options.layer_ids or default_layer_ids(target.num_layers))

    def feature_key(self, target: Target) -> str:
        return f"inputs{'_'.join(map(str, self.layer_ids(target)))}-final"

    def featurize(self, target: Target, tokens: Tensor) -> dict[str, Tensor]:
        return target_features(target, tokens, self.layer_ids(target))

    def store_needs(self, target: Target) -> StoreNeeds:
        return StoreNeeds(layers=tuple(sorted(self.layer_ids(target))))

    def build(self, target: Target | None, data: TrainData) -> nn.Module:
        assert target is not None, "eagle3 trains for a target"
        d2t, t2d = vocab_map(token_counts(data.train, target.vocab_size), self.options.draft_vocab)
        o = self.options
        spec = Eagle3Spec(self.layer_ids(target), target.hidden_size, o.draft_vocab, norm_before_residual=True,
                          fc_norm=o.fc_norm, norm_output=o.norm_output)
        model = Eagle3Model(draft_layer_config(target), spec)
        with torch.no_grad():
            model.d2t.copy_(d2t)
            model.t2d.copy_(t2d)
        self.target = target
        self.head = head_rows(target, model.draft_ids)  # the target's logits over the draft vocabulary
        return model

    def loss(self, model: nn.Module, batch: Batch, gen: torch.Generator) -> StepOutput:
        assert isinstance(model, Eagle3Model)
        o = self.options
        n_anchors = o.anchors if model.training else o.eval_anchors
        B = batch.tokens.shape[0]
        total, correct, counted = torch.zeros((), device=batch.tokens.device), [0] * o.ttt_steps, [0] * o.ttt_steps
        chain = [0] * o.ttt_steps
        for b in range(B):
            seq = batch.feature_seq(b)
            r = ttt_loss(model, lambda ids: self.target.embed(ids).float(), self.head, model.t2d, seq,
                         sample_anchors(seq, n_anchors, gen), o.ttt_steps, o.decay)
            total = total + r.loss / B
            correct = [a + c for a, c in zip(correct, r.correct)]
            counted = [a + c for a, c in zip(counted, r.counted)]
            chain = [a + c for a, c in zip(chain, r.chain)]
        # accept: each step on its own, given the true tokens before it; chain: the first s+1 steps all
        # right, per anchor counted at step 0 (close to what decoding accepts at depth s+1; the other
        # counts deep steps decoding never reaches: experiments/benchmarks/eagle3_chain_estimate.py)
        return StepOutput(total, {"accept": [c / max(1, n) for c, n in zip(correct, counted)],
                                  "chain": [c / max(1, counted[0]) for c in chain]})

    def save(self, model: nn.Module, out: Path) -> None:
        assert isinstance(model, Eagle3Model)
        save_eagle3(model, out, verifier=self.options.verifier)

    def load(self, model: nn.Module, folder: Path) -> None:
        """The checkpoint's weights and its draft vocabulary (its head rows follow that vocabulary)."""
        assert isinstance(model, Eagle3Model)
        copy_weights(model, load_eagle3(folder, self.target.num_layers).state_dict(), folder)
        self.head = head_rows(self.target, model.draft_ids)

"""Training-time test (TTT, EAGLE-3 arXiv 2503.01840 §3.2) for one-layer draft heads on target features.

A draft head is trained on what it will meet when drafting: after the first step it reads its own
previous output, not the target's features. For a sequence ``t_0..t_{T-1}`` with target features
``f_i`` (at ``t_i``) and target logits ``z_i`` (predicting ``t_{i+1}``):

    step 0, slot i (every i):   input (emb(t_{i+1}), fc(f_i)) at position i      → predicts z_{i+1}
    step s, anchor a:           input (emb(t_{a+s+1}), y_{s-1}(a)) at position a+s → predicts z_{a+s+1}

Step ``s`` at anchor ``a`` attends to the step-0 slots ``<= a`` (the context, built from target
features) and to its own earlier steps at that anchor: exactly the cache plus the chain of
ancestors that :class:`specdec.drafters.eagle3.drafter.Eagle3Drafter` attends to.

:func:`batched_ttt_loss` (what the recipe runs) takes every response position of every row as an
anchor, in one pass per step: the queries of step ``s`` attend to the context keys (causal) plus
that step's diagonal (the keys their own steps ``1..s`` produced), one mask for the whole batch,
as SpecForge and speculators train; every target token read is a loss position. ``anchors: N``
keeps the earlier option of ``N`` sampled anchors per row. :func:`ttt_loss` is the same loss for
one sequence and given anchors, the reference the batched one is tested against.

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
from specdec.drafters.layers import attend
from specdec.training.recipe import (Recipe, StepOutput, batch_anchors, copy_weights, draw_anchors, head_rows,
                                     span_positions)

__all__ = ["sample_anchors", "TTTResult", "ttt_loss", "ttt_keys_allowed", "BatchTTT", "batched_ttt_loss",
           "Eagle3Options", "Eagle3Recipe"]


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


def ttt_keys_allowed(slots: Tensor, n_ctx: int, steps: int) -> Tensor:
    """Which keys each TTT query may read, for every step at once: query ``q`` (at context slot
    ``slots[..., q]``) sees the context keys ``j <= slot`` (causal) and, at step ``s``, the keys of
    steps ``1..s`` at its own query (the diagonal). Keys are laid out ``[K_0 (n_ctx), K_1 (Q), ...,
    K_{steps-1} (Q)]``; step ``s`` reads the first ``n_ctx + s·Q`` columns. slots [R, Q] → [R, Q, n_ctx + (steps−1)·Q]"""
    Q, dev = slots.shape[-1], slots.device
    ctx = torch.arange(n_ctx, device=dev) <= slots.unsqueeze(-1)  # [R, Q, n_ctx]
    diag = torch.eye(Q, dtype=torch.bool, device=dev).repeat(1, steps - 1).expand(*slots.shape[:-1], Q, -1)
    return torch.cat([ctx, diag], -1)


_compiled_flex = None


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, slots: Tensor, n_ctx: int) -> Tensor:
    """:func:`ttt_keys_allowed`'s attention through ``flex_attention`` with a block mask: on CUDA
    compiled (fused, nothing of the mask materialised), elsewhere eager (forward only, for tests)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _compiled_flex
    R, Q, S = slots.shape[0], q.shape[2], k.shape[2]
    rows = slots.expand(q.shape[0], -1) if R == 1 else slots

    def allowed(b, h, qi, ki):  # noqa: ANN001 (flex's index tensors)
        return torch.where(ki < n_ctx, ki <= rows[b, qi], (ki - n_ctx) % Q == qi)

    mask = create_block_mask(allowed, q.shape[0], None, Q, S, device=q.device)
    fn = flex_attention
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        fn = _compiled_flex
    return fn(q, k.to(q.dtype), v.to(q.dtype), block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def split_attention(q: Tensor, k0: Tensor, v0: Tensor, diag_k: list[Tensor], diag_v: list[Tensor],
                    ctx_allowed: Tensor) -> Tensor:
    """:func:`ttt_keys_allowed`'s attention computed by its structure: scores against the context
    keys under the causal mask, plus one score per earlier step against the query's own diagonal
    key, softmaxed together. [Q, N] + s scores per query instead of the dense mask's [Q, N + s·Q].
    q [B, H, Q, hd], k0/v0 [B, Hkv, N, hd], diag_k/diag_v s × [B, Hkv, Q, hd], ctx_allowed [R, Q, N]
    → [B, H, Q, hd]."""
    B, H, Q, hd = q.shape
    Hkv = k0.shape[1]
    qg = q.view(B, Hkv, H // Hkv, Q, hd) * hd ** -0.5  # each KV head serves a group of query heads
    ctx = (qg @ k0.to(q.dtype).unsqueeze(2).transpose(-1, -2)).float()  # [B, Hkv, g, Q, N]
    ctx = ctx.masked_fill(~ctx_allowed.view(-1, 1, 1, Q, ctx.shape[-1]), float("-inf"))
    diag = [(qg * k.to(q.dtype).unsqueeze(2)).sum(-1, keepdim=True).float() for k in diag_k]  # s × [B, Hkv, g, Q, 1]
    p = torch.cat([ctx, *diag], -1).softmax(-1)
    N = ctx.shape[-1]
    out = p[..., :N].to(q.dtype) @ v0.to(q.dtype).unsqueeze(2)
    for r, v in enumerate(diag_v):
        out = out + p[..., N + r: N + r + 1].to(q.dtype) * v.to(q.dtype).unsqueeze(2)
    return out.view(B, H, Q, hd)


@dataclass
class BatchTTT:
    loss: Tensor  # Σ_s decay^s · (per-row mean CE at step s), averaged over the rows
    correct: Tensor  # [steps] positions whose step-s argmax matches the target's, over counted ones (device)
    counted: Tensor  # [steps] positions in the loss
    chain: Tensor  # [steps] positions counted at step 0 whose steps 0..s all match
    logits: list[Tensor]  # per step [B, Q, Vd] over the draft vocabulary


def batched_ttt_loss(model: nn.Module, embed: Callable[[Tensor], Tensor], head: Tensor, in_draft: Tensor,
                     batch: Batch, slots: Tensor | None = None, steps: int = 7, decay: float = 0.8,
                     attention: str = "split", keep: Tensor | None = None) -> BatchTTT:
    """:func:`ttt_loss` for a whole batch in one pass: every row, every TTT step, and (``slots`` None)
    every context slot as an anchor. Per step ``s`` all queries attend to the context keys (causal)
    plus that step's diagonal (the keys their own steps 1..s produced), as SpecForge and speculators
    train. ``slots`` [B, A] restricts steps' queries to sampled anchors (sorted, in range); the
    loss and figures then equal :func:`ttt_loss` per row at those anchors (``keep`` [B, A] marks
    the real ones where a row has fewer). ``attention``, one semantics three ways: ``split``
    (:func:`split_attention`: context and diagonal scores apart), ``sdpa`` (one dense boolean mask
    per batch shape) or ``flex`` (``flex_attention``'s block mask; compiled on CUDA). Nothing is read
    back to the host."""
    tokens, lengths, start = batch.tokens, batch.lengths, batch.response_start
    B, T = tokens.shape
    N, dt, dev = T - 1, model.fc.weight.dtype, tokens.device
    layer = model.layers[0]
    g0 = model.fuse(batch.features["features"][:, :N])
    emb0 = embed(tokens[:, 1:]).to(dt)
    ctx_pos = torch.arange(N, device=dev)
    cos, sin = model.rope(g0, ctx_pos.unsqueeze(0).expand(B, -1))
    q0, k0, v0, res0 = layer.qkv(emb0, g0, cos, sin)
    if slots is None:
        anchors = ctx_pos.unsqueeze(0)  # [1, N]: every slot, the same for every row
        q, res = q0, res0
    else:
        anchors = slots.to(dev)
        q = q0.gather(2, anchors[:, None, :, None].expand(-1, q0.shape[1], -1, q0.shape[3]))
        res = res0.gather(1, anchors.unsqueeze(-1).expand(-1, -1, res0.shape[-1]))
    Q = anchors.shape[1]
    allowed = ttt_keys_allowed(anchors, N, steps).unsqueeze(1) if attention == "sdpa" else None  # [R, 1, Q, S]
    ctx_allowed = torch.arange(N, device=dev) <= anchors.unsqueeze(-1) if attention == "split" else None
    with torch.no_grad():  # the target's distribution at every position, once for all steps
        z_all = F.linear(batch.features["final"].to(head.dtype), head).float()  # [B, T, Vd]
        p_all = z_all.softmax(-1)
        z_arg = z_all.argmax(-1)  # [B, T]
    L, rs = lengths.view(B, 1), start.view(B, 1)
    keys, values = [k0], [v0]
    total = g0.new_zeros((), dtype=torch.float32)
    correct, counted, chain, all_logits = [], [], [], []
    alive, y = None, None
    for s in range(steps):
        if s > 0:
            idx = (anchors + s + 1).clamp(max=T - 1).expand(B, -1)  # input token index
            emb = embed(tokens.gather(1, idx)).to(dt)
            g = model.carry(y)  # step s reads step s-1's output as decoding does
            cos, sin = model.rope(g, (anchors + s).expand(B, -1))
            q, k, v, res = layer.qkv(emb, g, cos, sin)
            keys.append(k)
            values.append(v)
        if attention == "split":
            attn = split_attention(q, k0, v0, keys[1:], values[1:], ctx_allowed)
        elif attention == "flex":
            attn = _flex_attention(q, torch.cat(keys, 2), torch.cat(values, 2), anchors, N)
        else:
            kk, vv = torch.cat(keys, 2), torch.cat(values, 2)
            attn = attend(q, kk, vv, allowed[..., : N + s * Q].squeeze(1).expand(B, -1, -1))
        y = layer.finish(attn, res)
        logits = model.lm_head(model.norm(y)).float()  # [B, Q, Vd]
        pos = (anchors + s + 1).expand(B, -1)  # the target's logits at pos are the label
        safe = pos.clamp(max=T - 1)
        nxt = tokens.gather(1, (pos + 1).clamp(max=T - 1))
        # responses are the target's greedy tokens: its argmax at pos is t_{pos+1}
        # anchors are the slots whose first prediction is in the response (those of sample_anchors)
        valid = (pos <= L - 1) & (anchors >= rs - 2) & (pos + 1 >= rs) & (in_draft[nxt] | (pos == L - 1))
        if keep is not None:
            valid = valid & keep
        p = p_all.gather(1, safe.unsqueeze(-1).expand(-1, -1, p_all.shape[-1]))
        ce = -(p * logits.log_softmax(-1)).sum(-1)  # [B, Q]
        n = valid.sum(1)
        total = total + decay ** s * ((ce * valid).sum(1) / n.clamp(min=1)).mean()
        # right: the target's argmax scores highest (argmax up to exact ties; a max is the cheaper pass)
        match = (logits.gather(-1, z_arg.gather(1, safe).unsqueeze(-1)) >= logits.amax(-1, keepdim=True)).squeeze(-1)
        match = match & valid
        alive = match if alive is None else alive & match
        correct.append(match.sum())
        counted.append(n.sum())
        chain.append(alive.sum())
        all_logits.append(logits)
    return BatchTTT(total, torch.stack(correct), torch.stack(counted), torch.stack(chain), all_logits)


@dataclass
class Eagle3Options:
    draft_vocab: int = 8192  # the most frequent response tokens of the training data
    ttt_steps: int = 7  # training-time-test depth
    anchors: int = 0  # TTT anchors per sequence: 0 every response position (dense); N: N sampled ones
    eval_anchors: int = 0  # the same for held-out sequences
    # "split": context and diagonal scores apart (the fastest measured on a CPU); "sdpa": SDPA with a
    # dense boolean mask per batch shape; "flex": flex_attention's block mask (compiled on CUDA)
    attention: str = "split"
    decay: float = 0.8  # step s weighs decay**s
    layer_ids: list[int] | None = None  # target layer inputs fused; None: EAGLE-3's (2, L//2, L-3)
    verifier: str = ""  # the target as the speculators config names it (a hub id or a path)
    fc_norm: bool = False  # EAGLE-3.1: one RMSNorm per fused feature before fc
    norm_output: bool = False  # EAGLE-3.1: each TTT step (and draft step) reads the previous one's norm(y)

    def __post_init__(self) -> None:
        if self.attention not in ("split", "sdpa", "flex"):
            raise ValueError(f"attention must be 'split', 'sdpa' or 'flex', got {self.attention!r}")
        if self.anchors < 0 or self.eval_anchors < 0 or self.ttt_steps < 1:
            raise ValueError("anchors and eval_anchors must be >= 0 (0: every position), ttt_steps >= 1")


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

    @staticmethod
    def _span(start: Tensor, length: Tensor) -> tuple[Tensor, Tensor]:
        """The slots whose first prediction is a response token (slot a reads t_{a+1}, predicts t_{a+2}'s logits)."""
        return (start - 2).clamp(min=0), length - 2

    def loss_positions(self, lengths: Tensor, response_start: Tensor) -> Tensor:
        lo, hi = self._span(response_start, lengths)
        return span_positions(lo, hi, self.options.anchors)

    def loss(self, model: nn.Module, batch: Batch, gen: torch.Generator) -> StepOutput:
        assert isinstance(model, Eagle3Model)
        o = self.options
        n = o.anchors if model.training else o.eval_anchors
        # every slot of each row's response range (n = 0), or n sampled ones; padding marked by keep
        lengths, start = batch.on_host()
        slots, keep = batch_anchors(start, lengths, n, gen, self._span, device=batch.tokens.device)
        r = batched_ttt_loss(model, lambda ids: self.target.embed(ids).float(), self.head, model.t2d, batch, slots,
                             o.ttt_steps, o.decay, o.attention, keep)
        # accept: each step on its own, given the true tokens before it; chain: the first s+1 steps all
        # right, per position counted at step 0 (close to what decoding accepts at depth s+1; the other
        # counts deep steps decoding never reaches: experiments/benchmarks/eagle3_chain_estimate.py)
        counted = r.counted.float()
        return StepOutput(r.loss, {"accept": r.correct / counted.clamp(min=1),
                                   "chain": r.chain / counted[0].clamp(min=1)})

    def save(self, model: nn.Module, out: Path) -> None:
        assert isinstance(model, Eagle3Model)
        save_eagle3(model, out, verifier=self.options.verifier)

    def load(self, model: nn.Module, folder: Path) -> None:
        """The checkpoint's weights and its draft vocabulary (its head rows follow that vocabulary)."""
        assert isinstance(model, Eagle3Model)
        copy_weights(model, load_eagle3(folder, self.target.num_layers).state_dict(), folder)
        self.head = head_rows(self.target, model.draft_ids)

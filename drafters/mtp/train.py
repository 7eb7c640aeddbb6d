"""DeepSeek-V3's multi-token-prediction loss (arXiv 2412.19437 §2.2) and its two recipes.

Depth ``d`` at slot ``i`` reads ``emb(t_{i+d})`` and depth ``d-1``'s representation at slot ``i``
(depth 0: the main model's post-norm final hidden state) and predicts ``t_{i+d+1}``:

    L = CE_main + λ/D · Σ_d CE_d

- :class:`PostHocMTPRecipe`: MTP modules for a frozen target that has none (only the MTP loss).
  ``eh_proj`` starts as ``[0 | I]``, so a module first echoes the target's own prediction. Saved as
  ``model.layers.{L+d}.*`` plus the target's config with ``num_nextn_predict_layers``. Options
  ``loss: kl`` (forward KL to the target's own distribution instead of CE on the corpus's tokens)
  and ``token_map``/``draft_vocab`` (both softmaxes over the drafter's draft vocabulary: the head
  is most of a step's cost, and the drafter drafts over those ids anyway).
- :class:`JointMTPRecipe`: a small DeepSeek-V3 (MLA + MoE) trained from scratch jointly with its
  ``D`` modules, on offline text (``data.source: stdlib``, a BPE tokenizer trained on the training
  files). Saved in the real DeepSeek-V3 layout: ``config.json`` with ``num_nextn_predict_layers``,
  bf16 ``model.safetensors`` with the main model in transformers' layout plus the modules at
  ``model.layers.{L}`` … ``{L+D-1}``, and the tokenizer files.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.draft_vocab import draft_vocabulary, vocab_positions
from specdec.drafters.mtp.checkpoint import load_mtp_modules, save_mtp_checkpoint
from specdec.drafters.mtp.drafter import build_mtp_modules
from specdec.target import Target
from specdec.training.data import Batch, TrainData, target_features
from specdec.training.recipe import Recipe, StepOutput, copy_weights, forward_kl, head_rows, masked_mean
from specdec.validate import as_int

__all__ = ["MTPLoss", "mtp_loss", "label_mask", "depth1_positions", "PostHocMTPOptions", "PostHocMTPRecipe", "JointMTPOptions",
           "JointMTPRecipe", "TINY_DEEPSEEK_V3"]

# Sized so that bf16 weights (main + 2 MTP modules) stay well under 30 MB: ~8.5M parameters.
TINY_DEEPSEEK_V3: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.0,
    q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    max_position_embeddings=2048, tie_word_embeddings=False, rope_interleave=True,
)

Fn = Callable[[Tensor], Tensor]


@dataclass
class MTPLoss:
    loss: Tensor
    main_ce: Tensor  # 0-d, detached, on the device (0 without a main loss)
    mtp_ce: Tensor  # [D] per depth (the KL under ``kl``)
    main_acc: Tensor
    mtp_acc: Tensor  # [D] top-1 accuracy per depth (agreement with the target's argmax under ``kl``)


def label_mask(batch: Batch) -> Tensor:
    """Which tokens count as labels [B, T]: inside the row and in the response (all of plain text)."""
    return label_rows(batch.lengths, batch.response_start, batch.tokens.shape[1])


def label_rows(lengths: Tensor, response_start: Tensor, T: int) -> Tensor:
    """:func:`label_mask` from the lengths and response starts, on their device (the host's: no device read)."""
    pos = torch.arange(T, device=lengths.device).unsqueeze(0)
    return (pos < lengths.unsqueeze(1)) & (pos >= response_start.unsqueeze(1))


def _ce(logits: Tensor, labels: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Masked mean cross-entropy and top-1 accuracy of logits [B, n, V] against labels [B, n]."""
    logits = logits.float()  # one copy for the loss and the argmax (a bf16 argmax is the slower on a CPU)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    return masked_mean(ce, mask), masked_mean((logits.argmax(-1) == labels).float(), mask).detach()


def _kl(logits: Tensor, p: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Masked mean forward KL(p ‖ softmax(logits)) over [B, n, V], and how often the two argmaxes
    agree (what greedy verification accepts)."""
    kl = forward_kl(logits, p)
    return masked_mean(kl, mask), masked_mean((logits.argmax(-1) == p.argmax(-1)).float(), mask).detach()


def mtp_loss(tokens: Tensor, hidden: Tensor, modules: nn.ModuleList, embed: Fn, head: Fn,
             rotary: Callable[[Tensor, Tensor], Any], mask: Tensor, lam: float = 0.3,
             main_logits: Tensor | None = None, chain_hidden: str = "normed", kl: bool = False,
             vocab_index: Tensor | None = None, host_mask: Tensor | None = None) -> MTPLoss:
    """DeepSeek-V3's main + MTP loss on ``tokens`` [B, T] whose post-norm final hidden state is
    ``hidden`` [B, T, D]; ``mask`` [B, T] marks the tokens that count as labels. ``main_logits``
    [B, T, V] adds the main CE (None: a frozen target, MTP loss only).

    ``kl``: each depth's label is the frozen target's own distribution there, ``softmax(head(hidden))``
    one slot earlier, not the sequence's token (forward KL, as speculators and SpecForge train
    drafters; the sampled thirds of a corpus then teach the distribution, not one draw of it).
    ``vocab_index`` [V]: where ``head`` gives logits over a draft vocabulary only, each token's
    place in it (-1 outside); CE labels outside it do not count. ``host_mask``: ``mask`` on the host;
    the head (and with ``kl`` the target's distribution) then runs on the label rows only (their
    indices found on the host, no device read): prompts and padding cost no head, the loss is the same."""
    T, D = hidden.shape[1], len(modules)
    total = hidden.new_zeros((), dtype=torch.float32)
    main_ce = main_acc = total.detach()
    if main_logits is not None:
        ce, main_acc = _ce(main_logits[:, :-1], tokens[:, 1:], mask[:, 1:])
        total, main_ce = total + ce, ce.detach()
    if kl and host_mask is None:  # the target's distribution after every slot, once for all depths
        with torch.no_grad():
            target_p = head(hidden).float().softmax(-1)
    prev, ces, accs = hidden, [], []
    for d, module in enumerate(modules, start=1):
        n = T - d - 1  # slots 0..T-d-2 have a label t_{i+d+1}
        pos = torch.arange(d, d + n, device=tokens.device).unsqueeze(0).expand(tokens.shape[0], -1)
        emb = embed(tokens[:, d: d + n])
        residual, normed = module(emb, prev[:, :n], rotary(emb, pos), pos)  # no mask: causal
        m, labels = mask[:, d + 1: d + 1 + n], tokens[:, d + 1: d + 1 + n]
        if host_mask is None:
            logits = head(normed)
            p = target_p[:, d: d + n] if kl else None
        else:  # the label rows alone, as one row of R positions
            idx = host_mask[:, d + 1: d + 1 + n].flatten().nonzero().squeeze(1).to(tokens.device)
            logits = head(normed.flatten(0, 1).index_select(0, idx)).unsqueeze(0)
            labels = labels.flatten().index_select(0, idx).unsqueeze(0)
            m = torch.ones_like(labels, dtype=torch.bool)
            if kl:
                with torch.no_grad():
                    p = head(hidden[:, d: d + n].flatten(0, 1).index_select(0, idx)).float().softmax(-1).unsqueeze(0)
        if kl:
            ce, acc = _kl(logits, p, m)
        else:
            if vocab_index is not None:
                labels = vocab_index[labels]
                m = m & (labels >= 0)
                labels = labels.clamp(min=0)
            ce, acc = _ce(logits, labels, m)
        ces.append(ce.detach())
        accs.append(acc)
        total = total + lam / D * ce
        prev = normed if chain_hidden == "normed" else residual
    return MTPLoss(total, main_ce, torch.stack(ces), main_acc, torch.stack(accs))


def depth1_positions(lengths: Tensor, response_start: Tensor) -> Tensor:
    """MTP's loss positions at depth 1: every label ``t_{i+2}`` in the response (slot ``i`` reads
    ``t_{i+1}`` and the hidden state at ``i``). [B]"""
    return (lengths - response_start.clamp(min=2)).clamp(min=0)


def _step_output(r: MTPLoss, joint: bool, kl: bool = False) -> StepOutput:
    metrics: dict[str, Any] = {"mtp_kl" if kl else "mtp_ce": r.mtp_ce, "accept": r.mtp_acc}
    if joint:
        metrics.update(main_ce=r.main_ce, main_acc=r.main_acc)
    return StepOutput(r.loss, metrics)


@dataclass
class PostHocMTPOptions:
    depth: int = 1  # MTP modules D
    lam: float = 0.3  # MTP loss weight λ
    loss: str = "ce"  # "ce": DeepSeek-V3's, on the sequence's tokens; "kl": forward KL to the target's distribution
    token_map: str = ""  # softmaxes over this token map's ids only (specdec.draft_vocab), as the drafter drafts
    draft_vocab: int = 0  # ... its first this many (0: all)
    init_layer: str = "random"  # "random": as the target initialises; "last": a copy of the target's last layer

    def __post_init__(self) -> None:
        if self.loss not in ("ce", "kl"):
            raise ValueError(f"loss must be 'ce' or 'kl', got {self.loss!r}")
        if self.init_layer not in ("random", "last"):
            raise ValueError(f"init_layer must be 'random' or 'last', got {self.init_layer!r}")
        if not isinstance(self.token_map, str):
            raise TypeError(f"token_map must be a token map file's path, got {type(self.token_map).__name__}")
        as_int("draft_vocab", self.draft_vocab, minimum=0)
        if self.draft_vocab and not self.token_map:
            raise ValueError(f"draft_vocab={self.draft_vocab} needs a token_map (the ranked ids it takes the first of)")


class PostHocMTPRecipe(Recipe):
    """MTP modules for a frozen target that has none."""

    Options = PostHocMTPOptions
    options: PostHocMTPOptions

    def feature_key(self, target: Target) -> str:
        return "final"

    def featurize(self, target: Target, tokens: Tensor) -> dict[str, Tensor]:
        return target_features(target, tokens, ())

    def build(self, target: Target | None, data: TrainData) -> nn.Module:
        assert target is not None, "post-hoc MTP trains for a target"
        modules = build_mtp_modules(target, self.options.depth).float()
        H = target.hidden_size
        with torch.no_grad():  # warm start: x = hnorm(h), so the module first predicts what the target does
            for m in modules:
                m.eh_proj.weight.zero_()
                m.eh_proj.weight[:, H:] = torch.eye(H, device=m.eh_proj.weight.device)
                if self.options.init_layer == "last":  # the lever: start where the target's own last layer is
                    m.mtp_block.load_state_dict({k: v.float() for k, v in target.layer_weights(-1).items()})
        o = self.options
        vocab = draft_vocabulary(o.token_map or None, o.draft_vocab, target.vocab_size)
        self.target, self.head, self.vocab_index = target, head_rows(target, vocab), None
        if vocab is not None:
            self.vocab_index = vocab_positions(vocab, target.vocab_size)
        return modules

    def loss_positions(self, lengths: Tensor, response_start: Tensor) -> Tensor:
        return depth1_positions(lengths, response_start)

    def loss(self, model: nn.Module, batch: Batch, gen: torch.Generator) -> StepOutput:
        assert isinstance(model, nn.ModuleList)
        t = self.target
        r = mtp_loss(batch.tokens, batch.features["final"].float(), model, lambda ids: t.embed(ids).float(),
                     lambda h: F.linear(h, self.head), t.rotary, label_mask(batch), self.options.lam,
                     kl=self.options.loss == "kl", vocab_index=self.vocab_index,
                     host_mask=label_rows(*batch.on_host(), batch.tokens.shape[1]))
        return _step_output(r, joint=False, kl=self.options.loss == "kl")

    def save(self, model: nn.Module, out: Path) -> None:
        assert isinstance(model, nn.ModuleList)
        cfg = self.target.config.to_dict()
        cfg.update(num_nextn_predict_layers=self.options.depth)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        save_mtp_checkpoint(model, out / "model.safetensors", self.target.num_layers)

    def load(self, model: nn.Module, folder: Path) -> None:
        copy_weights(model, load_mtp_modules(self.target, folder).state_dict(), folder)


@dataclass
class JointMTPOptions:
    depth: int = 2  # MTP modules D
    lam: float = 0.3  # MTP loss weight λ (DeepSeek-V3: 0.3, then 0.1)
    model: dict[str, Any] = field(default_factory=lambda: dict(TINY_DEEPSEEK_V3))  # DeepseekV3Config fields


class JointMTPRecipe(Recipe):
    """A DeepSeek-V3 trained from scratch with its own MTP modules (``target: null``)."""

    Options = JointMTPOptions
    options: JointMTPOptions

    def build(self, target: Target | None, data: TrainData) -> nn.Module:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        tok = data.tokenizer
        eos = tok.eos_token_id
        config = DeepseekV3Config(vocab_size=len(tok), num_nextn_predict_layers=self.options.depth, bos_token_id=eos,
                                  eos_token_id=eos, pad_token_id=eos, **self.options.model)
        config._attn_implementation = "sdpa"
        main = DeepseekV3ForCausalLM(config)
        self.tokenizer, self.seam = tok, Target(main)  # the seam of the model being trained (embed, logits, rotary)
        return nn.ModuleDict({"main": main, "mtp": build_mtp_modules(self.seam, self.options.depth).float()})

    def loss_positions(self, lengths: Tensor, response_start: Tensor) -> Tensor:
        return depth1_positions(lengths, response_start)

    def loss(self, model: nn.Module, batch: Batch, gen: torch.Generator) -> StepOutput:
        assert isinstance(model, nn.ModuleDict)
        s = self.seam
        hidden = s.hidden(batch.tokens)  # post final norm, with grad
        r = mtp_loss(batch.tokens, hidden, model["mtp"], s.embed, s.logits, s.rotary, label_mask(batch),
                     self.options.lam, main_logits=s.logits(hidden))
        return _step_output(r, joint=True)

    def save(self, model: nn.Module, out: Path) -> None:
        from safetensors import safe_open

        assert isinstance(model, nn.ModuleDict)
        main = model["main"]
        main.to(torch.bfloat16).save_pretrained(out)  # transformers writes the checkpoint layout
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        save_mtp_checkpoint(model["mtp"], out / "model.safetensors", main.config.num_hidden_layers, tensors)
        self.tokenizer.save_pretrained(out)

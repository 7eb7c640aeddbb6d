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
as are positions before the response (the draft is served on responses). Features and data come
from :mod:`specdec.training.data` (the target's own responses); they are cached on disk.

Checkpoints for resuming are safetensors only (model, optimizer moments, step, generator state).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm import tqdm

from specdec.training.data import DistilledSeq, FeatureSeq

__all__ = ["token_counts", "sample_anchors", "TTTResult", "ttt_loss",
           "save_train_state", "load_train_state"]


def token_counts(seqs: list[DistilledSeq] | list[FeatureSeq], vocab_size: int) -> Tensor:
    """How often each token appears in the responses (what a draft must propose). [V]"""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s.tokens[s.response_start:], minlength=vocab_size)
    return counts


def sample_anchors(seq: FeatureSeq, n: int, gen: torch.Generator) -> Tensor:
    """Up to ``n`` distinct anchors whose first prediction is a response token, sorted. [A]"""
    lo, hi = max(0, seq.response_start - 2), seq.tokens.numel() - 2  # slot a needs t_{a+1}
    if hi < lo:
        return torch.zeros(0, dtype=torch.long)
    pick = torch.randperm(hi - lo + 1, generator=gen)[:n]
    return (pick + lo).sort().values


@dataclass
class TTTResult:
    loss: Tensor
    correct: list[int]  # per step: draft argmax == target argmax, over counted positions
    counted: list[int]  # per step: positions in the loss
    logits: list[Tensor]  # per step: draft logits over the draft vocabulary [A, Vd]


def ttt_loss(model: nn.Module, embed: nn.Module, head: Tensor, in_draft: Tensor, seq: FeatureSeq,
             anchors: Tensor, steps: int = 7, decay: float = 0.8) -> TTTResult:
    """The TTT loss of an :class:`~specdec.drafters.eagle3.model.Eagle3Model` on one sequence.

    ``head`` [Vd, D] holds the target's LM-head rows of the draft vocabulary (in draft-id order),
    ``in_draft`` [V] is ``t2d``; ``anchors`` [A] from :func:`sample_anchors`.
    """
    T, dt = seq.tokens.numel(), model.fc.weight.dtype
    layer, tokens = model.layers[0], seq.tokens
    # step 0 at every slot i < T-1: keys and values of the context
    g0 = model.fuse(seq.features[: T - 1].unsqueeze(0))
    emb0 = embed(tokens[1:T].unsqueeze(0)).to(dt)
    cos, sin = model.rope(g0, torch.arange(T - 1).unsqueeze(0))
    q0, k0, v0, res0 = layer.qkv(emb0, g0, cos, sin)
    A = anchors.numel()
    ctx = torch.arange(T - 1).unsqueeze(0) <= anchors.unsqueeze(1)  # [A, T-1]
    q, res = q0[:, :, anchors], res0[:, anchors]
    keys, values, diag = [k0], [v0], []
    total = g0.new_zeros(())
    correct, counted, all_logits = [], [], []
    y = None
    for s in range(steps):
        if s > 0:
            idx = anchors + s + 1  # input token index
            emb = embed(tokens[idx.clamp(max=T - 1)].unsqueeze(0)).to(dt)
            cos, sin = model.rope(y, (anchors + s).unsqueeze(0))
            q, k, v, res = layer.qkv(emb, y, cos, sin)
            keys.append(k)
            values.append(v)
            diag.append(torch.eye(A, dtype=torch.bool))
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
        correct.append(int(((logits.argmax(-1) == z.argmax(-1)) & valid).sum()))
        counted.append(n)
        all_logits.append(logits)
    return TTTResult(total, correct, counted, all_logits)


def save_train_state(path: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int, gen: torch.Generator,
                     extra: dict | None = None) -> None:
    """Model weights, AdamW moments, step and the data generator's state, as safetensors + JSON."""
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for key, val in st.items():
            tensors[f"opt.{i}.{key}"] = torch.as_tensor(val).contiguous()
    tensors["gen_state"] = gen.get_state()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "train_state.tmp"))
    (path / "train_state.tmp").replace(path / "train_state.safetensors")
    (path / "train_state.json").write_text(json.dumps({"step": step, **(extra or {})}, indent=2))


def load_train_state(path: Path, model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> int:
    """Restore what :func:`save_train_state` wrote; returns the step to continue from."""
    data = load_file(str(path / "train_state.safetensors"))
    model.load_state_dict({k[6:]: v for k, v in data.items() if k.startswith("model.")})
    sd = opt.state_dict()
    state: dict[int, dict] = {}
    for k, v in data.items():
        if k.startswith("opt."):
            _, i, key = k.split(".", 2)
            state.setdefault(int(i), {})[key] = v
    sd["state"] = state
    opt.load_state_dict(sd)
    gen.set_state(data["gen_state"])
    return int(json.loads((path / "train_state.json").read_text())["step"])

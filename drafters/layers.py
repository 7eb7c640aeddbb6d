"""The layers every draft network here shares (EAGLE-3, DFlash, DSpark).

RMSNorm, the gated MLP and the rotary embedding are transformers' own Llama classes
(``LlamaRMSNorm``, ``LlamaMLP``, ``LlamaRotaryEmbedding``), which fit exactly and are imported
where they are used. This module holds what transformers has no piece for: the projections of
grouped-query attention under transformers' parameter names, RoPE on one tensor (a draft rotates
context keys without queries), and attention under a boolean mask. Attention is left to the
caller because each family masks it its own way: EAGLE-3 over a cache plus a tree, DFlash over
context slots plus a non-causal block. :class:`FP32Buffers` is the base of the draft networks: their
rotary frequencies survive casts to the checkpoint's dtype unrounded.

Shapes: ``B`` rows, ``n`` tokens, ``m`` query tokens, ``S`` key slots, ``H``/``Hkv`` query / KV
heads, ``hd`` head size, ``d`` hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

__all__ = ["GQAttention", "FP32Buffers", "rope", "attend"]


class FP32Buffers(nn.Module):
    """A module whose non-persistent floating buffers anywhere below it (the rotary frequencies
    ``inv_freq``) keep their values, in float32, through every dtype cast (``.to(bf16)``,
    ``.half()``, ``.float()``); device moves still apply. They are computed from the config, not
    trained: a bf16 ``inv_freq`` is off by up to 2^-9 relatively, an angle error that grows with the
    position, so a draft cast to its checkpoint's dtype would rotate with frequencies it was not
    trained with, and a later ``.float()`` cannot undo the rounding."""

    def _apply(self, fn, recurse=True):
        kept = []
        if recurse:
            persistent = set(self.state_dict(keep_vars=True))
            kept = [(name, buf) for name, buf in self.named_buffers()
                    if name not in persistent and buf.is_floating_point()]
        super()._apply(fn, recurse)
        for name, buf in kept:
            owner, _, leaf = name.rpartition(".")
            module = self.get_submodule(owner)
            setattr(module, leaf, buf.to(device=getattr(module, leaf).device))
        return self


class GQAttention(nn.Module):
    """The q/k/v/o projections of grouped-query attention (no biases), named as transformers
    names them, and optional per-head RMSNorms of queries and keys (Qwen3's ``q_norm`` and
    ``k_norm``). ``in_features`` may differ from ``d``: EAGLE-3's q/k/v read a 2d-wide input."""

    def __init__(self, in_features: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 qk_norm_eps: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_features, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = LlamaRMSNorm(head_dim, eps=qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = LlamaRMSNorm(head_dim, eps=qk_norm_eps) if qk_norm_eps is not None else None

    def heads(self, x: Tensor, norm: nn.Module | None = None) -> Tensor:
        """x [B, n, heads·hd] → [B, heads, n, hd], each head normed first when ``norm`` is given."""
        B, n, _ = x.shape
        x = x.view(B, n, -1, self.head_dim)
        return (x if norm is None else norm(x)).transpose(1, 2)

    def out(self, attn: Tensor) -> Tensor:
        """attn [B, H, m, hd], the attention output per head → o_proj of the heads side by side [B, m, d]."""
        B, _, m, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(B, m, -1))


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in the half-split convention on x [B, heads, n, hd] with cos, sin [B, n, hd]: the same
    values as transformers' ``apply_rotary_pos_emb``, whose pair of slices is one ``chunk`` here so
    that the backward sums in the order the block drafters were trained with."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attend(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
    """Attention with a boolean mask (True = attend); each KV head serves a group of query heads.
    q [B, H, m, hd], k/v [B, Hkv, S, hd], allowed [B, m, S] → [B, H, m, hd].

    Where gradients are recorded the KV heads are repeated for their groups (as transformers'
    ``repeat_kv``): the backward then sums each group's key and value gradients in one fixed order,
    the one the block drafters were trained with. Drafting passes them with ``enable_gqa`` instead,
    the same forward to the bit on a CPU without a copy of the draft's cache per step (which at 4k
    tokens of context cost more than the draft layer itself)."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and torch.is_grad_enabled():
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1), enable_gqa=k.shape[1] < q.shape[1])

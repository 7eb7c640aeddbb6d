"""The EAGLE-3 draft network (arXiv 2503.01840): weights and one forward step, no decoding logic.

    g      = fc( [input_norm]( cat[ h_a, h_b, h_c ] ) )          # 3 target layer inputs, [.., 3D] → [.., d]
    x      = cat[ input_layernorm(emb(token)), hidden_norm(g) ]   # [.., 2d]: q/k/v read both halves
    y      = g' + o_proj(attn(x));  y = y + mlp(post_attention_layernorm(y))
    logits = lm_head( norm(y) )                                   # over the draft vocabulary

``g'`` is ``g`` (``norm_before_residual=False``, SafeAILab's layout) or ``hidden_norm(g)``
(``True``). The next draft step feeds ``y`` (pre-norm) back in place of ``g``. ``input_norm``
exists only with ``norm_before_fc`` (one RMSNorm over the whole concatenation, gpt-oss drafts).

**EAGLE-3.1** (speculators PR #610/#670, vLLM PR #42764), two flags, both off in EAGLE-3
checkpoints: ``fc_norm`` normalises each fused feature on its own before ``fc``,
``fc( cat[ fc_norm_a(h_a), fc_norm_b(h_b), fc_norm_c(h_c) ] )`` (exclusive with
``norm_before_fc``); ``norm_output`` feeds ``norm(y)`` back to the next draft step instead of ``y``
(the logits are ``lm_head(norm(y))`` either way).

**Reduced vocabulary.** ``lm_head`` scores ``draft_vocab_size`` tokens; draft id ``i`` is target
id ``i + d2t[i]``; ``t2d`` marks the target ids the draft can propose. :meth:`Eagle3Model.full_logits`
scatters draft logits into the full vocabulary (−inf elsewhere) before any warping, so the q the
verifier sees is exact over the target's vocabulary and zero outside the draft's.

Parameter names are the speculators format's (``fc``, ``layers.0.*``, ``norm``, ``lm_head``,
``d2t``, ``t2d``, optional ``embed_tokens``); :mod:`specdec.drafters.eagle3.checkpoint` reads and
writes files. Attention is left to the caller (:meth:`Eagle3Layer.qkv`, then
:func:`~specdec.drafters.layers.attend`, re-exported here, then :meth:`Eagle3Layer.finish`),
because decoding (a cache plus a tree) and training (unrolled steps) mask it differently. The
layers are the ones every draft network shares (:mod:`specdec.drafters.layers` and transformers'
Llama norm, MLP and rotary embedding).

Shapes: ``B`` rows, ``m`` tokens, ``D`` target hidden size, ``d`` draft hidden size, ``V`` target
vocabulary, ``Vd`` draft vocabulary, ``H``/``Hkv`` heads, ``hd`` head size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from specdec.drafters.layers import FP32Buffers, GQAttention, attend, rope
from specdec.kernels.norm_concat_linear import fused_norm_concat_linear
from specdec.target import Target

__all__ = ["Eagle3Spec", "Eagle3Layer", "Eagle3Model", "default_layer_ids", "draft_layer_config",
           "vocab_map", "attend"]


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's feature layers: the inputs of layers 2, L//2 and L-3 (vLLM and SafeAILab agree)."""
    return (2, num_layers // 2, num_layers - 3)


def draft_layer_config(target: Target, **overrides) -> LlamaConfig:
    """A one-layer Llama config shaped like the target's last layer (EAGLE-3 drafts are Llama layers
    for any target): its heads, head size and RoPE, which in Gemma 3/4 are the full-attention
    layers' (their configs keep one RoPE per layer type, which a Llama config would ignore)."""
    tc, last = target.text_config, target.layer_specs()[-1]
    kwargs = dict(
        hidden_size=target.hidden_size, num_attention_heads=last.num_heads, num_key_value_heads=last.num_kv_heads,
        head_dim=last.head_dim or int(getattr(tc, "head_dim", None) or target.hidden_size // last.num_heads),
        intermediate_size=int(tc.intermediate_size),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)), vocab_size=int(tc.vocab_size),
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 4096)),
        rope_parameters=last.rope_parameters, num_hidden_layers=1, hidden_act="silu", attention_bias=False,
        mlp_bias=False, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def vocab_map(counts: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """``(d2t, t2d)`` for the ``draft_vocab_size`` most frequent target tokens in ``counts`` [V].

    The kept ids are sorted, so draft id order follows target id order (as EAGLE-3 builds them);
    ties in frequency go to the lower id. d2t [Vd] int64 offsets, t2d [V] bool.
    """
    V = counts.numel()
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must lie in [1, {V}], got {draft_vocab_size}")
    order = torch.sort(-counts.double(), stable=True).indices[:draft_vocab_size]
    used = order.sort().values
    d2t = used - torch.arange(draft_vocab_size, device=used.device)
    t2d = torch.zeros(V, dtype=torch.bool, device=used.device)
    t2d[used] = True
    return d2t, t2d


@dataclass(frozen=True)
class Eagle3Spec:
    """What a checkpoint's config fixes besides the layer config."""

    layer_ids: tuple[int, ...]  # target layer inputs fused by fc (EAGLE-3: 3 of them)
    target_hidden_size: int  # D
    draft_vocab_size: int  # Vd
    norm_before_residual: bool = False
    norm_before_fc: bool = False  # one RMSNorm over the concatenated features before fc
    own_embedding: bool = False  # carries embed_tokens; else the target's embedding is shared
    fc_bias: bool = False  # early speculators checkpoints have one
    fc_norm: bool = False  # EAGLE-3.1: one RMSNorm per fused feature before fc
    norm_output: bool = False  # EAGLE-3.1: the next draft step reads norm(y), not y

    def __post_init__(self) -> None:
        if len(self.layer_ids) < 1:
            raise ValueError("eagle3 needs at least one target layer id")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are exclusive (one norm over the concatenation, or one"
                             " per feature), as in speculators")
        if self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1, got {self.draft_vocab_size}")


class Eagle3Layer(nn.Module):
    """The single decoder layer ("midlayer")."""

    def __init__(self, cfg: LlamaConfig, norm_before_residual: bool):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = LlamaRMSNorm(d, eps=eps)
        self.hidden_norm = LlamaRMSNorm(d, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps=eps)
        # q/k/v read the 2d-wide concatenation
        self.self_attn = GQAttention(2 * d, d, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.mlp = LlamaMLP(cfg)

    def qkv(self, emb: Tensor, g: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """emb, g [B, m, d] → q [B, H, m, hd], k, v [B, Hkv, m, hd] (rotated), residual [B, m, d]."""
        a = self.self_attn
        normed = self.hidden_norm(g)
        residual = normed if self.norm_before_residual else g
        # q/k/v of cat[input_layernorm(emb), hidden_norm(g)] in one fused call (no concatenation in memory)
        qkv = fused_norm_concat_linear(emb, g, self.input_layernorm.weight, self.hidden_norm.weight,
                                       self._qkv_weight(), self.hidden_norm.variance_epsilon)
        sizes = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
        q, k, v = (a.heads(t) for t in qkv.split(sizes, dim=-1))
        return rope(q, cos, sin), rope(k, cos, sin), v, residual

    def _qkv_weight(self) -> Tensor:
        """``cat[W_q, W_k, W_v]``, rebuilt only when a weight changed (training) or moved: decoding
        reads it every step, and re-concatenating would cost more than the fusion saves."""
        if torch.compiler.is_compiling() and getattr(self, "_qkv", None) is not None:
            return self._qkv  # a traced draft step reads the copy its caller refreshed before it
        a = self.self_attn
        ws = (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)
        if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
            return torch.cat(ws, dim=0)  # autograd must see the concatenation
        key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in ws)
        if getattr(self, "_qkv_key", None) != key:
            self._qkv_key, self._qkv = key, torch.cat([w.detach() for w in ws], dim=0)
        return self._qkv

    def finish(self, attn: Tensor, residual: Tensor) -> Tensor:
        """attn [B, H, m, hd] (attention output per head), residual [B, m, d] → y [B, m, d]."""
        y = residual + self.self_attn.out(attn)
        return y + self.mlp(self.post_attention_layernorm(y))


class Eagle3Model(FP32Buffers):
    """The draft network. ``embed_tokens`` is None when the target's embedding is shared; its rotary
    frequencies stay float32 whatever dtype it is cast to (:class:`~specdec.drafters.layers.FP32Buffers`)."""

    def __init__(self, cfg: LlamaConfig, spec: Eagle3Spec):
        super().__init__()
        self.config, self.spec = cfg, spec
        d, D, V, Vd = cfg.hidden_size, spec.target_hidden_size, cfg.vocab_size, spec.draft_vocab_size
        if Vd > V:
            raise ValueError(f"draft_vocab_size {Vd} exceeds the vocabulary size {V}")
        self.embed_tokens = nn.Embedding(V, d) if spec.own_embedding else None
        width = len(spec.layer_ids) * D
        self.input_norm = LlamaRMSNorm(width, eps=cfg.rms_norm_eps) if spec.norm_before_fc else None
        self.fc_norm = (nn.ModuleList([LlamaRMSNorm(D, eps=cfg.rms_norm_eps) for _ in spec.layer_ids])
                        if spec.fc_norm else None)
        self.fc = nn.Linear(width, d, bias=spec.fc_bias)
        self.layers = nn.ModuleList([Eagle3Layer(cfg, spec.norm_before_residual)])
        self.norm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(d, Vd, bias=False)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(V, dtype=torch.bool) if Vd == V else torch.zeros(V, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(cfg)

    @property
    def layer(self) -> Eagle3Layer:
        return self.layers[0]

    @property
    def draft_ids(self) -> Tensor:
        """Target id of every draft id. [Vd]"""
        return torch.arange(self.spec.draft_vocab_size, device=self.d2t.device) + self.d2t

    def check_vocab_map(self) -> None:
        """Raise if d2t/t2d are inconsistent (ids out of range, or t2d not the image of d2t)."""
        V, Vd = self.config.vocab_size, self.spec.draft_vocab_size
        if self.d2t.shape != (Vd,):
            raise ValueError(f"d2t has {self.d2t.numel()} entries, draft_vocab_size is {Vd}")
        if self.t2d.shape != (V,):
            raise ValueError(f"t2d has {self.t2d.numel()} entries, the vocabulary has {V}")
        ids = self.draft_ids
        if bool((ids < 0).any() | (ids >= V).any()):
            raise ValueError("d2t maps draft ids outside the target vocabulary")
        if ids.unique().numel() != Vd:
            raise ValueError("d2t maps two draft ids to one target id")
        image = torch.zeros(V, dtype=torch.bool, device=ids.device).index_fill_(0, ids, True)
        if not torch.equal(image, self.t2d.bool()):
            raise ValueError("t2d is not the set of target ids d2t maps to")

    def fuse(self, features: Tensor) -> Tensor:
        """features [B, m, n_layers·D] (layer_ids order) → g [B, m, d]."""
        x = features.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(h) for norm, h in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(x)

    def carry(self, y: Tensor) -> Tensor:
        """What the next draft step reads in place of g: y [.., d], or norm(y) with ``norm_output``."""
        return self.norm(y) if self.spec.norm_output else y

    def rope(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.rotary(x, positions)

    def draft_logits(self, y: Tensor) -> Tensor:
        """Pre-norm output y [..., d] → float32 logits over the draft vocabulary [..., Vd] (draft
        ids; :attr:`draft_ids` maps them to target ids). What greedy drafting ranks."""
        return self.lm_head(self.norm(y)).float()

    def full_logits(self, y: Tensor) -> Tensor:
        """Pre-norm output y [..., d] → float32 logits over the target vocabulary [..., V], −inf
        outside the draft vocabulary. What sampled drafting warps (q is over the target's vocabulary)."""
        draft = self.draft_logits(y)
        out = draft.new_full((*draft.shape[:-1], self.config.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.draft_ids, draft)

"""DFlash's block-parallel draft network (the backbone DSpark extends in :mod:`specdec.drafters.dspark.model`).

One forward drafts a whole block. The block's inputs are ``[anchor, MASK × (b−1)]`` (the target's
frozen embeddings); queries come from the block only, and attention inside the block is
**non-causal**. Every draft layer also attends to *context* keys and values computed from the
target: ``ctx = hidden_norm(fc(concat of m target layer outputs))`` at every committed token,
projected by that layer's own ``k_proj``/``v_proj`` (with ``k_norm`` and RoPE at the token's
position). The draft has no embedding or LM head of its own: both are the target's.

    K = k_norm([W_K·ctx ; W_K·h_blk]),  V = [W_V·ctx ; W_V·h_blk],  Q = q_norm(W_Q·h_blk)

Because context K/V depend only on committed tokens, a drafter caches them (in the one ragged
:class:`~specdec.kv.KVStore`) and only appends the accepted tokens' entries after each step.

``target_layer_ids`` name layer **outputs** (0-indexed), as DFlash checkpoints do; the library's
target captures layer *inputs*, so :func:`specdec.target.layer_output_ids` converts them.

Shape symbols: ``B`` rows, ``b`` block length, ``c`` context tokens, ``D`` draft hidden size
(equal to the target's), ``H``/``G`` query/KV heads, ``h`` head dim.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from specdec.drafters.layers import FP32Buffers, GQAttention, attend, rope

__all__ = ["BlockDraftConfig", "BlockDraftModel", "build_target_layer_ids"]


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default: ``num_draft_layers`` layer outputs evenly spaced from 1 to L−3
    (``[L//2]`` for one). Tiny targets (L < 5) get the ids clamped into ``[0, L−2]``: the last
    layer's output is left out because Hugging Face's ``hidden_states[L]`` is already final-normed."""
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        return [L // 2]
    start, end = 1, L - 3
    ids = [int(round(start + i * (end - start) / (n - 1))) for i in range(n)]
    return sorted({min(max(i, 0), max(L - 2, 0)) for i in ids})


@dataclass
class BlockDraftConfig:
    """Everything that shapes the network; stored in the checkpoint's ``config.json``."""

    anchor_predicts: ClassVar[bool] = False  # block position 0 (the anchor) drafts too (DSpark's blocks)
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int | None  # None until bound (some layouts do not record it)
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 8
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 32768

    def __post_init__(self) -> None:
        ids = list(self.target_layer_ids)
        if not ids:
            raise ValueError("target_layer_ids must not be empty")
        if self.num_target_layers is not None:
            self.check_target(self.num_target_layers)
        if sorted(set(ids)) != ids:
            raise ValueError(f"target_layer_ids must be strictly increasing, got {ids}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary [0, {self.vocab_size})")
        if self.num_drafts < 1:
            raise ValueError(f"block_size {self.block_size} drafts nothing")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    def check_target(self, num_target_layers: int) -> None:
        """Ids name layer outputs, 0-indexed; −1 is the embedding output (DeepSpec's convention)."""
        ids = self.target_layer_ids
        if any(not -1 <= i < num_target_layers for i in ids):
            raise ValueError(f"target_layer_ids {ids} outside [-1, {num_target_layers - 1}]"
                             f" for a {num_target_layers}-layer target (they name layer outputs; -1 = embeddings)")

    @property
    def num_drafts(self) -> int:
        """Drafts one trained block yields: b−1 (DFlash) or b (DSpark, the anchor predicts too)."""
        return self.block_size - 1 + int(self.anchor_predicts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def layer_config(self) -> LlamaConfig:
        """These shapes as a transformers Llama config, for the layers taken from transformers
        (the MLP, the rotary embedding)."""
        return LlamaConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, hidden_act="silu", mlp_bias=False,
                           max_position_embeddings=self.max_position_embeddings,
                           rope_parameters=dict(self.rope_parameters))


class BlockAttention(GQAttention):
    """Qwen3-style attention (per-head q/k norms) whose keys and values are the context's
    followed by the block's own."""

    def __init__(self, cfg: BlockDraftConfig):
        D = cfg.hidden_size
        super().__init__(D, D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps)

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Keys (normed, rotated) and values of x [B, n, D] → [B, G, n, h] each."""
        return rope(self.heads(self.k_proj(x), self.k_norm), cos, sin), self.heads(self.v_proj(x))

    def forward(self, x: Tensor, ctx_k: Tensor, ctx_v: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        """x [B, b, D] (normed block), ctx_k/v [B, G, c, h], cos/sin of the block [B, b, h],
        mask [B, b, c + b] bool (True = attend)."""
        q = rope(self.heads(self.q_proj(x), self.q_norm), cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)
        return self.out(attend(q, torch.cat([ctx_k, k_blk], 2), torch.cat([ctx_v, v_blk], 2), mask))


class BlockLayer(nn.Module):
    """A pre-norm decoder layer whose attention also reads the context K/V."""

    def __init__(self, cfg: BlockDraftConfig, layer_config: LlamaConfig):
        super().__init__()
        self.self_attn = BlockAttention(cfg)
        self.mlp = LlamaMLP(layer_config)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x: Tensor, ctx_k: Tensor, ctx_v: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockDraftModel(FP32Buffers):
    """The backbone; parameter names are the z-lab DFlash checkpoint's (``layers.{i}.*``, ``fc``,
    ``hidden_norm``, ``norm``). A family that extends it (DSpark) subclasses both this and
    :class:`BlockDraftConfig`, adds its heads, and overrides :meth:`draft_bias` and
    :meth:`confidence_logits`, which training reads. Its rotary frequencies stay float32 through
    every cast (:class:`~specdec.drafters.layers.FP32Buffers`)."""

    config_class: ClassVar[type[BlockDraftConfig]] = BlockDraftConfig

    def __init__(self, cfg: BlockDraftConfig):
        super().__init__()
        self.cfg = cfg
        D, layer_config = cfg.hidden_size, cfg.layer_config()
        self.fc = nn.Linear(len(cfg.target_layer_ids) * D, D, bias=False)
        self.hidden_norm = LlamaRMSNorm(D, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList([BlockLayer(cfg, layer_config) for _ in range(cfg.num_hidden_layers)])
        self.norm = LlamaRMSNorm(D, eps=cfg.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(layer_config)
        self.t2d: Tensor | None
        self.register_buffer("t2d", None)  # optional draft vocabulary [V] bool (see set_draft_vocab)

    def init_weights(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def set_draft_vocab(self, t2d: Tensor | None) -> None:
        """Restrict drafts to the tokens marked in ``t2d`` [V] bool (speculators' name): a drafter
        trained with its softmax over the tokens its data uses never learned to push the others
        down, so they are masked out of its logits (q is then exactly the masked distribution)."""
        if t2d is not None and (t2d.dtype != torch.bool or t2d.shape != (self.cfg.vocab_size,) or not bool(t2d.any())):
            raise ValueError(f"t2d must be a non-empty bool mask of shape [{self.cfg.vocab_size}]")
        self.t2d = None if t2d is None else t2d.clone().to(self.fc.weight.device)

    def rope(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.rotary(x, positions)

    def project_context(self, features: Tensor) -> Tensor:
        """features [B, c, m·D] (the target layer outputs, concatenated) → ctx [B, c, D]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, ctx: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per layer, the context keys and values of ctx [B, c, D] at positions [B, c]."""
        cos, sin = self.rope(ctx, positions)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def forward(self, block: Tensor, positions: Tensor, ctx_kv: list[tuple[Tensor, Tensor]], mask: Tensor) -> Tensor:
        """block [B, b, D] embeddings at positions [B, b]; mask [B, b, c + b] bool (True = attend).
        Returns the final-normed hidden states [B, b, D] (what the LM head reads)."""
        cos, sin = self.rope(block, positions)
        x = block
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, k, v, cos, sin, mask)
        return self.norm(x)

    def draft_bias(self, prev: Tensor, hidden: Tensor, vocab: Tensor | None = None) -> Tensor | None:
        """A bias on the logits of drafts whose previous tokens are ``prev`` [..., γ], given their
        block hidden states [..., γ, D], teacher-forced (over the ``vocab`` columns only when given):
        [..., γ, V or S]. None: DFlash's drafts are independent given the block."""
        return None

    def confidence_logits(self, hidden: Tensor, prev: Tensor) -> Tensor | None:
        """Per-draft acceptance logits [..., γ] from the block hidden [..., γ, D] and previous
        tokens [..., γ]. None: DFlash predicts no confidences."""
        return None

"""Tiny random-weight models of every supported target family, for tests and ``tiny()`` factories.

``init_scale`` sets the weight init range: larger values make peaked next-token distributions,
which the sampled-decoding tests need so that top-k and top-p actually cut something.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

__all__ = ["FAMILIES", "tiny_model"]

_COMMON: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)

FAMILIES: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {"head_dim": 8, "sliding_window": 4,
                                                     "layer_types": ["sliding_attention", "full_attention"]}),
    # Gemma 4 with KV sharing: its last two layers read the cache of earlier layers of their type.
    "gemma4": (Gemma4TextConfig, Gemma4ForCausalLM, {
        "num_hidden_layers": 4, "head_dim": 8, "global_head_dim": 16, "sliding_window": 4,
        "vocab_size_per_layer_input": None, "hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"]}),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, {
        "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
        "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "n_shared_experts": 1,
        "num_key_value_heads": 4}),
}


def tiny_model(family: str = "llama", vocab_size: int = 64, seed: int = 0, init_scale: float = 0.02,
               **overrides: Any) -> PreTrainedModel:
    """A random fp32 model of ``family`` in eval mode with the ``eager``-free sdpa attention."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    config_cls, model_cls, extra = FAMILIES[family]
    kwargs = {**_COMMON, **extra, "vocab_size": vocab_size, "initializer_range": init_scale, **overrides}
    if "vocab_size_per_layer_input" in kwargs:  # gemma4's per-layer input table spans the vocabulary
        kwargs["vocab_size_per_layer_input"] = vocab_size
    if "layer_types" in kwargs:
        kwargs["layer_types"] = (kwargs["layer_types"] * kwargs["num_hidden_layers"])[: kwargs["num_hidden_layers"]]
    config = config_cls(**kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return model_cls(config).eval()

"""The MTP / NextN module (:class:`MTPModule`) and how a target builds them (:func:`build_mtp_modules`).

Apart from the drafter (:mod:`specdec.drafters.mtp.drafter`) because the checkpoint reader
(:mod:`specdec.drafters.mtp.checkpoint`) builds them too, and the drafter reads checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from specdec.kernels import fused_norm_concat_linear, rms_norm_params
from specdec.target import Target
from specdec.transformers_versions import cache_kwargs

__all__ = ["MTPModule", "build_mtp_modules"]


class MTPModule(nn.Module):
    """One MTP / NextN module; parameter names are the checkpoint's (``model.layers.{L+d}.``)."""

    def __init__(self, block: nn.Module, new_norm: Callable[[], nn.Module], hidden_size: int):
        super().__init__()
        self.enorm = new_norm()
        self.hnorm = new_norm()
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.mtp_block = block
        self.shared_head = nn.Module()
        self.shared_head.norm = new_norm()

    def forward(self, embeds: Tensor, hidden: Tensor, position_embeddings, position_ids: Tensor,
                attention_mask: Tensor | None = None, cache=None) -> tuple[Tensor, Tensor]:
        """embeds, hidden [B, W, D] → (block output, its shared_head.norm) [B, W, D] each;
        ``cache`` is a store as :meth:`specdec.target.Target.kv_cache` hands it to the block."""
        x = self.draft_input(embeds, hidden)
        out = self.mtp_block(x, attention_mask=attention_mask, position_ids=position_ids, **cache_kwargs(cache),
                             use_cache=cache is not None, position_embeddings=position_embeddings)
        out = out[0] if isinstance(out, tuple) else out
        return out, self.shared_head.norm(out)

    def draft_input(self, embeds: Tensor, hidden: Tensor) -> Tensor:
        """``eh_proj(cat[enorm(emb), hnorm(h)])``, fused (no concatenation in memory) when both
        norms are the Llama-form RMSNorm the fused kernel implements; otherwise the modules."""
        e, h = rms_norm_params(self.enorm), rms_norm_params(self.hnorm)
        if e is None or h is None or e[1] != h[1]:
            return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return fused_norm_concat_linear(embeds, hidden, e[0], h[0], self.eh_proj.weight, e[1], self.eh_proj.bias)


def build_mtp_modules(target: Target, depth: int) -> nn.ModuleList:
    """``depth`` randomly initialised MTP modules of the target's family (its own decoder layer,
    built like its last layer: MoE for DeepSeek-V3, as transformers builds them, and norm), built
    first and then initialised in one pass as the target's model initialises."""
    cfg = target.layer_config(-1, depth)
    eps = getattr(cfg, "rms_norm_eps", 1e-6)
    modules = nn.ModuleList([
        MTPModule(target.new_layer(cfg, d), lambda: target.new_norm(cfg.hidden_size, eps), cfg.hidden_size)
        for d in range(depth)])
    for m in modules:
        target.init_weights(m)
    return modules.to(dtype=target.dtype)

"""DFlash 2's draft network: DFlash's block backbone plus two modules (z-lab / Inco, 2026).

**Grouped two-tap dynamic depthwise convolution** (``attention_conv``, ``mlp_conv`` in every layer).
Around each sublayer ``f`` (attention, MLP) of a pre-norm layer, with ``h`` the normed input::

    c = kernel_projection(h)                 # [n, 2, taps, G]: both sides' coefficients, from h alone
    h' = conv(h, base_kernel[0] + c[:, 0])   # "prepare", before the sublayer
    y = conv(f(h'), base_kernel[1] + c[:, 1])  # "finish", after it; then the residual add
    conv(x, w)_i = Σ_t w_i[t] ⊙ x_{i−t}     # t < taps; a row never reads across its block's start

Each of the ``G = D / conv_group_size`` groups of channels shares one dynamic coefficient per tap
(``base_kernel`` [2, taps, D] is per channel). Block position ``i`` thus sees position ``i−1``
directly, which counters DFlash's decay toward the block's end. Only the block's rows are
convolved; the context K/V come from the target's features as in DFlash. Which rows share a block
is read from the attention mask (row ``i`` may read row ``i−t`` iff it may attend to it): one block
when drafting, many side by side when training.

**Candidate path selector** (``candidate_selector``). Per drafting slot ``j`` the target's head gives
the top-K candidates (``selector_top_k``) and their logits (the unary term, times
``output_multiplier``, soft-capped by ``final_logit_softcapping`` when set). An edge from
predecessor token ``p`` to candidate ``c`` at slot ``j`` scores::

    s_j(p, c) = unary_j[c] + ⟨P[p] ⊙ W·h_j, S[c]⟩     # P, S: [V, r] codebooks, W: [r, D]

with ``r = selector_rank``; the predecessor of slot 1 is the verified anchor. The drafter walks
from the anchor (:mod:`specdec.drafters.dflash2.drafter`).

Names and shapes follow vLLM's ``qwen3_dflash2.py`` and the z-lab checkpoint header (see
``docs/drafters/dflash2.md``); this module registers how the z-lab layout holds it
(:func:`~specdec.drafters.dflash.checkpoint.register_block_family`). Shape symbols as in :mod:`specdec.drafters.dflash.model`; ``K``
candidates, ``r`` selector rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaConfig

from specdec.drafters.dflash.checkpoint import BlockFamily, register_block_family
from specdec.drafters.dflash.model import BlockDraftConfig, BlockDraftModel, BlockLayer

__all__ = ["DFlash2Config", "DFlash2Model", "GroupedDynamicConv", "CandidateSelector", "block_links"]


@dataclass
class DFlash2Config(BlockDraftConfig):
    """The backbone's fields plus DFlash 2's (``dflash_config`` of a ``DFlash2DraftModel`` file)."""

    conv_kernel_size: int = 2  # taps
    conv_group_size: int = 16  # channels sharing one dynamic coefficient
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0  # on the candidates' logits (the unary term)
    final_logit_softcapping: float | None = None  # on them too, after the multiplier
    input_embedding_scale: float = 1.0  # on the block's embeddings

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.conv_kernel_size < 1:
            raise ValueError(f"conv_kernel_size must be >= 1, got {self.conv_kernel_size}")
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}")
        if self.selector_rank < 1 or self.selector_top_k < 1:
            raise ValueError(f"selector_rank and selector_top_k must be >= 1, got {self.selector_rank},"
                             f" {self.selector_top_k}")
        if self.output_multiplier <= 0:
            raise ValueError(f"output_multiplier must be > 0 (it must keep the candidates' order), got"
                             f" {self.output_multiplier}")


def block_links(mask: Tensor, taps: int) -> list[Tensor]:
    """For each tap ``t ≥ 1``, whether block row ``i`` may read row ``i − t`` [B, n] bool: it may
    iff the attention mask lets it attend to that row (rows of one block see each other, rows of
    different blocks never). ``mask`` [B, n, c + n]."""
    B, n = mask.shape[0], mask.shape[1]
    own = mask[..., mask.shape[-1] - n:]  # [B, n, n]: the block part
    links = []
    for t in range(1, taps):
        link = torch.zeros(B, n, dtype=torch.bool, device=mask.device)
        if t < n:
            link[:, t:] = own.diagonal(offset=-t, dim1=1, dim2=2)
        links.append(link)
    return links


class GroupedDynamicConv(nn.Module):
    """One sublayer's pair of convolutions ("prepare" before it, "finish" after it)."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size, self.groups = taps, group_size, hidden_size // group_size
        base = torch.zeros(2, taps, hidden_size)
        base[:, 0] = 1.0  # the identity: a fresh convolution leaves DFlash's layer as it was
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def convolve(self, x: Tensor, delta: Tensor, side: int, links: list[Tensor]) -> Tensor:
        """x [B, n, D], delta [B, n, taps, G] (row i's coefficients), links from :func:`block_links`."""
        B, n, D = x.shape
        blocks = x.view(B, n, self.groups, self.group_size)
        coef = self.base_kernel[side].view(1, 1, self.taps, self.groups, self.group_size).to(x.dtype) \
            + delta.unsqueeze(-1)
        out = coef[:, :, 0] * blocks
        for t in range(1, self.taps):
            shifted = F.pad(blocks[:, :-t], (0, 0, 0, 0, t, 0))  # row i holds row i − t
            out = out + coef[:, :, t] * shifted * links[t - 1].view(B, n, 1, 1).to(x.dtype)
        return out.view(B, n, D)

    def prepare(self, h: Tensor, links: list[Tensor]) -> tuple[Tensor, Tensor]:
        """The convolved sublayer input and the finish side's coefficients (one projection for both)."""
        B, n, _ = h.shape
        coef = self.kernel_projection(h).view(B, n, 2, self.taps, self.groups)
        return self.convolve(h, coef[:, :, 0], 0, links), coef[:, :, 1]

    def finish(self, y: Tensor, coef: Tensor, links: list[Tensor]) -> Tensor:
        return self.convolve(y, coef, 1, links)


class DFlash2Layer(BlockLayer):
    """DFlash's layer with a convolution pair around its attention and its MLP."""

    def __init__(self, cfg: DFlash2Config, layer_config: LlamaConfig):
        super().__init__(cfg, layer_config)
        self.attention_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x: Tensor, ctx_k: Tensor, ctx_v: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        links = block_links(mask, self.attention_conv.taps)
        h, coef = self.attention_conv.prepare(self.input_layernorm(x), links)
        x = x + self.attention_conv.finish(self.self_attn(h, ctx_k, ctx_v, cos, sin, mask), coef, links)
        h, coef = self.mlp_conv.prepare(self.post_attention_layernorm(x), links)
        return x + self.mlp_conv.finish(self.mlp(h), coef, links)


class CandidateSelector(nn.Module):
    """The low-rank bilinear edge scorer over the top-K candidates of adjacent slots."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def scores(self, prev: Tensor, hidden: Tensor, candidates: Tensor, unary: Tensor) -> Tensor:
        """Scores of the edges from one predecessor per slot: prev [..., L] token ids, hidden
        [..., L, D], candidates [..., L, K] token ids, unary [..., L, K] → [..., L, K] float32
        (teacher-forced training reads this with the true previous tokens)."""
        z = self.predecessor_codebook[prev] * self.hidden_projection(hidden).to(self.predecessor_codebook.dtype)
        succ = self.successor_codebook[candidates]  # [..., L, K, r]
        return unary.float() + torch.einsum("...r,...kr->...k", z, succ).float()

    def edge_scores(self, candidates: Tensor, unary: Tensor, hidden: Tensor, anchors: Tensor) -> Tensor:
        """Every edge's score: candidates, unary [B, L, K], hidden [B, L, D], anchors [B] →
        [B, L, K_prev, K] float32. Slot 0's predecessor is the anchor (every row of its K_prev the same)."""
        B, L, K = candidates.shape
        prev = torch.cat([anchors.view(B, 1, 1).expand(B, 1, K), candidates[:, :-1]], 1)  # [B, L, K_prev]
        z = self.predecessor_codebook[prev] * self.hidden_projection(hidden).to(self.predecessor_codebook.dtype)[:, :, None]
        succ = self.successor_codebook[candidates]  # [B, L, K, r]
        return unary.float()[:, :, None] + torch.einsum("blpr,blcr->blpc", z, succ).float()


class DFlash2Model(BlockDraftModel):
    """The backbone with :class:`DFlash2Layer` layers and the :class:`CandidateSelector`."""

    config_class: ClassVar[type[BlockDraftConfig]] = DFlash2Config
    cfg: DFlash2Config

    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        layer_config = cfg.layer_config()
        self.layers = nn.ModuleList([DFlash2Layer(cfg, layer_config) for _ in range(cfg.num_hidden_layers)])
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank,
                                                    cfg.selector_top_k)

    def init_weights(self, std: float = 0.02) -> None:
        """Linear layers as the backbone's; the codebooks N(0, std); the convolutions' base kernels
        the identity (their projections random, as every linear layer: a trainer that wants to start
        from DFlash exactly zeroes them)."""
        super().init_weights(std)
        sel = self.candidate_selector
        nn.init.normal_(sel.predecessor_codebook, std=std)
        nn.init.normal_(sel.successor_codebook, std=std)
        for layer in self.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                with torch.no_grad():
                    conv.base_kernel.zero_()
                    conv.base_kernel[:, 0] = 1.0

    def forward(self, block: Tensor, positions: Tensor, ctx_kv: list[tuple[Tensor, Tensor]], mask: Tensor) -> Tensor:
        """The backbone's forward (its layers convolve), on the block's embeddings times ``input_embedding_scale``."""
        scale = self.cfg.input_embedding_scale
        return super().forward(block * scale if scale != 1.0 else block, positions, ctx_kv, mask)

    def unary(self, logits: Tensor) -> Tensor:
        """The candidates' logits as the selector scores them (multiplier, then soft-cap)."""
        out = logits.float() * self.cfg.output_multiplier if self.cfg.output_multiplier != 1.0 else logits.float()
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(out / cap) * cap if cap else out


# --- the checkpoint layout: z-lab's DFlash2DraftModel --------------------------------------------
_REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _read(c: dict[str, Any], layout: str, backbone: dict[str, Any]) -> DFlash2Config:
    """DFlash 2's fields from ``dflash_config`` (the scale fields also at top level, where z-lab's
    reader looks second). vLLM indexes the four module fields without defaults, so they are required."""
    if layout != "zlab":
        raise ValueError(f"DFlash 2 checkpoints use the z-lab layout, not {layout}")
    dc = c.get("dflash_config") or {}
    missing = [k for k in _REQUIRED if dc.get(k) is None]
    if missing:
        raise ValueError(f"a DFlash2DraftModel config needs dflash_config.{', dflash_config.'.join(missing)}")

    def scale(key: str, default: Any) -> Any:
        value = dc.get(key, c.get(key))
        return default if value is None else value

    cap = scale("final_logit_softcapping", None)
    return DFlash2Config(**backbone, conv_kernel_size=int(dc["conv_kernel_size"]),
                         conv_group_size=int(dc["conv_group_size"]), selector_rank=int(dc["selector_rank"]),
                         selector_top_k=int(dc["selector_top_k"]),
                         output_multiplier=float(scale("output_multiplier", 1.0)),
                         final_logit_softcapping=float(cap) if cap and float(cap) > 0 else None,
                         input_embedding_scale=float(scale("input_embedding_scale", 1.0)))


def _write(cfg: DFlash2Config, arch: dict[str, Any]) -> dict[str, Any]:
    """z-lab's layout: DFlash 2's fields (and the block size again) in ``dflash_config``."""
    dc: dict[str, Any] = {"block_size": cfg.block_size, "conv_group_size": cfg.conv_group_size,
                          "conv_kernel_size": cfg.conv_kernel_size, "mask_token_id": cfg.mask_token_id,
                          "output_multiplier": cfg.output_multiplier, "selector_rank": cfg.selector_rank,
                          "selector_top_k": cfg.selector_top_k, "target_layer_ids": list(cfg.target_layer_ids)}
    if cfg.final_logit_softcapping:
        dc["final_logit_softcapping"] = cfg.final_logit_softcapping
    if cfg.input_embedding_scale != 1.0:
        dc["input_embedding_scale"] = cfg.input_embedding_scale
    return {"architectures": ["DFlash2DraftModel"], **arch, "dflash_config": dc}


def _speculators(cfg: DFlash2Config) -> dict[str, Any]:
    raise ValueError("speculators defines no DFlash 2 layout (it is requested in speculators #1014);"
                     " export DFlash 2 in its native z-lab layout")


register_block_family("dflash2", BlockFamily(DFlash2Model, _read, _write, _speculators,
                                             frozenset({"output_multiplier", "final_logit_softcapping",
                                                        "input_embedding_scale"})))

"""Gemma-4-style separate MTP ("assistant") drafting on the target's KV cache and activations.

A separately packaged drafter (``gemma4_assistant`` checkpoints) with its own small decoder
whose attention layers have queries only: keys and values are read from the target's KV cache,
each draft layer from the last non-shared target layer of its attention type (sliding or full).
One step, for anchor token ``t`` (the last emitted token) and the target's post-norm hidden
state ``h`` at the token before it:

    x        = pre_projection( cat[ target_embed(t), h ] )        # Gemma's embedding scales by √D itself
    y        = norm( layers(x) )                                   # Q-only attention on the target's K/V
    logits   = lm_head(y)  or  the ordered-embedding sparse head
    h_next   = post_projection(y)                                  # fed back as the next step's h

Every step runs at the same position, the anchor's (``constant_draft_positions``): only the
anchor and ``h`` change, so any ``k`` works. The sparse head scores the tokens of the
``centroid_intermediate_top_k`` best of ``num_centroids`` clusters and fills the others with
``min − 1`` of that row, exactly as transformers does but per row (its batch-wide minimum
would make a row's q depend on its batch); q is the softmax over the full vocabulary of those
logits, warped like the target's, and sampled from exactly.

**Captured step** (the target's ``capture`` switch, :mod:`specdec.capture`): off eager, each assistant
pass is recorded once per (batch, target cache buffers) and replayed, attending over the target
cache's whole capacity under a mask (the masks are built outside the recording).

Sources: transformers ``models/gemma4_assistant`` and ``SinglePositionMultiTokenCandidateGenerator``;
vLLM ``gemma4_mtp.py`` / ``spec_decode/gemma4.py`` (KV-sharing map, constant positions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, Gemma4AssistantConfig, Gemma4TextConfig, PreTrainedModel

from specdec.capture import CapturedSteps
from specdec.drafter import Drafter
from specdec.kv import KVStore
from specdec.sampling import RowSampling
from specdec.target import Target
from specdec.types import Committed, DraftProposal, Requirements

__all__ = ["GemmaMTPDrafter", "GemmaMTPState", "kv_source_layers", "sparse_logits", "assistant_config",
           "tiny_assistant"]


def kv_source_layers(target: Target) -> dict[str, int]:
    """Attention type → index (in the target's store) of the last non-shared layer of that type."""
    owners = [s for s in target.layer_specs() if not s.kv_shared]  # KV-shared layers (Gemma 4) store none
    return {t: max(s.index for s in owners if s.layer_type == t) for t in {s.layer_type for s in owners}}


def sparse_logits(hidden: Tensor, centroids: torch.nn.Linear, token_ordering: Tensor, lm_head_weight: Tensor,
                  top_k: int) -> Tensor:
    """Ordered-embedding head: score only the tokens of the ``top_k`` best clusters. [B, V]"""
    B, V = hidden.shape[0], lm_head_weight.shape[0]
    per_cluster = V // centroids.out_features
    clusters = centroids(hidden).topk(top_k, dim=-1).indices  # [B, top_k]
    members = token_ordering.long().view(centroids.out_features, per_cluster)[clusters].reshape(B, -1)
    scores = torch.einsum("bd,bnd->bn", hidden, lm_head_weight[members])  # [B, top_k * per_cluster]
    fill = scores.min(-1, keepdim=True).values - 1.0
    return fill.expand(B, V).clone().scatter_(1, members, scores)


@dataclass
class GemmaMTPState:
    hidden: Tensor  # [B, D_target] post-norm hidden state at the last committed token
    anchor: Tensor  # [B] the token after it (not yet in the target cache)
    cache: KVStore  # the target's, read-only
    logits: Tensor | None = None  # [B, k, V] of the last proposal, for inspection


class GemmaMTPDrafter(Drafter):
    name = "gemma_mtp"

    def __init__(self, assistant: PreTrainedModel, greedy_draft: bool = False):
        if getattr(assistant.config, "model_type", "") not in ("gemma4_assistant", "gemma4_unified_assistant"):
            raise ValueError(f"expected a gemma4_assistant model, got {assistant.config.model_type!r}")
        self.assistant = _fp32_rotary(assistant.eval())
        self.greedy_draft = greedy_draft
        self.text_config = assistant.config.get_text_config()
        self._steps: CapturedSteps | None = None  # the captured assistant pass, made on first use
        self._static_cache: KVStore | None = None  # the target cache of the pass being recorded or replayed

    def requirements(self) -> Requirements:
        return Requirements(final_hidden=True, target_cache=True)

    def bind(self, target: Target) -> None:
        cfg = self.assistant.config
        if cfg.backbone_hidden_size != target.hidden_size:
            raise ValueError(f"assistant backbone_hidden_size {cfg.backbone_hidden_size} != target hidden size"
                             f" {target.hidden_size}")
        if self.assistant.lm_head.weight.shape[0] != target.vocab_size:
            raise ValueError(f"assistant vocabulary ({self.assistant.lm_head.weight.shape[0]}) differs from the"
                             f" target's ({target.vocab_size})")
        sources = kv_source_layers(target)
        missing = set(self.text_config.layer_types) - set(sources)
        if missing:
            raise ValueError(f"the target has no layer of type {sorted(missing)} to share K/V with")
        self.sources = sources
        super().bind(target)

    def start(self, prefill: Committed, rows: RowSampling) -> GemmaMTPState:
        assert prefill.final_hidden is not None and prefill.target_cache is not None
        return GemmaMTPState(self._last(prefill), prefill.next_tokens, prefill.target_cache)

    @staticmethod
    def _last(committed: Committed) -> Tensor:
        assert committed.final_hidden is not None
        idx = (committed.num_tokens - 1).clamp(min=0)
        return committed.final_hidden[torch.arange(idx.numel(), device=idx.device), idx]

    def _masks(self, cache: KVStore, static: bool = False) -> dict[str, Tensor]:
        """One query at the anchor's position; keys are the target's committed slots (``static``:
        every slot of the buffers' capacity, those past the used ones masked out).

        Sliding layers see the last ``sliding_window + 1`` committed tokens: that is the window
        transformers' assistant builds (a bidirectional window flipped onto the past), which the
        released assistants are served with there; the target's own sliding layers see one fewer.
        """
        pos = cache.lengths.unsqueeze(1)  # [B, 1]
        valid, slot_pos = (cache.static_valid(), cache.static_slot_pos()) if static else (cache.valid, cache.slot_pos)
        allowed = {"full_attention": valid}
        window = getattr(self.text_config, "sliding_window", None)
        if window:
            allowed["sliding_attention"] = valid & (pos - slot_pos <= window + 1)
        dtype = self.assistant.dtype
        neg = torch.finfo(dtype).min
        return {t: torch.where(a, 0.0, neg).to(dtype)[:, None, None, :] for t, a in allowed.items()}

    @torch.inference_mode()
    def step(self, state: GemmaMTPState, tokens: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """One assistant pass. tokens [B], hidden [B, D_target] → (logits [B, V], next hidden)."""
        mode = self.target.capture_mode
        if mode != "eager":
            return self._captured_step(state.cache, tokens, hidden, mode)
        a, cache = self.assistant, state.cache
        kv = {t: cache.layer(i) for t, i in self.sources.items()}
        x = torch.cat([self.target.embed(tokens), hidden], dim=-1).to(a.dtype)
        x = a.pre_projection(x).unsqueeze(1)  # [B, 1, d]
        masks = self._masks(cache)
        out = a.model(inputs_embeds=x, attention_mask={t: masks[t] for t in set(self.text_config.layer_types)},
                      position_ids=cache.lengths.unsqueeze(1), shared_kv_states=kv, use_cache=False)
        return self._outputs(out.last_hidden_state[:, 0], hidden.dtype)

    def _outputs(self, y: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The assistant's logits (float32) and its next hidden state (``dtype``) from its last layer's
        output ``y`` [B, d]: the ordered-embedding head where the checkpoint has one."""
        a = self.assistant
        if a.config.use_ordered_embeddings:
            me = a.masked_embedding
            logits = sparse_logits(y, me.centroids, me.token_ordering, a.lm_head.weight, me.centroid_intermediate_top_k)
        else:
            logits = a.lm_head(y)
        return logits.float(), a.post_projection(y).to(dtype)

    def _captured_step(self, cache: KVStore, tokens: Tensor, hidden: Tensor, mode: str) -> tuple[Tensor, Tensor]:
        """:meth:`step`, captured (:mod:`specdec.capture`): the masks over the whole capacity and the key
        outside the recording; the projections, the assistant's layers and its head inside."""
        masks = self._masks(cache, static=True)
        names = tuple(sorted(set(self.text_config.layer_types)))
        if self._steps is None or self._steps.mode != mode or self._steps.device != tokens.device:
            self._steps = CapturedSteps(self._static_step, mode, tokens.device)
        self._static_cache = cache
        try:
            return self._steps((tokens.shape[0], hidden.dtype, cache.buffer_key()), tokens, hidden,
                               cache.lengths.unsqueeze(1), *(masks[t] for t in names))
        finally:
            self._static_cache = None  # the target's session must die with it

    def _static_step(self, tokens: Tensor, hidden: Tensor, positions: Tensor, *masks: Tensor) -> tuple[Tensor, Tensor]:
        """The captured region: one assistant pass over :attr:`_static_cache`'s whole buffers."""
        a, cache = self.assistant, self._static_cache
        assert cache is not None
        kv = {t: cache.buffers(i) for t, i in self.sources.items()}
        x = a.pre_projection(torch.cat([self.target.embed(tokens), hidden], dim=-1).to(a.dtype)).unsqueeze(1)
        names = tuple(sorted(set(self.text_config.layer_types)))
        out = a.model(inputs_embeds=x, attention_mask=dict(zip(names, masks)), position_ids=positions,
                      shared_kv_states=kv, use_cache=False)
        return self._outputs(out.last_hidden_state[:, 0], hidden.dtype)

    def propose(self, state: GemmaMTPState, k: int, rows: RowSampling) -> DraftProposal:
        tokens, qs, all_logits = [], [], []
        x, h = state.anchor, state.hidden
        for _ in range(k):
            logits, h = self.step(state, x, h)
            all_logits.append(logits)
            x, q = rows.draw(logits, self.greedy_draft)
            tokens.append(x)
            qs.append(q)
        state.logits = torch.stack(all_logits, 1)
        return DraftProposal.chain(torch.stack(tokens, 1), None if self.greedy_draft else torch.stack(qs, 1))

    def observe(self, state: GemmaMTPState, committed: Committed) -> None:
        state.hidden, state.anchor = self._last(committed), committed.next_tokens

    def select_rows(self, state: GemmaMTPState, rows: Tensor) -> None:
        state.hidden, state.anchor = state.hidden[rows], state.anchor[rows]  # the cache is the target's

    @classmethod
    def create(cls, target: Target, model: PreTrainedModel | None = None, checkpoint: str = "",
               greedy_draft: bool = False) -> GemmaMTPDrafter:
        """``checkpoint``: a gemma4_assistant folder (safetensors), or ``model``: a loaded one."""
        if model is None:
            if not checkpoint:
                raise ValueError("gemma_mtp needs `checkpoint` (a gemma4_assistant folder) or `model`")
            model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=target.dtype, use_safetensors=True)
        d = cls(model, greedy_draft)
        d.bind(target)
        return d

    @classmethod
    def tiny(cls, target: Target, **overrides: Any) -> GemmaMTPDrafter:
        """A random 2-layer assistant shaped to read ``target``'s KV cache."""
        seed = overrides.pop("seed", 0)
        ordered = overrides.pop("use_ordered_embeddings", False)
        model = tiny_assistant(target, seed=seed, use_ordered_embeddings=ordered)
        d = cls(model, **overrides)
        d.bind(target)
        return d


def _fp32_rotary(model: PreTrainedModel) -> PreTrainedModel:
    """``model`` with every rotary embedding whose frequencies a dtype cast rounded rebuilt from its
    config (float32, as ``from_pretrained`` computes them): the assistant's queries must rotate as
    the target rotated the keys it reads, and a bf16 ``inv_freq`` puts an error on the angle that
    grows with the position."""
    for name, module in list(model.named_modules()):
        rounded = [b for b in module.buffers(recurse=False) if b.is_floating_point() and b.dtype != torch.float32]
        if name and rounded and type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "config"):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, type(module)(module.config).to(rounded[0].device))
    return model


def _head_dim(target: Target, layer: int) -> int:
    head_dim = target.layer_specs()[layer].head_dim
    if head_dim is None:
        raise ValueError(f"target layer {layer} keeps no per-head K/V an assistant can read (MLA?)")
    return head_dim


def assistant_config(target: Target, hidden_size: int = 32, intermediate_size: int = 64,
                     heads_per_kv: int = 2, use_ordered_embeddings: bool = False, num_centroids: int = 4,
                     centroid_top_k: int = 2, initializer_range: float = 0.02) -> Gemma4AssistantConfig:
    """An assistant config shaped to read ``target``'s cache: one Q-only layer per attention type
    the target has (full last), the target's head sizes, KV heads and RoPE (so the queries' RoPE
    matches the keys' the target cached)."""
    tc = target.text_config
    sources = kv_source_layers(target)
    types = sorted(sources, key=lambda t: t == "full_attention")  # Gemma 4 ends on a full layer
    dims = {t: _head_dim(target, i) for t, i in sources.items()}
    kv_heads = int(tc.num_key_value_heads)
    rope = dict(getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10_000.0})
    per_type = rope if set(types) <= set(rope) else {t: rope for t in types}
    text = Gemma4TextConfig(
        vocab_size=target.vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=len(types), num_attention_heads=heads_per_kv * kv_heads, num_key_value_heads=kv_heads,
        head_dim=dims.get("sliding_attention", dims.get("full_attention")),
        global_head_dim=dims.get("full_attention", dims.get("sliding_attention")),
        layer_types=types, sliding_window=getattr(tc, "sliding_window", None) or 4096,
        rope_parameters={t: dict(per_type[t]) for t in types},
        max_position_embeddings=target.max_positions, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        num_kv_shared_layers=len(types), initializer_range=initializer_range)
    text._attn_implementation = "sdpa"
    config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=target.hidden_size,
                                   use_ordered_embeddings=use_ordered_embeddings, num_centroids=num_centroids,
                                   centroid_intermediate_top_k=centroid_top_k)
    config._attn_implementation = "sdpa"
    return config


def tiny_assistant(target: Target, seed: int = 0, use_ordered_embeddings: bool = False) -> PreTrainedModel:
    """Random assistant whose attention reads ``target``'s KV cache, for any family."""
    config = assistant_config(target, use_ordered_embeddings=use_ordered_embeddings, initializer_range=0.3)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    if use_ordered_embeddings:
        model.masked_embedding.token_ordering.copy_(torch.randperm(target.vocab_size))
    return model

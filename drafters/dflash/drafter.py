"""DFlash: block-parallel drafting from the target's own features (z-lab, 2026).

Each step drafts a whole block in **one** forward of a small network
(:class:`~specdec.drafters.dflash.model.BlockDraftModel`): the block ``[anchor, MASK × k]`` at
positions ``P..P+k`` (``P`` = the anchor's position, the target's last sampled token) attends
non-causally to itself and to context K/V built from the target's layer outputs at every
committed token. Output position ``j ≥ 1`` drafts the token at ``P + j``, so a block of ``b``
gives ``b − 1`` drafts. Embeddings and LM head are the target's.

Draft positions are independent given the block, so sampling draws each from its own warped
softmax and ``q_j`` is exactly that distribution; greedy drafting returns the argmaxes with
``q = None``. A model trained at block ``b`` runs at any ``k`` (smaller is exact to training;
larger drafts positions it never learned).

The context K/V cache (the one ragged :class:`~specdec.kv.KVStore`, a layer per draft layer) is extended at the next
propose with the features of the tokens committed since (the anchor and accepted drafts); rejected
drafts never enter it, so nothing has to be evicted.

**Captured block** (the target's ``capture`` switch, :mod:`specdec.capture`): off eager, the
block's forward runs in a static form, recorded once per (block length, context buffers) and
replayed: it attends over the context buffers' whole capacity under a mask (slots past the
committed ones masked out), so its shapes never depend on the context's length. Extending the
context (a variable number of new slots a step) stays outside the recording.

``mask_token_id``: the token whose embedding fills the masked slots. Qwen3 drafters use the added
``<|MASK|>``; SmolLM2 has none, so its drafters use ``<empty_output>`` (id 16), a Jupyter-notebook
marker the chat model never emits (recorded in the checkpoint config).
"""

from __future__ import annotations

import json

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from specdec.capture import BufferArena, CapturedSteps
from specdec.draft_vocab import draft_vocabulary
from specdec.drafter import Drafter
from specdec.drafters.dflash.model import BlockDraftConfig, BlockDraftModel, build_target_layer_ids
from specdec.kv import KVStore
from specdec.sampling import RowSampling
from specdec.target import Target, layer_output_ids
from specdec.types import Committed, DraftProposal, Requirements
from specdec.validate import as_float_dtype

__all__ = ["BlockDrafter", "BlockState", "DFlashDrafter", "tiny_block_config"]


@dataclass
class BlockState:
    anchors: Tensor  # [B] next token per row (sampled by the target, not yet committed)
    pending: list[Tensor]  # per row: target features [n, m·D] of committed tokens not yet in the cache
    cache: KVStore  # the context K/V per draft layer: one slot per committed token


def tiny_block_config(target: Target, config_class: type[BlockDraftConfig] = BlockDraftConfig,
                      **overrides: Any) -> BlockDraftConfig:
    """A small config of ``config_class`` matching ``target`` (random weights for tests)."""
    L = target.num_layers
    n_feat = overrides.pop("num_target_features", 2)
    # tiny targets are too shallow for DFlash's spacing: the embeddings (-1) and the first layers
    ids = build_target_layer_ids(L, n_feat) if L >= 5 else list(range(-1, min(n_feat, L) - 1))
    last = target.layer_specs()[-1]  # draft layers attend to the whole context: a full-attention layer's shapes
    base: dict[str, Any] = dict(
        hidden_size=target.hidden_size, intermediate_size=2 * target.hidden_size, num_hidden_layers=1,
        num_attention_heads=last.num_heads, num_key_value_heads=last.num_kv_heads,
        head_dim=last.head_dim or target.hidden_size // last.num_heads, vocab_size=target.vocab_size,
        num_target_layers=L, target_layer_ids=ids, mask_token_id=target.vocab_size - 1, block_size=5,
        rope_parameters=last.rope_parameters,
        rms_norm_eps=float(getattr(target.text_config, "rms_norm_eps", 1e-6)))
    base.update(overrides)
    return config_class(**base)


class BlockDrafter(Drafter):
    """What DFlash and DSpark share: binding, the context cache, one block forward."""

    model_class: ClassVar[type[BlockDraftModel]] = BlockDraftModel
    options: ClassVar[tuple[str, ...]] = ("greedy_draft", "head_dtype", "token_map", "draft_vocab")  # constructor kwargs
    tiny_config: ClassVar[dict[str, Any]] = {}  # the family's defaults over tiny_block_config's

    def __init__(self, model: BlockDraftModel, greedy_draft: bool = False, head_dtype: str = "",
                 token_map: str | Sequence[int] = "", draft_vocab: int = 0):
        """``head_dtype``: the target's LM head as drafts read it ("" its own, "bfloat16" a bf16 copy:
        the head is most of a draft step, and a block of k rows through it most of all).
        ``token_map``/``draft_vocab``: draft over the first ``draft_vocab`` ids of a token map only
        (0: all of it; :mod:`specdec.draft_vocab`), reading only those rows of the head."""
        self.model = model.eval()
        self.cfg = model.cfg
        self.greedy_draft = greedy_draft
        self.head_dtype = as_float_dtype("head_dtype", head_dtype)
        self.token_map, self.draft_vocab = token_map, draft_vocab
        self.hidden_ids = layer_output_ids(self.cfg.target_layer_ids)
        self._steps: CapturedSteps | None = None  # the captured block forward, made on first use
        self._arena = BufferArena()  # the context buffers a recording points at, across sessions
        self._static_store: KVStore | None = None  # the context of the block being recorded or replayed

    # --- binding ------------------------------------------------------------------------------
    def requirements(self) -> Requirements:
        return Requirements(layer_inputs=self.hidden_ids)

    def bind(self, target: Target) -> None:
        cfg = self.cfg
        if cfg.hidden_size != target.hidden_size:
            raise ValueError(f"{self.name} draft hidden size {cfg.hidden_size} != target hidden size {target.hidden_size}"
                             " (the draft reads the target's embeddings and LM head)")
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"{self.name} vocabulary {cfg.vocab_size} != target vocabulary {target.vocab_size}")
        if cfg.num_target_layers is not None and cfg.num_target_layers != target.num_layers:
            raise ValueError(f"{self.name} was built for a {cfg.num_target_layers}-layer target,"
                             f" this one has {target.num_layers}")
        cfg.check_target(target.num_layers)
        vocab = draft_vocabulary(self.token_map, self.draft_vocab, target.vocab_size)
        self.mapped = None if vocab is None else vocab.to(target.device)
        self._vocab_for = None  # (the t2d the drafted ids were made for, the ids)
        self.model.to(device=target.device, dtype=target.dtype)
        super().bind(target)
        self.drafted_ids()  # a map with no id in the checkpoint's draft vocabulary fails here, before work

    def drafted_ids(self) -> Tensor | None:
        """The ids drafts are drawn from (sorted), the head's only rows read: the token map's first
        ``draft_vocab``, within the checkpoint's own draft vocabulary (``t2d``) where it has one; None
        for all. Remade when the model's ``t2d`` changes."""
        t2d = self.model.t2d
        if self._vocab_for is None or self._vocab_for[0] is not t2d:
            ids = self.mapped
            if t2d is not None:
                ids = t2d.nonzero().squeeze(1) if ids is None else ids[t2d[ids]]
                if ids.numel() == 0:
                    raise ValueError(f"{self.name}: no id of the token map lies in the checkpoint's draft vocabulary")
            self._vocab_for = (t2d, ids)
        return self._vocab_for[1]

    # --- the contract -------------------------------------------------------------------------
    def start(self, prefill: Committed, rows: RowSampling) -> BlockState:
        feats = self._features(prefill)
        pending = [feats[b, :n] for b, n in enumerate(prefill.num_tokens.tolist())]
        return BlockState(prefill.next_tokens.clone(), pending, self.new_context(len(pending)))

    def new_context(self, batch: int) -> KVStore:
        """An empty context cache: the one ragged KV store, a layer per draft layer (its buffers from
        the arena when the block is captured)."""
        store = KVStore(batch, self.target.device, self.target.dtype, num_layers=len(self.model.layers))
        if self.target.capture_mode != "eager":
            self._arena.attach(store)
        return store

    def observe(self, state: BlockState, committed: Committed) -> None:
        feats = self._features(committed)
        for b, n in enumerate(committed.num_tokens.tolist()):
            state.pending[b] = torch.cat([state.pending[b], feats[b, :n]])
        state.anchors = committed.next_tokens.clone()

    def select_rows(self, state: BlockState, rows: Tensor) -> None:
        idx = rows.tolist()
        state.anchors = state.anchors[rows.to(state.anchors.device)]
        state.pending[:] = [state.pending[i] for i in idx]
        state.cache.select_rows(rows.to(state.cache.device))

    def _features(self, committed: Committed) -> Tensor:
        """The drafter's context features at the committed tokens: [B, m, n·D]."""
        missing = [i for i in self.hidden_ids if i not in committed.hidden]
        if missing:
            raise ValueError(f"the target did not hand out layer inputs {missing}: was {self.name} bound to it?")
        return torch.cat([committed.hidden[i] for i in self.hidden_ids], dim=-1)

    @torch.inference_mode()
    def extend_context(self, state: BlockState) -> None:
        """Move the pending features into the context cache (one projection for all rows)."""
        counts = torch.tensor([p.shape[0] for p in state.pending], device=self.target.device)
        n = int(counts.max()) if counts.numel() else 0
        if n == 0:
            return
        B, F = len(state.pending), state.pending[0].shape[-1]
        feats = torch.zeros(B, n, F, dtype=self.target.dtype, device=self.target.device)
        for b, p in enumerate(state.pending):
            feats[b, : p.shape[0]] = p
        store = state.cache
        plan = store.plan(length=n)  # positions: each row's next n
        for i, (k, v) in enumerate(self.model.context_kv(self.model.project_context(feats), plan.position_ids)):
            store.write(i, k, v)
        store.commit(torch.arange(n, device=counts.device).unsqueeze(0) < counts.unsqueeze(1))  # padding: holes
        store.maybe_compact()
        state.pending[:] = [p[:0] for p in state.pending]

    @torch.inference_mode()
    def block_hidden(self, state: BlockState, length: int) -> Tensor:
        """One forward of the block ``[anchor, MASK × (length−1)]``: final hidden [B, length, D]."""
        self.extend_context(state)
        B, dev = state.anchors.shape[0], self.target.device
        tokens = torch.full((B, length), self.cfg.mask_token_id, dtype=torch.long, device=dev)
        tokens[:, 0] = state.anchors
        positions = state.cache.lengths.unsqueeze(1) + torch.arange(length, device=dev)
        mode = self.target.capture_mode
        if mode != "eager" and state.cache.num_slots:
            return self._captured_block(state.cache, tokens, positions, mode)
        block = self.target.embed_tokens(tokens)
        mask = torch.cat([state.cache.valid, torch.ones(B, length, dtype=torch.bool, device=dev)], 1)
        mask = mask[:, None, :].expand(B, length, mask.shape[1])
        kv = [state.cache.layer(i) for i in range(len(self.model.layers))] if state.cache.num_slots \
            else [(block.new_zeros(B, self.cfg.num_key_value_heads, 0, self.cfg.head_dim),) * 2
                  for _ in self.model.layers]
        return self.model(block, positions, kv, mask)

    def _captured_block(self, store: KVStore, tokens: Tensor, positions: Tensor, mode: str) -> Tensor:
        """:meth:`block_hidden`'s forward, captured (:mod:`specdec.capture`): outside the recording the
        mask over the whole capacity and the key; inside, the embedding and every draft layer."""
        B, length = tokens.shape
        mask = torch.cat([store.static_valid(), torch.ones(B, length, dtype=torch.bool, device=tokens.device)], 1)
        mask = mask[:, None, :].expand(B, length, mask.shape[1])
        if self._steps is None or self._steps.mode != mode or self._steps.device != tokens.device:
            self._steps = CapturedSteps(self._static_block, mode, tokens.device)
        self._static_store = store
        try:
            return self._steps((length, store.buffer_key()), tokens, positions, mask)
        finally:
            self._static_store = None  # the session's context must die with it

    def _static_block(self, tokens: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
        """The captured region: the block over :attr:`_static_store`'s whole buffers."""
        store = self._static_store
        assert store is not None
        kv = [store.buffers(i) for i in range(len(self.model.layers))]
        return self.model(self.target.embed_tokens(tokens), positions, kv, mask)

    @classmethod
    def tiny(cls, target: Target, **overrides: Any) -> BlockDrafter:
        seed, std = overrides.pop("seed", 1), overrides.pop("init_std", 0.3)
        overrides.pop("checkpoint", None)  # random weights: a configured checkpoint is for real targets
        opts = {k: overrides.pop(k) for k in cls.options if k in overrides}
        torch.manual_seed(seed)
        cfg = tiny_block_config(target, cls.model_class.config_class, **{**cls.tiny_config, **overrides})
        model = cls.model_class(cfg)
        model.init_weights(std)
        d = cls(model, **opts)
        d.bind(target)
        return d

    @classmethod
    def create(cls, target: Target, **options: Any) -> BlockDrafter:
        """``checkpoint`` (a folder) or ``model`` (a :class:`BlockDraftModel`), plus the
        subclass's own options (``greedy_draft``; DSpark's scheduler settings)."""
        model = cls._load(options)
        d = cls(model, **options)
        d.bind(target)
        return d

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """``model`` or ``checkpoint`` (read by :meth:`_load`), then the constructor's options."""
        return ("model", "checkpoint", *cls.options)

    @classmethod
    def _load(cls, options: dict[str, Any]) -> BlockDraftModel:
        from specdec.drafters.dflash.checkpoint import checkpoint_family, load_block_draft

        model = options.pop("model", None)
        if model is not None:
            return model
        path = options.pop("checkpoint", None)
        if not path or not Path(path).is_dir():
            raise ValueError(f"{cls.name} needs `checkpoint`, a local folder (z-lab, speculators or DeepSpec"
                             f" layout), or `model`; got {path!r}")
        model = load_block_draft(path)
        family, field = checkpoint_family(json.loads((Path(path) / "config.json").read_text()))
        if family != cls.name:
            raise ValueError(f"{cls.name} cannot draft with {path}: it is a {family} checkpoint ({field});"
                             f" use the {family} drafter")
        return model


class DFlashDrafter(BlockDrafter):
    name = "dflash"

    def __init__(self, model: BlockDraftModel, greedy_draft: bool = False, head_dtype: str = "",
                 token_map: str | Sequence[int] = "", draft_vocab: int = 0):
        if model.cfg.anchor_predicts:
            raise ValueError(f"dflash needs a model whose anchor does not draft; {type(model).__name__}'s does"
                             " (anchor_predicts: a DSpark model); use the dspark drafter")
        super().__init__(model, greedy_draft, head_dtype, token_map, draft_vocab)

    @torch.inference_mode()
    def propose(self, state: BlockState, k: int, rows: RowSampling) -> DraftProposal:
        hidden = self.block_hidden(state, k + 1)[:, 1:]  # position j drafts the token at P + j
        logits = self.target.logits(hidden, self.head_dtype, self.drafted_ids())  # [B, k, V]
        return DraftProposal.chain(*rows.draw(logits, self.greedy_draft or rows.all_greedy))

"""EAGLE-3 drafting (arXiv 2503.01840): a one-layer draft head on fused target features.

The draft reads the target's residual stream at the input of three layers (default
``(2, L//2, L-3)``, ``Requirements.layer_inputs``), fuses it with ``fc`` and runs one decoder layer
(:mod:`specdec.drafters.eagle3.model`). Context slot ``i`` reads ``emb(t_{i+1})`` and the target's
features at ``t_i``, at position ``i``; its output predicts ``t_{i+2}``. A draft node at depth
``j`` reads its own token and its parent's output (the draft's own hidden state), at position
``P + j - 1`` for ``P`` committed slots: exactly what training-time test unrolls
(:mod:`specdec.drafters.eagle3.train`).

**Draft KV cache.** A one-layer :class:`~specdec.kv.KVStore` holds the context slots, each computed
from target features. Draft nodes keep their K/V in a per-proposal tree buffer and attend to the
valid cache slots plus their own ancestors. After verification the buffer is dropped (rejected
nodes roll back for free) and the accepted path is appended to the cache again, this time with the
target's features, as training saw it; rows that accept fewer tokens leave holes, compacted once
they pass the store's compaction threshold.

**Captured draft blocks** (the target's ``capture`` switch, :mod:`specdec.capture`): off eager,
each block of draft nodes runs in a static form (attention over the cache buffers' whole capacity
under a mask, the window as a mask too), recorded once per (block shape, tree so far, cache
buffers) and replayed; the tree bookkeeping (parents' outputs, ancestor masks) and the context
pass of :meth:`Eagle3Drafter.observe` stay outside the recording.

**Proposals.**
- ``tree="chain"``: ``k`` draws; exact warped q (sampling) or argmax with q None.
- ``tree="static"``: ``static_tree`` paths (vLLM ``speculative_token_tree``), cut at depth ``k``.
  Sampling draws a node's children *without replacement* from the warped draft distribution; child
  ``r``'s q is that distribution renormalised without its earlier siblings (one-hot on the best
  remaining draft token once the warped mass is used up), which recursive rejection sampling
  (:mod:`specdec.verifiers.rejection`, :mod:`specdec.kernels.rejection`) verifies exactly.
  Greedy: the top-``c`` tokens, q None.
- ``tree="dynamic"``: EAGLE-2 (:func:`~specdec.drafters.eagle3.tree.rerank`), depth ``k``,
  ``tree_top_k`` children per expanded node, ``tree_budget`` nodes; always deterministic (q None),
  since which sampled node to keep would depend on the draws themselves.

Shapes: ``B`` rows, ``w`` nodes in one block, ``N`` forwarded tree nodes, ``S`` cache slots,
``d`` draft hidden size, ``V`` target vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specdec.capture import BufferArena, CapturedSteps
from specdec.drafter import Drafter
from specdec.drafters.eagle3.model import Eagle3Model, Eagle3Spec, attend, draft_layer_config
from specdec.drafters.eagle3.tree import (DEFAULT_STATIC_TREE, MAX_TREE_DEPTH, StaticTree, chain_tree, parse_tree,
                                          rerank)
from specdec.kv import KVStore
from specdec.sampling import RowSampling, argmax
from specdec.target import Target
from specdec.types import Committed, DraftProposal, Requirements
from specdec.validate import as_float_dtype

__all__ = ["Eagle3Config", "Eagle3Drafter", "Eagle3State", "TREES", "DEFAULT_STATIC_TREE"]

TREES = ("chain", "static", "dynamic")


@dataclass(frozen=True)
class Eagle3Config:
    checkpoint: str = ""  # a speculators or SafeAILab EAGLE-3 folder
    tree: str = "chain"  # chain | static | dynamic
    static_tree: str | list = DEFAULT_STATIC_TREE  # paths of child ranks, as vLLM's speculative_token_tree
    tree_top_k: int = 4  # dynamic: children per expanded node, nodes expanded per depth (EAGLE-2: 10)
    tree_budget: int = 16  # dynamic: draft nodes kept after reranking (EAGLE-2: 59, + the root = 60)
    greedy_draft: bool = False  # argmax drafts (q None) even when sampling
    dtype: str = ""  # the draft's weights and cache: "" the target's; "bfloat16" halves the bytes a draft step reads
    confidence: bool = False  # greedy drafts report each drafted token's draft probability (DraftProposal.confidence)
    window: int = 0  # draft attention over the context positions of the last `window` only (0: all); the cache keeps every slot

    def __post_init__(self) -> None:
        as_float_dtype("dtype", self.dtype)
        if self.tree not in TREES:
            raise ValueError(f"tree must be one of {TREES}, got {self.tree!r}")
        if self.tree_top_k < 1:
            raise ValueError(f"tree_top_k must be >= 1, got {self.tree_top_k}")
        if self.tree_budget < 1:
            raise ValueError(f"tree_budget must be >= 1, got {self.tree_budget}")
        if self.tree == "static":
            parse_tree(self.static_tree)  # raises on a malformed tree
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"window must be an int >= 0 (0: attend to the whole context), got {self.window!r}")


@dataclass
class Eagle3State:
    cache: KVStore  # context slots, computed from target features
    root: Tensor  # [B, d] output of each row's last context slot: the parent of depth-1 nodes


@dataclass
class _Tree:
    """K/V and outputs of the draft nodes forwarded in one proposal."""

    h: list[Tensor] = field(default_factory=list)  # [B, w, d] per block
    k: list[Tensor] = field(default_factory=list)  # [B, Hkv, w, hd] per block
    v: list[Tensor] = field(default_factory=list)
    anc: Tensor | None = None  # [B, N, N] ancestor-or-self among forwarded nodes

    @property
    def n(self) -> int:
        return 0 if self.anc is None else self.anc.shape[1]


class Eagle3Drafter(Drafter):
    name = "eagle3"
    options_class = Eagle3Config

    def __init__(self, model: Eagle3Model, config: Eagle3Config = Eagle3Config()):
        self.model = model.eval()
        self.config = config
        self.static = parse_tree(config.static_tree) if config.tree == "static" else None
        self._steps: CapturedSteps | None = None  # the captured draft block, made on first use
        self._arena = BufferArena()  # the draft cache's buffers a recording points at, across sessions
        self._static_cache: KVStore | None = None  # the draft cache of the block being recorded or replayed

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def create(cls, target: Target, model: Eagle3Model | None = None, **options: Any) -> Eagle3Drafter:
        """``model`` (an :class:`Eagle3Model`) or ``checkpoint`` (a folder), plus :class:`Eagle3Config` fields."""
        config = Eagle3Config(**options)
        if model is None:
            if not config.checkpoint:
                raise ValueError("eagle3 needs `checkpoint`: a speculators or SafeAILab EAGLE-3 folder")
            from specdec.drafters.eagle3.checkpoint import load_eagle3

            model = load_eagle3(config.checkpoint, target.num_layers)
        d = cls(model, config)
        d.bind(target)
        return d

    @classmethod
    def tiny(cls, target: Target, **overrides: Any) -> Eagle3Drafter:
        """Random weights, three feature layers ``(0, L//2, L-1)`` (tiny targets are too shallow for
        ``(2, L//2, L-3)``), and a draft vocabulary of 3/4 of the target's, so the scatter to the
        full vocabulary is exercised."""
        seed = overrides.pop("seed", 1)
        draft_vocab = overrides.pop("draft_vocab_size", max(1, 3 * target.vocab_size // 4))
        L = target.num_layers
        layer_ids = tuple(overrides.pop("layer_ids", (0, L // 2, L - 1)))
        spec = Eagle3Spec(layer_ids, target.hidden_size, draft_vocab,
                          norm_before_residual=overrides.pop("norm_before_residual", True),
                          norm_before_fc=overrides.pop("norm_before_fc", False),
                          own_embedding=overrides.pop("own_embedding", False),
                          fc_norm=overrides.pop("fc_norm", False), norm_output=overrides.pop("norm_output", False))
        scale = overrides.pop("init_scale", 0.3)  # peaked draft distributions: top-k/top-p cut something
        g = torch.Generator().manual_seed(seed)
        model = Eagle3Model(draft_layer_config(target), spec)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=g) * scale)
            used = torch.randperm(target.vocab_size, generator=g)[:draft_vocab].sort().values
            model.d2t.copy_(used - torch.arange(draft_vocab))
            model.t2d.zero_().index_fill_(0, used, True)
        d = cls(model, Eagle3Config(**overrides))
        d.bind(target)
        return d

    def requirements(self) -> Requirements:
        return Requirements(layer_inputs=self.model.spec.layer_ids)

    def bind(self, target: Target) -> None:
        spec, cfg = self.model.spec, self.model.config
        if spec.target_hidden_size != target.hidden_size:
            raise ValueError(f"eagle3 fc expects target hidden size {spec.target_hidden_size},"
                             f" the target has {target.hidden_size}")
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"eagle3 vocabulary {cfg.vocab_size} != the target's {target.vocab_size}")
        if self.model.embed_tokens is None and target.hidden_size != cfg.hidden_size:
            raise ValueError(f"eagle3 shares the target's embedding, whose width {target.hidden_size}"
                             f" is not the draft hidden size {cfg.hidden_size}: the checkpoint needs embed_tokens")
        for i in spec.layer_ids:
            if not 0 <= i <= target.num_layers:
                raise ValueError(f"eagle3 layer id {i} outside [0, {target.num_layers}] for this target")
        self.model.check_vocab_map()
        self.model.to(device=target.device, dtype=as_float_dtype("dtype", self.config.dtype) or target.dtype)
        super().bind(target)

    # --- the contract -------------------------------------------------------------------------
    def check_k(self, k: int) -> None:
        """Chains and dynamic trees are ``k`` deep, capped at :data:`MAX_TREE_DEPTH`; a static tree
        is cut at ``k`` (its own depth is checked when it is parsed), so any ``k`` suits it."""
        mode = self.config.tree
        if mode != "static" and k > MAX_TREE_DEPTH:
            what = "a chain of" if mode == "chain" else "a dynamic tree of depth"
            raise ValueError(f"eagle3 tree={mode!r} drafts {what} k; k={k} exceeds its cap of {MAX_TREE_DEPTH}"
                             f" (one draft forward per depth, heads trained over a few steps): use k <= {MAX_TREE_DEPTH}")

    def start(self, prefill: Committed, rows: RowSampling) -> Eagle3State:
        B = prefill.tokens.shape[0]
        cache = KVStore(B, self.target.device, self.model.fc.weight.dtype)
        if self.target.capture_mode != "eager":
            self._arena.attach(cache)
        state = Eagle3State(cache, torch.zeros(0))
        self._ingest(state, prefill)
        return state

    def observe(self, state: Eagle3State, committed: Committed) -> None:
        self._ingest(state, committed)
        state.cache.maybe_compact()

    def select_rows(self, state: Eagle3State, rows: Tensor) -> None:
        state.cache.select_rows(rows.to(state.cache.device))
        state.root = state.root[rows.to(state.root.device)]

    @torch.inference_mode()
    def propose(self, state: Eagle3State, k: int, rows: RowSampling) -> DraftProposal:
        greedy = self.config.greedy_draft or rows.all_greedy
        if self.config.tree == "dynamic":
            return self._dynamic(state, k, self.config.tree_top_k, self.config.tree_budget)
        tree = chain_tree(k) if self.static is None else self.static.cut(k)
        return self._static(state, tree, rows, greedy)

    # --- context ------------------------------------------------------------------------------
    @torch.inference_mode()
    def _ingest(self, state: Eagle3State, c: Committed) -> None:
        """Append one context slot per committed token: (emb(next token), target features).

        A slot's K/V do not depend on attention, and only each row's last slot's output is read
        (the root of the next draft), so attention and the MLP run for that one query: the
        prompt's pass costs its projections, not m² attention (the prompt is one block: batched,
        once, at prefill)."""
        B, m = c.tokens.shape
        dev, model, cache = self.target.device, self.model, state.cache
        idx = torch.arange(m, device=dev).unsqueeze(0)
        n = c.num_tokens.to(dev)
        nxt = torch.cat([c.tokens[:, 1:], c.tokens[:, :1]], dim=1).to(dev)
        last = idx == (n - 1).unsqueeze(1)
        tokens = torch.where(last, c.next_tokens.to(dev).unsqueeze(1), nxt).clamp(min=0)
        feats = torch.cat([c.hidden[i] for i in model.spec.layer_ids], dim=-1)
        g = model.fuse(feats)
        S = cache.num_slots
        plan = cache.plan(length=m, implicit_causal=True)  # positions only: no mask is read here
        cos, sin = model.rope(g, plan.position_ids)
        q, k, v, res = model.layer.qkv(self._embed(tokens), g, cos, sin)
        keys, values = cache.write(0, k, v)
        at = (n - 1).clamp(min=0)  # [B] each row's last committed slot in the block
        q1 = q.gather(2, at.view(B, 1, 1, 1).expand(-1, q.shape[1], 1, q.shape[3]))  # [B, H, 1, hd]
        res1 = res.gather(1, at.view(B, 1, 1).expand(-1, 1, res.shape[-1]))  # [B, 1, d]
        allowed = torch.cat([cache.valid, idx <= at.unsqueeze(1)], dim=1)  # [B, S + m]: the slots before it and itself
        key_pos = torch.cat([cache.slot_pos, plan.position_ids], dim=1)
        lo, allowed = self._window(allowed, key_pos, plan.position_ids.gather(1, at.unsqueeze(1)))
        y = model.layer.finish(attend(q1, keys[:, :, lo:], values[:, :, lo:], allowed.unsqueeze(1)), res1)
        cache.commit(idx < n.unsqueeze(1))
        state.root = y[:, 0]

    def _window(self, allowed: Tensor, key_pos: Tensor, query_pos: Tensor) -> tuple[int, Tensor]:
        """The draft's attention window over ``allowed`` [B, S'] keys at ``key_pos`` [B, S'] for a
        query at ``query_pos`` [B, 1] (every query of one draft forward shares the context slots'
        window): keys within the last :attr:`Eagle3Config.window` positions, and the first slot
        any row still reads, so that the slots before it are not even loaded. (0, allowed) when
        the window is off."""
        w = self.config.window
        if not w:
            return 0, allowed
        allowed = allowed & (key_pos > query_pos - w)
        first = torch.where(allowed.any(0), torch.arange(allowed.shape[1], device=allowed.device), allowed.shape[1])
        lo = min(int(first.min()), max(allowed.shape[1] - 1, 0))
        return lo, allowed[:, lo:]

    def _embed(self, tokens: Tensor) -> Tensor:
        own = self.model.embed_tokens
        return (own(tokens) if own is not None else self.target.embed(tokens)).to(self.model.fc.weight.dtype)

    # --- draft nodes --------------------------------------------------------------------------
    def _forward(self, state: Eagle3State, tree: _Tree, tokens: Tensor, parent: Tensor, depth: int) -> Tensor:
        """Run a block of draft nodes at ``depth``: tokens [B, w], parent [B, w] (forwarded-node
        index, -1 for the root). Appends them to ``tree``; returns their outputs [B, w, d]."""
        B, w = tokens.shape
        model, cache, dev = self.model, state.cache, tokens.device
        N = tree.n
        has = parent >= 0
        if N:
            hs = torch.cat(tree.h, dim=1)
            p = parent.clamp(min=0)
            g = torch.where(has.unsqueeze(-1), hs.gather(1, p.unsqueeze(-1).expand(-1, -1, hs.shape[-1])),
                            state.root.unsqueeze(1))
            anc = tree.anc.gather(1, p.unsqueeze(-1).expand(-1, -1, N)) & has.unsqueeze(-1)  # [B, w, N]
        else:
            g = state.root.unsqueeze(1).expand(B, w, -1)
            anc = torch.zeros(B, w, 0, dtype=torch.bool, device=dev)
        pos = (cache.lengths.unsqueeze(1) + depth - 1).expand(B, w)
        mode = self.target.capture_mode
        if mode != "eager":
            y, k, v = self._captured_block(state.cache, tree, tokens, g, pos, anc, depth, mode)
            self._grow(tree, anc, y, k, v)
            return y
        g = model.carry(g)  # the parent's output as the next step reads it
        cos, sin = model.rope(g, pos)
        q, k, v, res = model.layer.qkv(self._embed(tokens), g, cos, sin)
        ctx_k, ctx_v = cache.layer(0)
        # the context slots a node reads (a window, when set, measured from the draft's first position:
        # a draft is a few positions long, so every depth of it reads the same context slots)
        lo, ctx = self._window(cache.valid, cache.slot_pos, pos[:, -1:] - (depth - 1))
        keys = torch.cat([ctx_k[:, :, lo:], *tree.k, k], dim=2)
        values = torch.cat([ctx_v[:, :, lo:], *tree.v, v], dim=2)
        eye = torch.eye(w, dtype=torch.bool, device=dev).expand(B, w, w)
        allowed = torch.cat([ctx.unsqueeze(1).expand(B, w, ctx.shape[1]), anc, eye], dim=-1)
        y = model.layer.finish(attend(q, keys, values, allowed), res)
        self._grow(tree, anc, y, k, v)
        return y

    @staticmethod
    def _grow(tree: _Tree, anc: Tensor, y: Tensor, k: Tensor, v: Tensor) -> None:
        """Append a forwarded block (its ancestors among earlier nodes ``anc`` [B, w, N]) to ``tree``."""
        (B, w), N, dev = y.shape[:2], tree.n, y.device
        eye = torch.eye(w, dtype=torch.bool, device=dev).expand(B, w, w)
        new_rows = torch.cat([anc, eye], dim=-1)  # [B, w, N + w]
        old = tree.anc if N else torch.zeros(B, 0, 0, dtype=torch.bool, device=dev)
        old = torch.cat([old, torch.zeros(B, N, w, dtype=torch.bool, device=dev)], dim=-1)
        tree.anc = torch.cat([old, new_rows], dim=1)
        tree.h.append(y)
        tree.k.append(k)
        tree.v.append(v)

    def _captured_block(self, cache: KVStore, tree: _Tree, tokens: Tensor, g: Tensor, pos: Tensor, anc: Tensor,
                        depth: int, mode: str) -> tuple[Tensor, Tensor, Tensor]:
        """A block of draft nodes, captured (:mod:`specdec.capture`): the mask over the cache's whole
        capacity (and the window) outside the recording; the layer inside. Returns y, k, v."""
        (B, w), dev = tokens.shape, tokens.device
        ctx = cache.static_valid()
        if self.config.window:  # the window as a mask: no slot range read on the host
            ctx = ctx & (cache.static_slot_pos() > pos[:, -1:] - (depth - 1) - self.config.window)
        eye = torch.eye(w, dtype=torch.bool, device=dev).expand(B, w, w)
        allowed = torch.cat([ctx.unsqueeze(1).expand(B, w, ctx.shape[1]), anc, eye], dim=-1)
        if self._steps is None or self._steps.mode != mode or self._steps.device != dev:
            self._steps = CapturedSteps(self._static_block, mode, dev)
        key = (B, w, tuple(x.shape[2] for x in tree.k), cache.buffer_key())
        self.model.layer._qkv_weight()  # the fused q/k/v weight, current before the recording reads it
        self._static_cache = cache
        try:
            return self._steps(key, tokens, g, pos, allowed, *tree.k, *tree.v)
        finally:
            self._static_cache = None  # the session's cache must die with it

    def _static_block(self, tokens: Tensor, g: Tensor, pos: Tensor, allowed: Tensor, *tree_kv: Tensor
                      ) -> tuple[Tensor, Tensor, Tensor]:
        """The captured region: a block of draft nodes over :attr:`_static_cache`'s whole buffers and
        the tree's earlier nodes (``tree_kv``: their keys, then their values)."""
        model, cache = self.model, self._static_cache
        assert cache is not None
        g = model.carry(g)
        cos, sin = model.rope(g, pos)
        q, k, v, res = model.layer.qkv(self._embed(tokens), g, cos, sin)
        ctx_k, ctx_v = cache.buffers(0)
        half = len(tree_kv) // 2
        keys = torch.cat([ctx_k, *tree_kv[:half], k], dim=2)
        values = torch.cat([ctx_v, *tree_kv[half:], v], dim=2)
        return model.layer.finish(attend(q, keys, values, allowed), res), k, v

    def _static(self, state: Eagle3State, tree: StaticTree, rows: RowSampling, greedy: bool) -> DraftProposal:
        """A chain or static tree: children drawn per parent in rank order (see the module docstring)."""
        B, n, V = state.root.shape[0], len(tree.paths), self.target.vocab_size
        dev = state.root.device
        tokens = torch.zeros(B, n, dtype=torch.long, device=dev)
        q = None if greedy else torch.zeros(B, n, V, device=dev)
        conf = torch.zeros(B, n, device=dev) if greedy and self.config.confidence else None
        # node → logits of its children: over the draft vocabulary when greedy (ranked, then mapped to
        # target ids), over the target's when sampling (q is a distribution over it)
        scores = self.model.draft_logits if greedy else self.model.full_logits
        logits = {-1: scores(state.root)}
        fwd: dict[int, int] = {}  # node → forwarded index
        buf = _Tree()
        for depth in range(1, tree.depth + 1):
            nodes = tree.nodes_at(depth)
            for parent in dict.fromkeys(tree.parents[i] for i in nodes):
                kids = [i for i in nodes if tree.parents[i] == parent]
                self._draw_children(logits[parent], kids, tokens, q, rows, self.model.draft_ids, conf)
            expand = [i for i in nodes if tree.children(i)]
            if expand:
                par = torch.tensor([fwd.get(tree.parents[i], -1) for i in expand], device=dev).expand(B, -1)
                base = buf.n
                y = self._forward(state, buf, tokens[:, expand], par, depth)
                for j, i in enumerate(expand):
                    fwd[i] = base + j
                    logits[i] = scores(y[:, j])
        if self.static is None:  # a chain: the target takes its chain path (no ancestor matrix, no 4-D mask)
            return DraftProposal.chain(tokens, q, confidence=conf)
        parents = torch.tensor(tree.parents, dtype=torch.long, device=dev).expand(B, n).clone()
        return DraftProposal(tokens, parents, q, confidence=conf)

    @staticmethod
    def _draw_children(logits: Tensor, kids: list[int], tokens: Tensor, q: Tensor | None, rows: RowSampling,
                       draft_ids: Tensor, conf: Tensor | None = None) -> None:
        """Fill ``tokens`` (and ``q``; ``conf``, the greedy draft's probability of each drafted
        token, when given) for sibling nodes ``kids`` in draw order; ``logits`` are over the draft
        vocabulary when ``q`` is None (greedy), over the target's otherwise."""
        if q is None:
            top = argmax(logits).unsqueeze(-1) if len(kids) == 1 else logits.topk(len(kids), dim=-1).indices
            tokens[:, kids] = draft_ids[top]
            if conf is not None:
                conf[:, kids] = logits.float().softmax(-1).gather(-1, top).to(conf.dtype)
            return
        base = rows.probs(logits)  # [B, V] warped like the target
        used = torch.zeros_like(base, dtype=torch.bool)
        for j in kids:
            rest = base.masked_fill(used, 0.0)
            mass = rest.sum(-1, keepdim=True)
            best = logits.masked_fill(used, float("-inf")).argmax(-1, keepdim=True)
            fallback = torch.zeros_like(base).scatter_(1, best, 1.0)
            qj = torch.where(mass > 0, rest / mass.clamp(min=1e-30), fallback)
            x = rows.sample(qj)
            tokens[:, j], q[:, j] = x, qj
            used.scatter_(1, x.unsqueeze(1), True)

    def _dynamic(self, state: Eagle3State, k: int, K: int, budget: int) -> DraftProposal:
        """EAGLE-2: expand the K best nodes per depth with their K best children, then rerank."""
        B, dev = state.root.shape[0], state.root.device
        K = min(K, self.model.spec.draft_vocab_size)  # a node has no more children than draft tokens
        buf = _Tree()
        ids = self.model.draft_ids  # ranked over the draft vocabulary, kept as target ids
        logp = self.model.draft_logits(state.root).log_softmax(-1)  # [B, Vd]
        top = logp.topk(K, dim=-1)
        toks, scores = [ids[top.indices]], [top.values]
        depths, parents = [torch.ones(B, K, dtype=torch.long, device=dev)], [torch.full((B, K), -1, device=dev)]
        frontier = torch.arange(K, device=dev).expand(B, K)  # candidate index of each frontier node
        front_fwd = torch.full((B, K), -1, device=dev)  # their parents' forwarded indices
        front_tok, front_score, C = toks[0], top.values, K
        for d in range(2, k + 1):
            base = buf.n
            y = self._forward(state, buf, front_tok, front_fwd, d - 1)
            lp = self.model.draft_logits(y).log_softmax(-1)  # [B, K, Vd]
            child = lp.topk(K, dim=-1)
            cand_score = (front_score.unsqueeze(-1) + child.values).flatten(1)  # [B, K*K]
            cand_tok = ids[child.indices.flatten(1)]
            cand_parent = frontier.unsqueeze(-1).expand(B, K, K).flatten(1)
            toks.append(cand_tok)
            scores.append(cand_score)
            depths.append(torch.full_like(cand_tok, d))
            parents.append(cand_parent)
            best = torch.sort(-cand_score, dim=1, stable=True).indices[:, :K]  # next frontier
            frontier = C + best
            front_fwd = base + best // K
            front_tok, front_score = cand_tok.gather(1, best), cand_score.gather(1, best)
            C += K * K
        kept, new_parents = rerank(torch.cat(scores, 1), torch.cat(depths, 1), torch.cat(parents, 1).long(), budget)
        return DraftProposal(torch.cat(toks, 1).gather(1, kept), new_parents, None)

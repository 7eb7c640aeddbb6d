"""Native multi-token prediction (MTP / NextN) drafting with DeepSeek-V3's MTP modules.

DeepSeek-V3 (arXiv 2412.19437, §2.2) trains ``D`` sequential MTP modules with the main model.
Module ``d`` at position ``i`` combines depth ``d-1``'s representation with the embedding of
``t_{i+d}`` and predicts ``t_{i+d+1}``:

    x     = eh_proj( cat[ enorm(emb(t_{i+d})), hnorm(h^{d-1}_i) ] )   # embedding first, as the
    h^d_i = shared_head.norm( mtp_block(x) )                            # released weights use it
    p(t_{i+d+1}) = softmax( lm_head(h^d_i) )

The embedding and LM head are the target's own; ``mtp_block`` is one decoder layer of the
target's architecture (MLA + MoE for DeepSeek-V3). ``h^0`` is the target's **post-final-norm**
hidden state (``Requirements(final_hidden=True)``), what transformers' ``generate(use_mtp=True)``
feeds; the next depth gets ``h^d`` after ``shared_head.norm`` as transformers does
(``chain_hidden="normed"``), or the block's residual output as vLLM's
``DeepSeekMultiTokenPredictorLayer`` returns it (``chain_hidden="residual"``).

**Streams.** Draft step ``j`` (0-based) runs module ``policy(j)`` on its own *stream*: stream
``j`` at slot ``i`` reads ``emb(t_{i+j+1})`` and stream ``j-1``'s output at slot ``i`` (stream
-1 is the target), at position ``i+j+1``, and attends to its own past slots through its own KV
cache. Every stream's cache holds only teacher-forced slots (all tokens known, what the module
saw in training at that depth); the slots that read draft tokens are computed each step and
left as holes. For ``j < D`` this is exactly transformers' ``MtpModel``; for ``k > D`` the
policy picks the module: ``cycle`` (``j mod D``), ``last`` (``D-1``) or ``first`` (``0``, what
vLLM upstream does, which passes no step index).

**Trees.** ``tree_top_k = K > 1`` takes the ``K`` most likely distinct first tokens and a greedy
chain under each (``K·k`` nodes, deterministic, so ``q = None``): every stream runs the ``K``
branches as one tree block over its committed slots.

**Checkpoints.** MTP modules are stored after the main layers, ``model.layers.{L+d}.*`` with
``num_nextn_predict_layers`` (alias ``num_mtp_layers``) in ``config.json``; only those keys are
read, through the ``weight_map`` of ``model.safetensors.index.json`` when sharded, so a 671B
checkpoint is never loaded whole. Layout conversion is in :mod:`specdec.drafters.mtp.checkpoint`.

**Captured streams** (the target's ``capture`` switch, :mod:`specdec.capture`): off eager, each
stream's block runs in a static form (writes at slot indices, attention over its cache's whole
capacity under a mask), recorded once per (stream, module, block width, cache buffers) and
replayed; building the block from the host's token lists stays outside the recording.

Shape symbols: ``B`` rows, ``W`` block width, ``D`` hidden size, ``V`` vocabulary, ``K`` branches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from specdec.capture import BufferArena, CapturedSteps
from specdec.draft_vocab import draft_vocabulary
from specdec.drafter import Drafter
from specdec.drafters.mtp.checkpoint import load_mtp_modules
from specdec.drafters.mtp.modules import MTPModule, build_mtp_modules
from specdec.kv import BlockPlan, KVStore
from specdec.sampling import RowSampling, argmax
from specdec.target import Target
from specdec.types import Committed, DraftProposal, Requirements
from specdec.validate import as_float_dtype, as_int

__all__ = ["MTPConfig", "MTPModule", "MTPDrafter", "MTPState", "build_mtp_modules",
           "module_for_step", "POLICIES"]

POLICIES = ("cycle", "last", "first")


@dataclass(frozen=True)
class MTPConfig:
    checkpoint: str = ""  # folder holding model.layers.{L+d}.*; "" = the target's own folder
    policy: str = "cycle"  # which module drafts step j >= D: cycle (j mod D), last, first (vLLM upstream)
    tree_top_k: int = 1  # 1 = chain; K > 1 = K distinct first tokens, a greedy chain under each
    greedy_draft: bool = False  # argmax drafts (q = None) even when sampling
    chain_hidden: str = "normed"  # feed the next depth h after shared_head.norm (transformers) or "residual" (vLLM)
    head_dtype: str = ""  # the target's LM head as drafts read it: "" its own; "bfloat16" a bf16 copy (most of a step)
    token_map: str | Sequence[int] = ""  # draft over the ids of this token map only (specdec.draft_vocab)
    draft_vocab: int = 0  # ... its first this many (0: all)

    def __post_init__(self) -> None:
        as_float_dtype("head_dtype", self.head_dtype)
        as_int("draft_vocab", self.draft_vocab, minimum=0)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.tree_top_k < 1:
            raise ValueError(f"tree_top_k must be >= 1, got {self.tree_top_k}")
        if self.chain_hidden not in ("normed", "residual"):
            raise ValueError(f"chain_hidden must be 'normed' or 'residual', got {self.chain_hidden!r}")


def module_for_step(j: int, depth: int, policy: str) -> int:
    """Index of the MTP module that drafts step ``j`` (0-based) with ``depth`` modules."""
    if j < depth:
        return j
    return {"cycle": j % depth, "last": depth - 1, "first": 0}[policy]


@dataclass
class _Stream:
    cache: KVStore  # one layer per MTP module; a stream writes its module's
    hidden_in: list[Tensor]  # per row: inputs [n, D] for this stream's next committed slots


@dataclass
class MTPState:
    history: list[list[int]]  # every known token per row, the pending next token included
    main_hidden: list[Tensor]  # per row: target hidden [n, D] not yet consumed by stream 0
    streams: list[_Stream] = field(default_factory=list)


class MTPDrafter(Drafter):
    name = "mtp"
    options_class = MTPConfig

    def __init__(self, modules: nn.ModuleList, config: MTPConfig = MTPConfig()):
        if len(modules) < 1:
            raise ValueError("MTP needs at least one module")
        self.modules = modules.eval()
        self.config = config
        self._steps: CapturedSteps | None = None  # the captured stream block, made on first use
        self._arena = BufferArena()  # the streams' cache buffers a recording points at, across sessions
        self._static: tuple[KVStore, int] | None = None  # the stream cache and module of the block being replayed
        self.head_dtype = as_float_dtype("head_dtype", config.head_dtype)
        self.depth = len(modules)

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def create(cls, target: Target, modules: nn.ModuleList | None = None, **options: Any) -> MTPDrafter:
        """``modules`` (an ``nn.ModuleList`` of :class:`MTPModule`) or ``checkpoint`` (a folder;
        default: the folder the target was loaded from), plus :class:`MTPConfig` fields."""
        config = MTPConfig(**options)
        if modules is None:
            folder = config.checkpoint or getattr(target.config, "_name_or_path", "")
            if not folder or not Path(folder).is_dir():
                raise ValueError(f"mtp needs `checkpoint`, a local folder with MTP layers; got {folder!r}"
                                 " (the target was not loaded from a local folder)")
            modules = load_mtp_modules(target, folder)
        d = cls(modules, config)
        d.bind(target)
        return d

    @classmethod
    def tiny(cls, target: Target, **overrides: Any) -> MTPDrafter:
        """Two random MTP modules of the target's family (k > 2 exercises the policy)."""
        depth, seed = overrides.pop("depth", 2), overrides.pop("seed", 1)
        torch.manual_seed(seed)
        d = cls(build_mtp_modules(target, depth), MTPConfig(**overrides))
        d.bind(target)
        return d

    def requirements(self) -> Requirements:
        return Requirements(final_hidden=True)

    def bind(self, target: Target) -> None:
        if not target.has_rotary():
            raise ValueError("mtp needs a target with one shared rotary embedding (Llama, Qwen3, Gemma 3, DeepSeek-V3)")
        width = self.modules[0].eh_proj.in_features
        if width != 2 * target.hidden_size:
            raise ValueError(f"MTP eh_proj expects hidden size {width // 2}, the target has {target.hidden_size}")
        self.modules.to(device=target.device, dtype=target.dtype)
        self.layer_type = target.layer_specs()[-1].layer_type  # every MTP block's (build_mtp_modules)
        vocab = draft_vocabulary(self.config.token_map, self.config.draft_vocab, target.vocab_size)
        if vocab is not None and vocab.numel() < self.config.tree_top_k:
            raise ValueError(f"tree_top_k={self.config.tree_top_k} needs as many drafted ids; the draft vocabulary"
                             f" has {vocab.numel()}")
        self.vocab = None if vocab is None else vocab.to(target.device)
        super().bind(target)

    # --- the contract -------------------------------------------------------------------------
    def start(self, prefill: Committed, rows: RowSampling) -> MTPState:
        assert prefill.final_hidden is not None, "the target did not hand out final_hidden"
        n = prefill.num_tokens.tolist()
        history = [t[:c] + [x] for t, c, x in zip(prefill.tokens.tolist(), n, prefill.next_tokens.tolist())]
        main = [prefill.final_hidden[b, :c] for b, c in enumerate(n)]
        return MTPState(history, main)

    def observe(self, state: MTPState, committed: Committed) -> None:
        assert committed.final_hidden is not None
        for b, (toks, n, nxt) in enumerate(zip(committed.tokens.tolist(), committed.num_tokens.tolist(),
                                               committed.next_tokens.tolist())):
            state.history[b].extend(toks[1:n])
            state.history[b].append(nxt)
            state.main_hidden[b] = torch.cat([state.main_hidden[b], committed.final_hidden[b, :n]])
        for s in state.streams:
            s.cache.maybe_compact()

    def select_rows(self, state: MTPState, rows: Tensor) -> None:
        idx = rows.tolist()
        state.history[:] = [state.history[i] for i in idx]
        state.main_hidden[:] = [state.main_hidden[i] for i in idx]
        for s in state.streams:
            s.cache.select_rows(rows.to(s.cache.device))
            s.hidden_in[:] = [s.hidden_in[i] for i in idx]

    @torch.inference_mode()
    def propose(self, state: MTPState, k: int, rows: RowSampling) -> DraftProposal:
        B, K = len(state.history), self.config.tree_top_k
        if not state.streams:  # one stream per draft step, each starting from slot 0
            state.streams = [_Stream(self._stream_store(B, j), [h[:0] for h in state.main_hidden]) for j in range(k)]
        elif len(state.streams) != k:
            raise ValueError(f"k changed from {len(state.streams)} to {k} within one generation")
        greedy = self.config.greedy_draft or K > 1
        drafts: list[list[list[int]]] = [[[] for _ in range(K)] for _ in range(B)]  # [B][K][j]
        tokens, qs = [], []
        tent: list[list[Tensor]] | None = None  # previous stream's tentative outputs [B][K] -> [n_t, D]
        for j in range(k):
            s = state.streams[j]
            if j == 0:  # stream 0 reads the target: move its new hidden states in
                for b in range(B):
                    s.hidden_in[b] = torch.cat([s.hidden_in[b], state.main_hidden[b]])
                    state.main_hidden[b] = state.main_hidden[b][:0]
            out, last, committed = self._run_stream(state, j, tent, drafts)
            if j + 1 < k:
                nxt = state.streams[j + 1]
                for b in range(B):
                    nxt.hidden_in[b] = torch.cat([nxt.hidden_in[b], committed[b]])
            tent = out
            logits = self.target.logits(last, self.head_dtype, self.vocab)  # [B, K, V] float32
            if j == 0 and K > 1:
                first = logits[:, 0].topk(K, dim=-1).indices  # [B, K] distinct, most likely first
                tokens.append(first)
            elif greedy:
                tokens.append(argmax(logits))
            else:
                x, q = rows.draw(logits[:, 0])
                qs.append(q)
                tokens.append(x.unsqueeze(1))
            for b in range(B):
                for br in range(K):
                    drafts[b][br].append(int(tokens[-1][b, br if tokens[-1].shape[1] > 1 else 0]))
        return self._proposal(tokens, qs, k, K, B)

    # --- helpers ------------------------------------------------------------------------------
    def _stream_store(self, batch: int, j: int) -> KVStore:
        """Stream ``j``'s cache (its buffers from the arena when the streams are captured)."""
        store = self.target.new_store(batch, self.depth)
        if self.target.capture_mode != "eager":
            self._arena.attach(store, tag=j)
        return store

    def _captured_stream(self, store: KVStore, index: int, plan: BlockPlan, embeds: Tensor, hid: Tensor, pos: Tensor,
                         mode: str) -> tuple[Tensor, Tensor]:
        """Module ``index`` over a stream block, captured (:mod:`specdec.capture`): the static ``plan``
        (over the cache's whole capacity), the rotary angles and the key outside the recording; the
        module inside."""
        mask = plan.attention_mask
        if isinstance(mask, dict):
            mask = mask[self.layer_type]
        cos, sin = self.target.rotary(embeds, pos, self.layer_type)
        if self._steps is None or self._steps.mode != mode or self._steps.device != embeds.device:
            self._steps = CapturedSteps(self._static_stream, mode, embeds.device)
        self._static = (store, index)
        try:
            return self._steps((index, embeds.shape[:2], store.buffer_key()), embeds, hid, cos, sin, pos, mask,
                               plan.slots)
        finally:
            self._static = None  # the session's caches must die with it

    def _static_stream(self, embeds: Tensor, hid: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, mask: Tensor,
                       slots: Tensor) -> tuple[Tensor, Tensor]:
        """The captured region: one MTP module over a stream cache's whole buffers."""
        assert self._static is not None
        store, index = self._static
        return self.modules[index](embeds, hid, (cos, sin), pos, mask, self.target.kv_cache(store, slots))

    def _run_stream(self, state: MTPState, j: int, tent, drafts):
        """One forward of stream ``j``: its new committed slots (kept in its cache) plus, per branch,
        its tentative slots (which read drafts; left as holes). Returns the tentative outputs
        [B][K] -> [n_t, D], the last slot's output [B, K, D] and the committed outputs [B] -> [n_c, D]."""
        s, cfg, K = state.streams[j], self.config, self.config.tree_top_k
        module = self.modules[module_for_step(j, self.depth, cfg.policy)]
        dev, D = self.target.device, self.target.hidden_size
        plans, tok, hid, parents, keep = self._block(state, j, tent, drafts)
        index = module_for_step(j, self.depth, cfg.policy)
        embeds = self.target.embed(tok.to(dev))
        hid = hid.to(device=dev, dtype=embeds.dtype)
        mode = self.target.capture_mode
        if mode != "eager" and s.cache.has_buffers(index):  # the stream's first block allocates them, eager
            plan = s.cache.plan(parents.to(dev), static=True)
            residual, normed = self._captured_stream(s.cache, index, plan, embeds, hid, plan.position_ids + j + 1, mode)
        else:
            plan = s.cache.plan(parents.to(dev))
            pos = plan.position_ids + j + 1  # stream j's slot i sits at position i + j + 1
            mask = plan.attention_mask
            if isinstance(mask, dict):  # sliding-window families: the block's own layer type
                mask = mask[self.layer_type]
            rotary = self.target.rotary(embeds, pos, self.layer_type)
            residual, normed = module(embeds, hid, rotary, pos, mask, self.target.kv_cache(s.cache))
        s.cache.commit(keep.to(dev))
        chain = normed if cfg.chain_hidden == "normed" else residual
        out, last, committed = [], [], []
        for b, (P, n_c, n_t) in enumerate(plans):
            s.hidden_in[b] = s.hidden_in[b][n_c:]
            committed.append(chain[b, :n_c])
            if j == 0:
                out.append([chain[b, n_c:n_c]] * K)
                last.append(normed[b, n_c - 1].expand(K, D))
            else:
                spans = [(n_c + br * n_t, n_c + (br + 1) * n_t) for br in range(K)]
                out.append([chain[b, lo:hi] for lo, hi in spans])
                last.append(torch.stack([normed[b, hi - 1] for _, hi in spans]))
        return out, torch.stack(last), committed

    def _block(self, state: MTPState, j: int, tent, drafts):
        """Inputs of stream ``j``'s block: per row the committed chain, then each branch's
        tentative chain. Returns the per-row (P, n_c, n_t), tokens [B, W], hidden [B, W, D],
        block-local parents [B, W] and the committed-slot mask [B, W]."""
        s, K = state.streams[j], self.config.tree_top_k
        c = s.cache.lengths.tolist()
        plans = []
        for b, hist in enumerate(state.history):
            P = len(hist) - 1  # the pending token t_P; target hidden known for slots 0..P-1
            n_c = max(0, P - j - c[b])  # slots whose input token is known
            n_t = P - c[b] - n_c  # slots reading drafts (j of them, fewer for short prompts)
            plans.append((P, n_c, n_t))
        B, width = len(plans), max(n_c + (K if j else 1) * n_t for _, n_c, n_t in plans)
        # tokens, parents and the mask are filled from host lists (moved once); hidden from device tensors
        tok = torch.zeros(B, width, dtype=torch.long, device="cpu")
        hid = torch.zeros(B, width, self.target.hidden_size, dtype=state.main_hidden[0].dtype,
                          device=state.main_hidden[0].device)
        parents = torch.full((B, width), -1, dtype=torch.long, device="cpu")
        keep = torch.zeros(B, width, dtype=torch.bool, device="cpu")
        for b, (P, n_c, n_t) in enumerate(plans):
            base = s.hidden_in[b]  # inputs for slots c..c+len-1
            for i in range(n_c):  # committed chain: slot c+i reads t_{c+i+j+1}
                tok[b, i] = state.history[b][c[b] + i + j + 1]
                parents[b, i] = i - 1
            hid[b, :n_c] = base[:n_c]
            keep[b, :n_c] = True
            for br in range(K if j else 0):
                seq = state.history[b] + drafts[b][br]
                h_t = torch.cat([base[n_c:], tent[b][br]])
                assert h_t.shape[0] == n_t, (h_t.shape, n_t)
                o = n_c + br * n_t
                for i in range(n_t):
                    tok[b, o + i] = seq[c[b] + n_c + i + j + 1]
                    parents[b, o + i] = n_c - 1 if i == 0 else o + i - 1
                hid[b, o:o + n_t] = h_t
        return plans, tok, hid, parents, keep

    def _proposal(self, tokens: list[Tensor], qs: list[Tensor], k: int, K: int, B: int) -> DraftProposal:
        dev = self.target.device
        if K == 1:
            q = torch.stack(qs, 1) if qs else None
            return DraftProposal.chain(torch.cat(tokens, 1).to(dev), q)
        # nodes: the K first tokens, then each branch's chain of k-1 (parents before children)
        cols, parents = [tokens[0]], [-1] * K
        for br in range(K):
            for d in range(1, k):
                cols.append(tokens[d][:, br:br + 1])
                parents.append(br if d == 1 else len(parents) - 1)
        tok = torch.cat(cols, 1).to(dev)
        par = torch.tensor(parents, dtype=torch.long, device=dev).expand(B, -1).clone()
        return DraftProposal(tok, par, None)

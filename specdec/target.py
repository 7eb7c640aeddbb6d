"""The target: an adapter over any Hugging Face causal LM.

It runs one forward over a block of new tokens (a chain or a tree, with a tree mask and
per-node positions), captures the residual-stream hidden states a drafter asked for with forward
hooks (only the layers asked for, never the full ``output_hidden_states`` tuple, and only for the
generation that asked: :meth:`Target.capturing`), and keeps the
KV cache ragged across rows in a :class:`~specdec.kv.KVStore` (handed to transformers through
:mod:`specdec.target_cache`, the only code that knows its cache classes).

Layer-id convention: id ``i`` is the input of decoder layer ``i``; id ``L`` is the output of the
last layer before the final norm. DFlash/DSpark name layers by their *output*; convert with
:func:`layer_output_ids`.

**Fast paths** (``Target(fast=True)``, the default; ``fast=False`` runs every block through the
general tree path, for comparisons): a chain builds no ancestor matrix, and a chain over a dense
store (no holes: a prefill of equal-length prompts, plain decoding) passes no mask at all, so
transformers uses its own causal attention (SDPA's ``is_causal`` on a prefill: no ``L × L`` mask),
and on a CPU the linear layers over a few rows (a verified block, a small batch) take
:mod:`specdec.few_rows`'s products (``W @ xᵀ``, oneDNN's packed weights) where they measured faster on
this machine (``pack=False``: never the packed copy), and a masked
block's attention reads grouped KV heads without repeating them (:mod:`specdec.gqa_attention`).
``compile=True`` runs the decoder through ``torch.compile``. :func:`set_threads` picks torch's
CPU threads from the machine unless the user already chose.

**Captured steps** (``capture=``, :mod:`specdec.capture`; docs/capture.md): every block after the
prefill (each verify and decode step) runs in a static form, recorded once per (batch, block
length, KV capacity, buffers, features asked for) and replayed: CUDA graphs by default on CUDA,
the eager fast paths by default on a CPU (where they measured faster).
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel

from specdec import capture as capture_modes
from specdec import gqa_attention
from specdec.capture import BufferArena, CapturedSteps
from specdec.few_rows import PACK_BUDGET, Plan, autotune, few_rows, install, plan_for, plan_record, set_pack_budget
from specdec.gqa_attention import grouped
from specdec.kv import KVStore
from specdec.target_cache import StoreCache
from specdec.transformers_versions import CACHE_ARG, cache_kwargs
from specdec.types import Requirements, chain_parents, padded_ids
from specdec.validate import as_int

__all__ = ["Target", "TargetSession", "TargetOutput", "LayerSpec", "layer_output_ids", "set_threads",
           "machine_threads"]

_THREADS_AT_IMPORT = torch.get_num_threads()  # a different count later means the user chose one


def machine_threads() -> int:
    """The CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota
    (a container's share, which torch's default of all the host's cores ignores)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return n


def set_threads(threads: int | None = None) -> int:
    """Set torch's intra-op CPU threads once, at :func:`specdec.load_target`; returns the count in use.

    ``threads`` wins when given. Otherwise an explicit choice is left alone: ``OMP_NUM_THREADS``
    or ``MKL_NUM_THREADS`` set, or ``torch.set_num_threads`` called since specdec was imported.
    Failing both, the count is lowered to :func:`machine_threads` when torch's default exceeds it
    (oversubscription: every extra thread slows the GEMMs), never raised (torch's default counts
    physical cores, the better choice when there are fewer of them than logical CPUs).
    """
    if threads is not None:
        torch.set_num_threads(as_int("threads", threads, minimum=1))
    elif (not any(os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"))
          and torch.get_num_threads() == _THREADS_AT_IMPORT and _THREADS_AT_IMPORT > machine_threads()):
        torch.set_num_threads(machine_threads())
    return torch.get_num_threads()


def layer_output_ids(ids: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """Convert "output of layer i" ids (DFlash, DSpark) to this library's "input of layer i+1"."""
    return tuple(i + 1 for i in ids)


@dataclass(frozen=True)
class LayerSpec:
    """What a drafter may know of one target decoder layer, without touching the module."""

    index: int
    layer_type: str  # "full_attention", "sliding_attention", ...
    num_heads: int
    num_kv_heads: int
    head_dim: int | None  # None: the layer keeps no per-head K/V a drafter can read (MLA)
    sliding_window: int | None
    rope_parameters: dict[str, Any]  # this layer's RoPE, flat (Gemma 3/4 keep one per layer type)
    kv_shared: bool = False  # reads an earlier layer's K/V and stores none of its own (Gemma 4)


@dataclass
class TargetOutput:
    logits: Tensor  # [B, m, V] float32
    hidden: dict[int, Tensor] = field(default_factory=dict)  # layer id -> [B, m, D]
    final_hidden: Tensor | None = None  # [B, m, D], post-norm


@dataclass
class TargetSession:
    """The per-generation state of the target: its ragged KV store, one layer per decoder layer."""

    cache: KVStore


class Target:
    """Wraps a causal LM; one instance serves many generations (state lives in sessions).

    ``fast``: the chain fast paths (module docstring). ``compile``: the decoder through
    ``torch.compile`` with dynamic shapes (block and cache lengths change every step); ``True``
    uses torch's default backend (inductor), a string names another (``"eager"`` checks the
    tracing alone). The KV store's writes stay eager (a graph break per layer): its buffers are
    inference tensors, which a compiled graph may not mutate. ``pack``: on a CPU, let the fast path
    measure (and, where faster, use) oneDNN's packed product for float32 linear layers over a few
    rows, which holds a second copy of the weights it packs (:mod:`specdec.few_rows`); ``False`` never
    makes one. ``pack_budget``: the share of the linear weights' bytes those copies may hold, the
    largest layers first (:func:`specdec.few_rows.set_pack_budget`; ``1.0`` packs every layer).
    ``capture``: how each step after the prefill runs (:mod:`specdec.capture`: ``"auto"``,
    ``"eager"``, ``"graphs"``, ``"compile"``); :attr:`capture_mode` is what it resolves to on the
    target's device (``"auto"`` with ``compile=True`` is that dynamic compile, uncaptured).
    """

    def __init__(self, model: PreTrainedModel, tokenizer=None, fast: bool = True, compile: bool | str = False,
                 pack: bool = True, pack_budget: float = PACK_BUDGET, capture: str = "auto"):
        if not isinstance(pack, bool):
            raise TypeError(f"pack must be a bool, got {type(pack).__name__}")
        capture_modes.resolve(capture, "cpu")  # raises on an unknown mode, before any work
        if compile and capture in ("graphs", "compile"):
            raise ValueError(f"compile=True (the dynamic-shape decoder) and capture={capture!r} are two ways of"
                             " compiling the step: choose one")
        self.capture = "eager" if compile else capture
        self._steps: CapturedSteps | None = None  # the captured step, made on first use for the device's mode
        self._arena = BufferArena()  # the K/V buffers a recording points at, lent to each session in turn
        self._static_store: KVStore | None = None  # the store of the step being recorded or replayed
        self._static_names: tuple[str, ...] = ()  # its masks' layer types ("" for one mask)
        if pack:
            set_pack_budget(model, pack_budget)  # raises on a budget outside [0, 1]
        self.model = model.eval()
        self.fast = fast
        self.pack = pack
        self.tokenizer = tokenizer
        self.config = model.config
        text_config = getattr(self.config, "get_text_config", lambda: self.config)()
        self.text_config = text_config
        self.decoder: nn.Module = model.get_decoder()
        self.layers: nn.ModuleList = self.decoder.layers
        self.final_norm: nn.Module = self.decoder.norm
        self.num_layers = len(self.layers)
        self.hidden_size = int(text_config.hidden_size)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(text_config, "max_position_embeddings", 1 << 30))
        self.layer_types: list[str] | None = getattr(text_config, "layer_types", None)
        self.sliding_window: int | None = getattr(text_config, "sliding_window", None)
        self.requirements = Requirements()
        self._captured: dict[int | str, Tensor] = {}
        self._hooks: list = []
        backend = compile if isinstance(compile, str) else "inductor"
        self._decode = torch.compile(self.decoder, dynamic=True, backend=backend) if compile else self.decoder
        self._compiled = bool(compile)
        self._few_rows_installed = False
        self._head_copies: dict[tuple, tuple] = {}  # logits(dtype=, vocab=): the head's weight in that dtype, those rows
        if not compile:  # a compiled decoder picks its own kernels
            gqa_attention.install()  # inert outside grouped(): the model stays as it was for any other caller

    # --- what the target hands out -------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.config, self.tokenizer):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if eos is None:
                continue
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return ids

    # --- the seam drafters use: nothing else of the wrapped model is theirs to touch --------
    def embed(self, tokens: Tensor) -> Tensor:
        """Input embeddings of token ids [..] → [.., D] (with any scaling the model applies)."""
        return self.embed_tokens(tokens)

    def layer_specs(self) -> list[LayerSpec]:
        """One :class:`LayerSpec` per decoder layer, read from the layer modules and config."""
        specs = []
        for i, layer in enumerate(self.layers):
            tc = self._layer_text_config(i)
            attn = getattr(layer, "self_attn", None)
            kv_shared = bool(getattr(attn, "is_kv_shared_layer", False))
            readable = hasattr(attn, "head_dim") and (hasattr(attn, "k_proj") or kv_shared)  # not MLA
            layer_type = self.layer_types[i] if self.layer_types else "full_attention"
            specs.append(LayerSpec(
                index=i, layer_type=layer_type, num_heads=int(tc.num_attention_heads),
                num_kv_heads=int(getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads),
                head_dim=int(attn.head_dim) if readable else None,
                sliding_window=self.sliding_window if layer_type == "sliding_attention" else None,
                rope_parameters=self._rope_parameters(layer_type),
                kv_shared=kv_shared))
        return specs

    def _layer_text_config(self, i: int):
        """Layer ``i``'s own view of the text config: Gemma 4 overrides some fields per layer (the
        full-attention layers' head size) and refuses to read those from the shared config."""
        tc = self.text_config
        return tc.per_layer_config[i] if getattr(tc, "is_heterogeneous", False) else tc

    def _rope_parameters(self, layer_type: str) -> dict[str, Any]:
        """The RoPE parameters of ``layer_type``'s layers, flat: Gemma 3/4 keep one dict per layer
        type, which a config of another family (a draft layer's Llama config) would ignore."""
        tc = self.text_config
        rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default",
                                                         "rope_theta": float(getattr(tc, "rope_theta", 1e4))}
        return dict(rope.get(layer_type, rope))

    def final_norm_weight(self) -> Tensor:
        """The final norm's weight [D] (a drafter whose output feeds the target's LM head may start
        its own output norm there)."""
        return self.final_norm.weight.detach()

    def has_rotary(self) -> bool:
        """Whether the decoder owns one rotary embedding (Llama, Qwen3, Gemma, DeepSeek-V3)."""
        return getattr(self.decoder, "rotary_emb", None) is not None

    def rotary(self, x: Tensor, positions: Tensor, layer_type: str | None = None) -> tuple[Tensor, Tensor]:
        """The target's own (cos, sin) for ``positions`` [B, m], in ``x``'s dtype; ``layer_type``
        picks the per-type RoPE of families that have one (Gemma 3/4)."""
        if not self.has_rotary():
            raise ValueError(f"{type(self.model).__name__} has no shared rotary embedding")
        rotary_emb = self.decoder.rotary_emb
        if layer_type is not None and "layer_type" in inspect.signature(rotary_emb.forward).parameters:
            return rotary_emb(x, positions, layer_type=layer_type)
        return rotary_emb(x, positions)

    def layer_config(self, like: int, num_layers: int = 1):
        """The target's text config for ``num_layers`` new decoder layers (:meth:`new_layer`), each
        built like layer ``like`` (negative counts from the end): its type and per-layer overrides
        (Gemma 4's global head size), dense or MoE as it is (DeepSeek-V3), each keeping its own K/V
        (no KV sharing) and reading no per-layer input (Gemma 4's per-layer embeddings have no rows
        for new layers). Its layers take :meth:`rotary` of ``like``'s layer type."""
        like = range(self.num_layers)[like]
        cfg = copy.deepcopy(self._layer_text_config(like))
        cfg.num_hidden_layers = num_layers
        for name in ("layer_types", "mlp_layer_types"):  # per-layer lists, indexed by the new layers' ids
            if getattr(cfg, name, None):
                setattr(cfg, name, [getattr(cfg, name)[like]] * num_layers)
        if getattr(cfg, "first_k_dense_replace", None) is not None:  # DeepSeek-V3: the first layers are dense
            cfg.first_k_dense_replace = num_layers if like < cfg.first_k_dense_replace else 0
        if hasattr(cfg, "num_kv_shared_layers"):
            cfg.num_kv_shared_layers = 0
        if hasattr(cfg, "hidden_size_per_layer_input"):
            cfg.hidden_size_per_layer_input = 0
        return cfg

    def new_layer(self, config, layer_idx: int) -> nn.Module:
        """A new decoder layer of the target's family built from ``config`` (:meth:`layer_config`;
        MTP modules are the target's own layer type), as its constructor leaves it: :meth:`init_weights`
        initialises it (once, over the whole module tree that holds it). It takes :meth:`kv_cache` as
        its ``cache``."""
        layer = type(self.layers[-1])(config, layer_idx)
        attn = getattr(layer, "self_attn", None)
        if getattr(attn, "store_full_length_kv", False):  # Gemma 4 hands these K/V to KV-shared layers;
            attn.store_full_length_kv = False  # a new layer has none, and its K/V live in its cache alone
        return layer

    def layer_weights(self, i: int) -> dict[str, Tensor]:
        """A detached copy of decoder layer ``i``'s parameters and buffers (negative counts from the
        end), keyed as :meth:`new_layer`'s layer names them: a draft layer of the target's own shape
        may start from it."""
        return {k: v.detach().clone() for k, v in self.layers[range(self.num_layers)[i]].state_dict().items()}

    def new_norm(self, size: int, eps: float) -> nn.Module:
        """A final-norm module of the target's family (RMSNorm, Gemma's (1 + w) form ...), as its
        constructor leaves it (see :meth:`new_layer`)."""
        return type(self.final_norm)(size, eps=eps)

    def new_store(self, batch: int, num_layers: int | None = None) -> KVStore:
        """A ragged KV store whose masks follow the target's layer types and sliding window;
        ``num_layers`` defaults to the target's own (a session's store)."""
        return KVStore(batch, self.device, self.dtype, self.num_layers if num_layers is None else num_layers,
                       self.layer_types, self.sliding_window)

    def kv_cache(self, store: KVStore, slots: Tensor | None = None) -> StoreCache:
        """``store`` as the cache object the target's layer modules take (a transformers ``Cache``
        whose layer ``i`` writes into the store's layer ``i``); ``slots`` [m] for a captured step:
        the block written at those slots, attention over the whole buffers (a ``static`` plan's)."""
        return StoreCache(store, compiled=self._compiled, slots=slots)

    def init_weights(self, module: nn.Module) -> None:
        """Initialise every submodule of ``module`` the way the target's model initialises its own."""
        init = getattr(self.model, "_init_weights", None)
        if init is None:
            return
        for m in module.modules():
            init(m)

    @torch.no_grad()  # not inference_mode: training code uses these tensors next to autograd
    def features(self, tokens: Tensor, layer_inputs: list[int] | tuple[int, ...] = ()) -> tuple[dict[int, Tensor], Tensor]:
        """A cache-free forward over ``tokens`` [B, T]: the inputs of the layers ``layer_inputs``
        (id ``L`` = last layer's output before the norm) as {id: [B, T, D]}, and the post-norm
        final hidden state [B, T, D] (``target.logits`` of it gives the target's logits)."""
        if any(not 0 <= i <= self.num_layers for i in layer_inputs):
            raise ValueError(f"hidden-state ids {list(layer_inputs)} outside [0, {self.num_layers}]")
        with self.norm_input(self.num_layers in layer_inputs) as pre_norm:
            out = self.decoder(input_ids=tokens.to(self.device), output_hidden_states=True, use_cache=False)
        return self.layer_inputs(out.hidden_states, pre_norm, layer_inputs), out.last_hidden_state

    @contextmanager
    def norm_input(self, wanted: bool = True) -> Iterator[list[Tensor]]:
        """The final norm's input of the forward run inside the block (a list that holds it after).

        transformers' last ``hidden_states`` entry is taken after the final norm, while layer id
        ``L`` is the norm's input, as the loop's hooks capture it: a cache-free forward that serves
        training reads id ``L`` here, so training and decoding see the same tensor."""
        seen: list[Tensor] = []
        hook = self.final_norm.register_forward_pre_hook(lambda m, args: seen.append(args[0])) if wanted else None
        try:
            yield seen
        finally:
            if hook is not None:
                hook.remove()

    def layer_inputs(self, hidden_states: tuple[Tensor, ...], norm_input: list[Tensor],
                     ids: list[int] | tuple[int, ...]) -> dict[int, Tensor]:
        """{id: [B, T, D]} from a forward's ``hidden_states`` and its :meth:`norm_input` (id ``L``)."""
        return {i: norm_input[0] if i == self.num_layers else hidden_states[i] for i in ids}

    def hidden(self, tokens: Tensor) -> Tensor:
        """The post-norm final hidden state of a cache-free forward over ``tokens`` [B, T] → [B, T, D],
        with autograd: for recipes that train the target itself (DeepSeek-V3 with its MTP modules)."""
        return self.decoder(input_ids=tokens.to(self.device), use_cache=False).last_hidden_state

    def check(self, req: Requirements) -> None:
        """Raise ``ValueError`` if ``req`` names a layer this target does not have (a drafter's bind
        calls it, so a mismatch fails before any generation work)."""
        for i in req.layer_inputs:
            if not 0 <= i <= self.num_layers:
                raise ValueError(f"layer id {i} outside [0, {self.num_layers}] for this {self.num_layers}-layer target")

    @contextmanager
    def capturing(self, req: Requirements) -> Iterator[None]:
        """Capture exactly what ``req`` asks for inside the block (one generation), then remove the
        hooks and drop every captured tensor, even when the block raises: a target serves many
        drafters, and one run's needs must neither cost a later run nor keep its tensors alive.
        Nested blocks capture the inner request and give the outer one back on exit."""
        self.check(req)
        outer = self.requirements
        self._install(req)
        try:
            yield
        finally:
            self._install(outer)

    def _install(self, req: Requirements) -> None:
        """Hook exactly the modules ``req`` needs (and no others); forget anything captured."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._captured = {}
        self.requirements = req
        for i in req.layer_inputs:
            module = self.layers[i] if i < self.num_layers else self.final_norm
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True))
        if req.final_hidden:
            self._hooks.append(self.final_norm.register_forward_hook(self._post_hook("final")))

    def _pre_hook(self, key: int):
        def hook(module, args, kwargs):
            self._captured[key] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _post_hook(self, key: str):
        def hook(module, args, output):
            self._captured[key] = output[0] if isinstance(output, tuple) else output
        return hook

    # --- running --------------------------------------------------------------------------
    def new_session(self, batch: int, reserve: int = 0) -> TargetSession:
        """A session for ``batch`` rows; ``reserve`` slots of KV are allocated up front (the longest
        row the run can reach), so the store never grows past it block by block. Under capture the
        K/V buffers come from the target's arena (:class:`~specdec.capture.BufferArena`), so the next session of the
        same shapes replays the recordings of the last."""
        store = self.new_store(batch)
        if self.capture_mode != "eager":
            self._arena.attach(store)
        store.reserve(reserve)
        return TargetSession(store)

    @property
    def capture_mode(self) -> str:
        """What ``capture`` resolves to on this target's device: ``"eager"``, ``"graphs"`` or ``"compile"``."""
        return capture_modes.resolve(self.capture, self.device)

    @torch.inference_mode()
    def forward(self, session: TargetSession, tokens: Tensor, parents: Tensor | None = None,
                logits_rows: Tensor | None = None) -> TargetOutput:
        """One pass over a block of new tokens [B, m] with block-local ``parents`` [B, m].

        ``parents=None`` means a chain. The block is pending until :meth:`commit`.
        ``logits_rows`` [B, m'] picks which block positions need logits (all by default),
        which saves the LM head on a long prefill.
        """
        B, m = tokens.shape
        if logits_rows is None and session.cache.num_slots and self.capture_mode != "eager":
            return self._captured_forward(session, tokens, parents)
        if parents is None and self.fast:
            plan = session.cache.plan(length=m, implicit_causal=True)
        else:
            plan = session.cache.plan(chain_parents(m, B, self.device) if parents is None else parents.to(self.device))
        self._captured = {}
        eager = self.fast and not self._compiled
        few = self._row_plan()
        with few_rows(few) if few else nullcontext(), grouped() if eager else nullcontext():
            out = self._decode(
                input_ids=tokens.to(self.device),
                attention_mask=plan.attention_mask,
                position_ids=plan.position_ids,
                **cache_kwargs(self.kv_cache(session.cache)),
                use_cache=True,
            )
            if session.cache.block_writes == 0:
                raise RuntimeError(
                    f"{type(self.decoder).__name__} wrote no K/V into the store: its forward does not take the "
                    f"cache as {CACHE_ARG}= (see specdec.transformers_versions), so it attended to this block alone")
            h = out.last_hidden_state
            if logits_rows is not None:
                h = h.gather(1, logits_rows.to(self.device).unsqueeze(-1).expand(-1, -1, h.shape[-1]))
            logits = self.logits(h)
        hidden = {i: self._captured[i] for i in self.requirements.layer_inputs}
        final = self._captured.get("final")
        self._captured = {}
        return TargetOutput(logits, hidden, final)

    def _captured_forward(self, session: TargetSession, tokens: Tensor, parents: Tensor | None) -> TargetOutput:
        """:meth:`forward` of a step after the prefill, captured. Outside the recording (eager,
        every step): the plan (mask over the whole capacity, positions, slot indices) and the key.
        Inside: embedding, every decoder layer with its K/V write, the final norm, the LM head and
        the hooked features; nothing in it reads the host or branches on a value."""
        store = session.cache
        m = tokens.shape[1]
        dev = self.device
        plan = store.plan(length=m, static=True) if parents is None else store.plan(parents.to(dev), static=True)
        assert plan.slots is not None
        masks = plan.attention_mask if isinstance(plan.attention_mask, dict) else {"": plan.attention_mask}
        names = tuple(sorted(masks))
        req = self.requirements
        if self._steps is None or self._steps.mode != self.capture_mode or self._steps.device != dev:
            self._steps = CapturedSteps(self._static_step, self.capture_mode, dev)
        key = (m, names, req.layer_inputs, req.final_hidden, store.buffer_key())
        self._static_store, self._static_names = store, names
        try:
            logits, hidden, final = self._steps(key, tokens.to(dev), plan.position_ids, plan.slots,
                                                *(masks[n] for n in names))
        finally:
            self._static_store = None  # the session's store must die with it: the arena lends its buffers on
        return TargetOutput(logits, dict(zip(req.layer_inputs, hidden)), final)

    def _static_step(self, tokens: Tensor, positions: Tensor, slots: Tensor, *masks: Tensor
                     ) -> tuple[Tensor, tuple[Tensor, ...], Tensor | None]:
        """The captured region: one forward of fixed shapes over :attr:`_static_store` (set by the
        caller; its buffers are part of the recording's key)."""
        names = self._static_names
        mask = masks[0] if names == ("",) else dict(zip(names, masks))
        self._captured = {}
        out = self.decoder(input_ids=tokens, attention_mask=mask, position_ids=positions,
                           **cache_kwargs(self.kv_cache(self._static_store, slots)), use_cache=True)
        logits = self.lm_head(out.last_hidden_state)
        cap = getattr(self.text_config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        hidden = tuple(self._captured[i] for i in self.requirements.layer_inputs)
        final = self._captured.get("final")
        self._captured = {}
        return logits.float(), hidden, final

    def _row_plan(self) -> Plan:
        """The few-row plan of this target's linear layers (empty off the eager fast path or off the
        CPU; a row count it does not name keeps ``F.linear``); installs the layers' forward once
        some row count takes a product other than ``F.linear``."""
        if not self.takes_row_plan():
            return {}
        plan = plan_for(self.model, packed=self.pack)
        if plan and not self._few_rows_installed:  # until then the layers keep their own forward
            install(self.model)  # inert outside few_rows(): the model called any other way is unchanged
            self._few_rows_installed = True
        return plan

    def takes_row_plan(self) -> bool:
        """Whether this target's forward follows a few-row plan: the eager fast path on a CPU."""
        return self.fast and not self._compiled and self.device.type == "cpu"

    def tune(self, force: bool = False) -> None:
        """Tune the few-row plan for this machine now (:func:`specdec.few_rows.autotune`: read from
        the cache and spot-checked, else measured once and cached; never on a busy machine), so
        that no timed run measures."""
        if self.takes_row_plan():
            autotune(self.model, packed=self.pack, force=force)

    def row_plan_record(self) -> dict[str, Any] | None:
        """Which few-row plan the forward follows and where it came from
        (:func:`specdec.few_rows.plan_record`), for results to record; None where none applies."""
        return plan_record(self.model, packed=self.pack) if self.takes_row_plan() else None

    def logits(self, hidden: Tensor, dtype: torch.dtype | None = None, vocab: Tensor | None = None) -> Tensor:
        """LM head (with any final soft-capping the model applies) in float32. [.., V]

        ``dtype``: run the head in that dtype instead, on a copy of its weight made once (and again
        if the weight changes). Drafters that draft through the target's head take it in bf16: a
        49k-row head is most of their draft step, and bf16 halves its bytes (on a CPU with AMX, a
        4-row product is 3x faster). ``vocab`` (sorted ids, :mod:`specdec.draft_vocab`): only those
        rows of the head, from a copy made once; every other logit is -inf, so nothing outside is
        ever drafted. Verification always reads the target's own head."""
        if vocab is None and (dtype is None or dtype == self.lm_head.weight.dtype):
            few = self._row_plan()  # a drafter's block of rows through the head too
            with few_rows(few) if few else nullcontext():
                logits = self.lm_head(hidden)
        else:
            weight, bias = self._head_copy(dtype or self.lm_head.weight.dtype, vocab)
            # as rows: a [B, 1, D] slice keeps its parent's strides, on which a bf16 product runs ~20x slower
            flat = hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype)
            logits = F.linear(flat, weight, bias)
        cap = getattr(self.text_config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if vocab is not None:
            rows = logits.float()
            logits = rows.new_full((rows.shape[0], self.vocab_size), float("-inf")).index_copy_(1, vocab.to(rows.device), rows)
            return logits.view(*hidden.shape[:-1], self.vocab_size)
        return logits.float().view(*hidden.shape[:-1], logits.shape[-1])

    def _head_copy(self, dtype: torch.dtype, vocab: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """The head's weight (and bias) in ``dtype``, only the rows ``vocab`` names when given: made
        once per (dtype, vocab tensor), again if the weight changes, dropped with the vocab tensor."""
        head = self.lm_head
        bias = getattr(head, "bias", None)
        key = (dtype, head.weight.data_ptr(), head.weight._version, head.weight.device)
        slot = (dtype, None if vocab is None else id(vocab))
        cached = self._head_copies.get(slot)
        if cached is None or cached[0] != key or (vocab is not None and cached[3]() is not vocab):
            for old in [s for s, c in self._head_copies.items() if c[3] is not None and c[3]() is None]:
                del self._head_copies[old]  # a drafter's vocabulary nobody holds any more: its rows go too
            with torch.no_grad():
                w, b = head.weight.detach(), None if bias is None else bias.detach()
                if vocab is not None:
                    w, b = w[vocab.to(w.device)], None if b is None else b[vocab.to(w.device)]
                cached = (key, w.to(dtype).contiguous(), None if b is None else b.to(dtype),
                          None if vocab is None else weakref.ref(vocab))
            self._head_copies[slot] = cached
        return cached[1], cached[2]

    def commit(self, session: TargetSession, keep: Tensor | int | None = None) -> None:
        """Keep the block slots marked in ``keep`` [B, m]; ``None`` keeps the whole block, an int
        that many leading slots in every row (:meth:`specdec.kv.KVStore.commit`)."""
        session.cache.commit(keep.to(self.device) if isinstance(keep, Tensor) else keep)

    def prefill(self, session: TargetSession, prompts: list[list[int]]) -> tuple[TargetOutput, Tensor, Tensor]:
        """Run the prompts, right-padded, and commit them.

        Returns the output (logits at each prompt's last token only, [B, 1, V]; features for
        every prompt token), the padded prompt tokens [B, L] (-1 padded) and their lengths [B].
        """
        dev = self.device
        L = max(len(p) for p in prompts)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev)
        padded = padded_ids(prompts, L, -1, dev)
        out = self.forward(session, padded.clamp(min=0), logits_rows=(lengths - 1).unsqueeze(1))
        ragged = any(len(p) != L for p in prompts)  # equal lengths keep the store dense
        self.commit(session, torch.arange(L, device=dev).unsqueeze(0) < lengths.unsqueeze(1) if ragged else None)
        return out, padded, lengths

    def admit(self, session: TargetSession, prompts: list[list[int]]) -> tuple[TargetOutput, Tensor, Tensor]:
        """:meth:`prefill` new rows into a running session (continuous batching): the prompts run
        in a store of their own, whose rows are then appended after the session's
        (:meth:`specdec.kv.KVStore.append_rows`). Returns what :meth:`prefill` returns, for the new rows."""
        part = TargetSession(self.new_store(len(prompts)))
        part.cache.reserve(max(len(p) for p in prompts))
        out = self.prefill(part, prompts)
        session.cache.append_rows(part.cache)
        return out

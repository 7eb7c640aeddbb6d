"""Captured steps: one forward of fixed shapes recorded once and replayed every step.

A decode or verify step on a GPU is launch-bound when its kernels are small (batch 1, a few
tokens): the host spends longer issuing them than the device runs them. Capturing the step once
per shape and replaying it removes that cost, as vLLM (CUDA graphs per batch size) and gpt-fast
(``torch.compile(mode="reduce-overhead")``) do.

**The switch** (``capture=``, :func:`resolve`), one for the target and every drafter that uses
:class:`CapturedSteps`:

- ``"eager"``: no capture; the target's eager fast paths (few-row products, grouped attention).
- ``"graphs"``: the step's static form (fixed-shape inputs, writes into the KV buffers at slot
  indices held in a tensor, attention over the buffers' whole capacity under a mask) recorded in a
  ``torch.cuda.CUDAGraph`` per key and replayed. Off CUDA there is nothing to record: the same
  static form runs as it is, every step (what the CPU tests exercise).
- ``"compile"``: the static form through ``torch.compile(fullgraph=True, dynamic=False)``
  (``mode="reduce-overhead"`` on CUDA, which captures CUDA graphs of the compiled kernels); a graph
  break fails the run instead of silently splitting the step.
- ``"auto"`` (default): ``"graphs"`` on CUDA, ``"eager"`` elsewhere: on a CPU the static form and
  ``torch.compile`` both measured slower than the eager fast path (docs/capture.md).

**What a captured function may do**: only device work on tensors it is given (static inputs,
copied into before each replay) or that live across steps at fixed addresses (weights, KV
buffers). No host read (``.item()``, ``.tolist()``, ``bool(tensor)``), no Python branch on a value
or on a shape that differs between calls of one key, no allocation that must outlive the call.
Everything that decides (masks, positions, slot indices, which rows are live) is computed before
the call, outside the captured region.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

__all__ = ["MODES", "resolve", "CapturedSteps", "BufferArena"]

MODES = ("auto", "eager", "graphs", "compile")
WARMUP = 2  # eager runs on a side stream before a CUDA capture (lazy initialisation, autotuning)
# torch.compile's backend for "compile": inductor generates the kernels; "eager" (what the CPU tests
# set) traces the same whole graph, so a graph break still fails, without minutes of code generation
COMPILE_BACKEND = "inductor"


def resolve(mode: str, device: torch.device | str) -> str:
    """The mode ``mode`` means on ``device``: ``"auto"`` → ``"graphs"`` on CUDA, ``"eager"`` elsewhere."""
    if mode not in MODES:
        raise ValueError(f"capture must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        return "graphs" if torch.device(device).type == "cuda" else "eager"
    return mode


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, Tensor) else x


class CapturedSteps:
    """``fn`` captured once per key and replayed (``mode`` "graphs" or "compile", :func:`resolve`-d).

    ``fn(*inputs)`` returns a pytree of tensors. The key names everything the recording depends on
    besides the inputs' values: their shapes, and the addresses of any buffer ``fn`` writes (a KV
    store's). Outputs are copies, so a later replay never overwrites what the caller holds.
    ``calls``/``captures`` count replays and recordings (what the tests and the kit read).
    """

    def __init__(self, fn: Callable[..., Any], mode: str, device: torch.device | str):
        self.fn, self.device = fn, torch.device(device)
        self.mode = resolve(mode, self.device)
        if self.mode == "eager":
            raise ValueError("CapturedSteps needs mode 'graphs' or 'compile' (resolve() chose 'eager')")
        self.cuda = self.device.type == "cuda"
        self._entries: dict[Hashable, Callable[[tuple[Tensor, ...]], Any]] = {}
        self._compiled: Callable[..., Any] | None = None
        self._pool = None
        self.calls = self.captures = 0

    def __call__(self, key: Hashable, *inputs: Tensor) -> Any:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = self._record(inputs)
            self.captures += 1
        self.calls += 1
        return entry(inputs)

    def clear(self) -> None:
        """Drop every recording (its buffers' addresses are gone)."""
        self._entries.clear()

    def _record(self, inputs: tuple[Tensor, ...]) -> Callable[[tuple[Tensor, ...]], Any]:
        if self.mode == "compile":
            if self._compiled is None:
                limit = torch._dynamo.config.recompile_limit  # one graph per key, not torch's default of 8
                torch._dynamo.config.recompile_limit = max(limit, 256)
                inductor = COMPILE_BACKEND == "inductor"
                self._compiled = torch.compile(self.fn, fullgraph=True, dynamic=False, backend=COMPILE_BACKEND,
                                               mode="reduce-overhead" if self.cuda and inductor else None)
            compiled = self._compiled

            def call(xs: tuple[Tensor, ...]) -> Any:
                # inductor takes no inference tensors: the inputs as normal ones, under no_grad (the
                # buffers ``fn`` writes must be normal tensors too: a captured target's arena is)
                with torch.inference_mode(False), torch.no_grad():
                    return tree_map(_clone, compiled(*(x.clone() for x in xs)))

            return call
        if not self.cuda:  # nothing to record off CUDA: the static form runs as it is
            return lambda xs: self.fn(*xs)
        return self._cuda_graph(inputs)

    def _cuda_graph(self, inputs: tuple[Tensor, ...]) -> Callable[[tuple[Tensor, ...]], Any]:
        """Warm up on a side stream, record one graph into the shared pool, replay it with each
        call's inputs copied into the recorded ones. ``fn`` must be idempotent for equal inputs
        (a KV write at the same slots): the warm-up runs it, then the first replay runs it again."""
        static = tuple(x.clone() for x in inputs)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self.fn(*static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.fn(*static)
        except RuntimeError as e:  # an op that cannot be recorded (a host sync, a CPU tensor ...)
            raise RuntimeError(f"recording the step in a CUDA graph failed: {e}. capture='eager' runs it"
                               " unrecorded") from e

        def replay(xs: tuple[Tensor, ...]) -> Any:
            for s, x in zip(static, xs):
                s.copy_(x, non_blocking=True)
            graph.replay()
            return tree_map(_clone, out)

        return replay


class BufferArena:
    """K/V buffers at addresses that outlive the KV store that uses them, so a recording made over
    one session's store replays over the next one's of the same shapes (vLLM keeps one KV cache
    for the whole server for the same reason).

    :meth:`attach` makes a store take its K/V buffers from here: zeroed at first (a static step
    attends over every slot, masked or not, and 0 × NaN would poison it; stale values from an
    earlier session are finite and masked out), normal tensors rather than inference ones (a
    compiled step may write them). A buffer goes to one live store at a time: while its holder
    lives, another store of the same shapes gets a new one.
    """

    def __init__(self):
        self._held: dict[Hashable, tuple[Tensor, weakref.ref]] = {}

    def attach(self, store, tag: Hashable = None) -> None:
        """``store`` takes its K/V buffers from here; ``tag`` tells apart stores that live side by
        side (a drafter's streams), each then keeping its own buffers across sessions."""
        ref = weakref.ref(store)
        store.alloc = lambda key, shape, like: self.buffer(ref, (tag, key), shape, like)

    def buffer(self, store: weakref.ref, key: Hashable, shape: tuple[int, ...], like: Tensor) -> Tensor:
        with torch.inference_mode(False):
            held = self._held.get(key)
            if held is not None and held[0].shape == shape and held[0].dtype == like.dtype and held[0].device == like.device:
                owner = held[1]()
                if owner is None or owner is store():
                    self._held[key] = (held[0], store)
                    return held[0]
                return like.new_zeros(shape)
            fresh = like.new_zeros(shape)
            self._held[key] = (fresh, store)
            return fresh

"""The roofline of the target forward on this machine: how close one forward over m new tokens comes
to the time its bytes and FLOPs need, for this library's target and for plain transformers, and what
context length does to step time, memory and speculative speedups. ``mode: roofline`` of the runner:

    .venv/bin/python experiments/run.py --config-name roofline     (docs/roofline.md)

What it measures (the grid is :class:`~specdec.eval.config.RooflineConfig`; every time is the best of
``reps``, which drops one-off costs and the noise of a shared machine):

1. **Limits.** Memory bandwidth by STREAM's copy (``b = a``: 2 words moved per element) and triad
   (``a = b + s·c``: 3 words), arrays well above the last-level cache; peak FLOP/s of an n×n by n×n
   ``F.linear`` per dtype (what ``nn.Linear`` calls: on CPUs without native bf16 it is ten times
   faster than ``torch.mm`` in bf16); both per thread count.
2. **Forward sweep.** After ``context`` committed tokens, one forward over m new tokens: a chain, or
   a binary tree of m nodes (node i hangs off node (i − 1) // 2; m ≥ 3, smaller trees are chains):
   - ``library``: what the loop verifies with, ``Target.forward(session, tokens, parents)`` on a
     session its ``prefill`` filled (its KV store, its masks, built inside the forward);
   - ``library_general``: the same with the fast paths off (``Target(fast=False)``: a chain too gets
     an ancestor matrix and a 4-D mask), what the fast paths save, measured in the same run;
   - ``library_unpacked``: the fast paths without packed weights (``Target(pack=False)``: no second
     copy of the linear weights, :mod:`specdec.few_rows`), what packing saves;
   - ``library_gqa``: the library's forward with each query head on its own in attention
     (:func:`specdec.gqa_attention.packed_rows` off), what packing a KV head's query group as rows saves;
   - ``transformers``: ``model(input_ids, cache=DynamicCache)``; a chain passes no mask
     (transformers' causal path), a tree a 4-D additive mask and per-node positions built before
     the clock starts.
   Every timed forward sees the same context: the block is dropped after it (library: committed as
   holes, then compacted; transformers: ``cache.crop``). Both compute logits at every position.
3. **Context sweep** (batch 1, the first thread count, the target's dtype): prefill ``C`` tokens
   (library: ``Target.prefill``; transformers: one forward with ``logits_to_keep=1``, as
   ``generate()`` does), then the forwards of ``context_new_tokens`` at that context, with the peak
   memory of each phase (:class:`PeakMemory`; on a CPU also the tensors' own, :class:`TensorPeak`).
4. **Speedups against context.** The run's own methods (``methods``: ngram, eagle3, ...) and
   autoregressive decoding through :func:`~specdec.eval.runner.run_experiment`, with
   ``dataset.input_len = C``; each context's run folder is ``speedup_ctx<C>/``.

The cost model (:class:`ForwardCost`) counts what one forward must move and compute: bytes = every
weight it multiplies with (the input embedding only when it is the tied LM head) + K and V of the
context and the block; FLOPs = 2 · tokens · linear parameters (LM head included) + attention's
4 · tokens · heads · head_dim · (context + m) over every layer. Bandwidth limit = bytes / triad
bandwidth; compute limit = FLOPs / linear peak; the roofline is the larger. Activations are not
counted. ``pct_of_bandwidth_limit`` = bandwidth limit / measured time.

Writes the record, ``roofline.json`` and ``config.json``, to ``out_dir``; the lab renders its table
and figures (``experiments/report.py``: ``roofline_markdown``, ``roofline_figures``).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from specdec import few_rows
from specdec.gqa_attention import packed_rows
from specdec.provenance import cpu
from specdec.eval.config import RooflineConfig, RunConfig
from specdec.eval.runner import build_target, run_experiment, write_config
from specdec.target import Target
from specdec.timing import Stopwatch, measure
from specdec.transformers_versions import cache_kwargs

__all__ = ["run_roofline", "ForwardCost", "PeakMemory", "TensorPeak", "stream_bandwidth", "linear_peak", "tree_parents"]

SPEEDUP_KEYS = ("drafter", "k", "requests", "new_tokens", "tokens_per_s", "speedup", "decode_speedup",
                "mean_accepted_length", "decode_s_per_token", "verify_s_per_step", "draft_s_per_step",
                "identical_to_baseline")


# ------------------------------------------------------------------------------------------------
# timing and memory

def _times(fn: Callable[[], Any], reps: int, device: torch.device, after: Callable[[], None] | None = None
           ) -> list[float]:
    """Wall seconds of ``reps`` calls of ``fn`` (:func:`specdec.timing.measure`, no warm-up: the
    callers warm up themselves); ``after`` runs untimed after each."""
    return list(measure(fn, reps, warmup=0, device=device, after=after).samples)


class PeakMemory:
    """Peak memory above what was in use at :meth:`start`, in MiB. On CPU (Linux) the process's
    resident set: freed memory is handed back first (``gc``, ``malloc_trim``), the high-water mark
    ``VmHWM`` is reset through ``/proc/self/clear_refs`` and read back. On CUDA torch's
    ``max_memory_allocated``. ``kind`` says which; ``None`` where neither works."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kind: str | None = "cuda max_memory_allocated" if device.type == "cuda" else "rss (VmHWM)"
        self.base = 0
        if device.type != "cuda" and not self._reset_hwm():
            self.kind = None

    @staticmethod
    def _status(field: str) -> int:
        return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            self.base = torch.cuda.memory_allocated(self.device)
        elif self.kind is not None:
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except OSError:  # not glibc: freed memory may stay resident, the peak then reads low
                pass
            self.base = self._status("VmRSS")
        self.reset()

    def reset(self) -> None:
        """Forget the peak so far (the baseline stays)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kind is not None:
            self._reset_hwm()

    def peak_mib(self) -> float | None:
        if self.kind is None:
            return None
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else self._status("VmHWM")
        return (peak - self.base) / 2**20


class TensorPeak:
    """Peak bytes of the tensors allocated inside the block and still alive, in MiB, counted by
    ``torch.profiler``'s memory events in time order (each op's own allocations net of its own
    frees, and the frees between ops): what the code asked for, the same on every run, where the
    resident set (:class:`PeakMemory`) also moves with the allocator. :meth:`mark` splits the
    block into segments; ``segments`` holds each one's (peak, held at its end), both counted from
    the start of the block. A buffer allocated and freed inside one op is not seen. CPU tensors
    only (on CUDA, :class:`PeakMemory` already counts allocations)."""

    _MARK = "specdec.tensor_peak.mark"

    def __init__(self):
        self.segments: list[tuple[float, float]] = []

    def __enter__(self) -> TensorPeak:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def mark(self) -> None:
        """End the current segment here."""
        with torch.profiler.record_function(self._MARK):
            pass

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        events = sorted((e for e in self._prof.events() if e.self_cpu_memory_usage or e.name == self._MARK),
                        key=lambda e: e.time_range.start)
        held = peak = 0
        segments = []
        for e in events:
            if e.name == self._MARK:
                segments.append((peak, held))
                peak = held
            else:
                held += e.self_cpu_memory_usage
                peak = max(peak, held)
        segments.append((peak, held))
        self.segments = [(p / 2**20, h / 2**20) for p, h in segments]
        del self._prof

    @property
    def peak_mib(self) -> float:
        return max(p for p, _ in self.segments)

    @property
    def net_mib(self) -> float:
        return self.segments[-1][1]


# ------------------------------------------------------------------------------------------------
# the machine's limits

def _llc_mib() -> int:
    """The last-level cache of this CPU in MiB (32 when the system does not say)."""
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"))
    sizes = []
    for f in caches:
        m = re.fullmatch(r"(\d+)([KM])", f.read_text().strip())
        if m:
            sizes.append(int(m.group(1)) // (1024 if m.group(2) == "K" else 1))
    return max(sizes, default=32) or 32


def stream_bandwidth(device: torch.device, mib: int, reps: int) -> dict[str, float]:
    """STREAM copy and triad over fp32 arrays of ``mib`` MiB each, at the current thread count: GB/s."""
    n = mib * 2**20 // 4
    a, b, c = (torch.rand(n, device=device) for _ in range(3))  # written: no page faults in the timed loops
    copy = min(_times(lambda: b.copy_(a), reps, device))
    triad = min(_times(lambda: torch.add(b, c, alpha=3.0, out=a), reps, device))
    return {"array_mib": mib, "copy_gb_s": 2 * n * 4 / copy / 1e9, "triad_gb_s": 3 * n * 4 / triad / 1e9}


def linear_peak(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> float:
    """FLOP/s of ``F.linear`` of an n×n input and an n×n weight in ``dtype`` at the current thread count."""
    x, w = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / min(_times(lambda: nn.functional.linear(x, w), reps, device))


# ------------------------------------------------------------------------------------------------
# what a forward must move and compute

@dataclass(frozen=True)
class ForwardCost:
    """Bytes and FLOPs of one forward of ``m`` new tokens per row after ``context`` slots."""

    weight_bytes: int  # every weight a forward multiplies with, read once whatever m is
    linear_params: int  # multiply-adds per token in linear layers, LM head included
    kv_bytes_per_slot: int  # K and V of one slot of one row, every layer
    attn_flops_per_pair: int  # FLOPs per (query, key) pair, every layer: 4 · heads · head_dim

    @classmethod
    def of(cls, target: Target) -> ForwardCost:
        model = target.model
        params = {id(p): p for p in model.parameters()}
        weight = sum(p.numel() * p.element_size() for p in params.values())
        embed, head = target.embed_tokens.weight, target.lm_head.weight
        if embed is not head:  # an untied input embedding: a forward reads only its rows
            weight -= embed.numel() * embed.element_size()
        linear = sum(mod.weight.numel() for mod in model.modules() if isinstance(mod, nn.Linear))
        elt = torch.tensor([], dtype=target.dtype).element_size()
        specs = target.layer_specs()
        kv = sum(2 * s.num_kv_heads * s.head_dim * elt for s in specs if s.head_dim and not s.kv_shared)
        attn = sum(4 * s.num_heads * s.head_dim for s in specs if s.head_dim)
        return cls(weight, linear, kv, attn)

    def bytes(self, batch: int, m: int, context: int) -> int:
        return self.weight_bytes + batch * (context + m) * self.kv_bytes_per_slot

    def flops(self, batch: int, m: int, context: int) -> int:
        return batch * m * (2 * self.linear_params + (context + m) * self.attn_flops_per_pair)


# ------------------------------------------------------------------------------------------------
# the two forwards, each at a fixed context

def tree_parents(m: int) -> list[int]:
    """A binary tree of ``m`` nodes in heap order: node i hangs off (i − 1) // 2, node 0 off the prefix."""
    return [(i - 1) // 2 if i else -1 for i in range(m)]


class LibraryForward:
    """The library's target forward as the loop verifies: ``Target.forward`` on a prefilled session."""

    def __init__(self, target: Target, context: Tensor, room: int = 0):  # context [B, C]
        """``room``: the largest block it will forward; its store reserves the context plus that, as
        the loop reserves a run's longest row."""
        self.target = target
        self.session = target.new_session(context.shape[0], reserve=context.shape[1] + room)
        target.prefill(self.session, context.tolist())

    def call(self, tokens: Tensor, parents: list[int] | None) -> Callable[[], Any]:
        par = None if parents is None else torch.tensor(parents).expand(tokens.shape[0], -1)  # [B, m]
        return lambda: self.target.forward(self.session, tokens, par)

    def drop(self, tokens: Tensor) -> None:
        """Back to the context: the block's slots become holes, compaction removes them, and the store is
        dense again (as in plain decoding: a chain then passes no mask)."""
        self.target.commit(self.session, torch.zeros(tokens.shape, dtype=torch.bool))
        self.session.cache.compact()
        self.session.cache.refresh_dense()


class GeneralLibraryForward(LibraryForward):
    """The library's forward with its fast paths off (``Target(fast=False)``, the same model): every block,
    a chain too, through the general path, an ancestor matrix and a 4-D mask. Beside ``library`` in one
    run it measures what the chain fast paths save."""

    def __init__(self, target: Target, context: Tensor, room: int = 0):  # context [B, C]
        super().__init__(Target(target.model, target.tokenizer, fast=False), context, room)


class UnpackedLibraryForward(LibraryForward):
    """The library's forward without packed weights (``Target(pack=False)``, the same model): the few-row
    plan measured without oneDNN's packed product. Beside ``library`` it measures what packing saves."""

    def __init__(self, target: Target, context: Tensor, room: int = 0):  # context [B, C]
        super().__init__(Target(target.model, target.tokenizer, pack=False), context, room)


class GqaLibraryForward(LibraryForward):
    """The library's forward with every query head a head of its own in attention (``enable_gqa`` for a
    block, transformers' call for one query: :func:`specdec.gqa_attention.packed_rows` off), as before
    each KV head's query group became one block of rows. Beside ``library`` it measures what that saves."""

    def call(self, tokens: Tensor, parents: list[int] | None) -> Callable[[], Any]:
        forward = super().call(tokens, parents)

        def unpacked() -> Any:
            with packed_rows(False):
                return forward()
        return unpacked


class TransformersForward:
    """Plain transformers on the same model: ``model(input_ids, cache=DynamicCache)``."""

    def __init__(self, target: Target, context: Tensor, room: int = 0):  # context [B, C]; its cache grows per token
        from transformers import DynamicCache

        self.model, self.context = target.model, context.shape[1]
        self.cache = DynamicCache(config=self.model.config)
        self.model(input_ids=context.to(target.device), **cache_kwargs(self.cache), use_cache=True, logits_to_keep=1)

    def call(self, tokens: Tensor, parents: list[int] | None) -> Callable[[], Any]:
        ids = tokens.to(self.model.device)
        if parents is None:  # transformers' own causal path
            return lambda: self.model(input_ids=ids, **cache_kwargs(self.cache), use_cache=True)
        B, m = tokens.shape
        anc = torch.eye(m, dtype=torch.bool)  # [m, m]: node i sees node j (an ancestor or itself)
        for i, p in enumerate(parents):
            if p >= 0:
                anc[i] |= anc[p]
        seen = torch.cat([torch.ones(m, self.context, dtype=torch.bool), anc], dim=1)  # [m, C + m]
        dtype = self.model.dtype
        mask = torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)
        mask = mask.expand(B, 1, m, self.context + m).to(self.model.device)
        pos = (self.context + anc.sum(1) - 1).expand(B, m).to(self.model.device)  # [B, m]: context + depth
        return lambda: self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                                  **cache_kwargs(self.cache), use_cache=True)

    def drop(self, tokens: Tensor) -> None:
        self.cache.crop(-tokens.shape[1])  # transformers 5: a negative count of tokens to remove


IMPLS: dict[str, type[LibraryForward] | type[TransformersForward]] = {
    "library": LibraryForward, "library_general": GeneralLibraryForward, "library_unpacked": UnpackedLibraryForward,
    "library_gqa": GqaLibraryForward, "transformers": TransformersForward}


# ------------------------------------------------------------------------------------------------
# the sweeps

def _ids(gen: torch.Generator, vocab: int, *shape: int) -> Tensor:
    return torch.randint(0, vocab, shape, generator=gen)


@torch.inference_mode()
def _point(fwd, tokens: Tensor, parents: list[int] | None, reps: int, device: torch.device) -> list[float]:
    return _times(fwd.call(tokens, parents), reps, device, after=lambda: fwd.drop(tokens))


def forward_sweep(target: Target, rc: RooflineConfig, gen: torch.Generator) -> tuple[list[dict], list[dict]]:
    """Every (batch, impl, threads, mask, m) of ``target``: one row per timed point, and the skipped
    points. One prefill per (batch, impl), at the first thread count, serves every thread count."""
    rows, skipped = [], []
    cost = ForwardCost.of(target)
    dtype = str(target.dtype).removeprefix("torch.")
    for batch in rc.batches:
        context = _ids(gen, target.vocab_size, batch, rc.context)
        for impl in rc.impls:
            torch.set_num_threads(rc.threads[0])
            with torch.inference_mode():
                fwd = IMPLS[impl](target, context, max(rc.new_tokens))
            for threads in rc.threads:
                torch.set_num_threads(threads)
                for mask in rc.masks:
                    for m in rc.new_tokens:
                        if mask == "tree" and m < 3:
                            continue
                        point = {"impl": impl, "dtype": dtype, "threads": threads, "batch": batch, "mask": mask,
                                 "m": m, "context": rc.context}
                        if rc.max_block_tokens and batch * m > rc.max_block_tokens:
                            skipped.append({**point, "why": f"batch * m > max_block_tokens = {rc.max_block_tokens}"})
                            continue
                        tokens = _ids(gen, target.vocab_size, batch, m)
                        parents = None if mask == "chain" else tree_parents(m)
                        times = _point(fwd, tokens, parents, rc.reps, target.device)
                        rows.append({**point, "time_s": min(times), "times_s": times,
                                     "bytes": cost.bytes(batch, m, rc.context),
                                     "flops": cost.flops(batch, m, rc.context)})
            del fwd
    return rows, skipped


def context_sweep(target: Target, rc: RooflineConfig, gen: torch.Generator) -> list[dict]:
    """Per context and impl: prefill time and peak memory, then the forwards of ``context_new_tokens``
    at that context, with the peak memory of that phase (over the same baseline: it holds the KV).
    On a CPU also the tensors' own peaks (:class:`TensorPeak`), counted from before the prefill:
    the prefill's (counted while it is timed: the profiler's cost is per op, about a thousand of
    them, against a prefill of hundreds of milliseconds), what it leaves held, and one untimed
    forward of each m right after it (so a KV store that grows for the block is counted)."""
    rows = []
    cost = ForwardCost.of(target)
    count_tensors = target.device.type == "cpu"
    for ctx in rc.contexts:
        context = _ids(gen, target.vocab_size, 1, ctx)
        for impl in rc.impls:
            mem = PeakMemory(target.device)
            mem.start()
            blocks = [_ids(gen, target.vocab_size, 1, m) for m in rc.context_new_tokens]
            tensors = TensorPeak() if count_tensors else None
            with torch.inference_mode(), tensors or contextlib.nullcontext():
                with Stopwatch(target.device) as prefill:
                    fwd = IMPLS[impl](target, context, max(rc.context_new_tokens))
                prefill_s, prefill_peak = prefill.seconds, mem.peak_mib()
                mem.reset()
                if tensors is not None:
                    for tokens in blocks:
                        tensors.mark()
                        fwd.call(tokens, None)()
                        fwd.drop(tokens)
            counted = tensors.segments if tensors is not None else [(None, None)] * (len(blocks) + 1)
            points = []
            for m, tokens, (step_peak, _) in zip(rc.context_new_tokens, blocks, counted[1:]):
                times = _point(fwd, tokens, None, rc.reps, target.device)
                points.append({"impl": impl, "context": ctx, "m": m, "time_s": min(times), "times_s": times,
                               "bytes": cost.bytes(1, m, ctx), "flops": cost.flops(1, m, ctx),
                               "kv_mib": cost.kv_bytes_per_slot * ctx / 2**20, "prefill_s": prefill_s,
                               "prefill_peak_mib": prefill_peak, "memory": mem.kind,
                               "prefill_tensor_mib": counted[0][0], "held_tensor_mib": counted[0][1],
                               "decode_tensor_mib": step_peak})
            decode_peak = mem.peak_mib()
            rows += [{**p, "decode_peak_mib": decode_peak} for p in points]
            del fwd
    return rows


def speedup_sweep(cfg: RunConfig, target: Target, out: Path | None) -> list[dict]:
    """The run's methods and autoregressive decoding at every ``speedup_contexts`` prompt length."""
    rows = []
    for i, ctx in enumerate(cfg.roofline.speedup_contexts):
        run = replace(cfg, mode="decode", baseline=True, warmup=cfg.warmup and i == 0,
                      dataset=replace(cfg.dataset, input_len=ctx))
        res = run_experiment(run, out / f"speedup_ctx{ctx}" if out is not None else None, target=target)
        for method, s in res.summary.items():
            prompt = [r["prompt_tokens"] for r in res.records if r["method"] == method]
            rows.append({"context": ctx, "method": method, "prompt_tokens": sum(prompt) / len(prompt),
                         **{k: s.get(k) for k in SPEEDUP_KEYS}})
    return rows


# ------------------------------------------------------------------------------------------------
# the run

def _limits(row: dict, bandwidth: dict[int, dict], peak: dict[tuple[str, int], float]) -> dict[str, float]:
    bw = bandwidth[row["threads"]]["triad_gb_s"] * 1e9
    t_bw, t_flop = row["bytes"] / bw, row["flops"] / peak[row["dtype"], row["threads"]]
    return {"bandwidth_limit_s": t_bw, "compute_limit_s": t_flop, "roofline_s": max(t_bw, t_flop),
            "pct_of_bandwidth_limit": 100 * t_bw / row["time_s"]}


def _with_ratios(rows: list[dict]) -> list[dict]:
    """``ratio`` = t(m) / t(1) of the same impl, dtype, threads and batch (the chain's m = 1), and
    ``roofline_ratio`` the same of the roofline times."""
    ones = {(r["impl"], r["dtype"], r["threads"], r["batch"]): r for r in rows if r["m"] == 1 and r["mask"] == "chain"}
    out = []
    for r in rows:
        one = ones.get((r["impl"], r["dtype"], r["threads"], r["batch"]))
        out.append({**r, "ratio": r["time_s"] / one["time_s"] if one else None,
                    "roofline_ratio": r["roofline_s"] / one["roofline_s"] if one else None})
    return out


def _machine(device: torch.device) -> dict[str, Any]:
    """The device, and on a CPU its model name and the vector/matrix extensions it has: CPUs that
    print the same name ran the same forward at different speeds."""
    c = cpu()
    return {"device": str(device), "cpu": c.model, "cpu_isa": list(c.isa), "cpu_count": os.cpu_count(),
            "llc_mib": _llc_mib(), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def run_roofline(cfg: RunConfig, out_dir: str | Path | None = None, target: Target | None = None) -> dict[str, Any]:
    """Run ``cfg.roofline``'s grid (module docstring); with ``out_dir``, write its files there."""
    rc, out = cfg.roofline, Path(out_dir) if out_dir is not None else None
    if rc.speedup_contexts and cfg.dataset.name not in ("random", "stdlib"):
        raise ValueError("roofline.speedup_contexts set prompt lengths: they need dataset random or stdlib,"
                         f" not {cfg.dataset.name!r}")
    target = target if target is not None else build_target(cfg.target)
    device, threads0 = target.device, torch.get_num_threads()
    gen = torch.Generator().manual_seed(rc.seed)
    stream_mib = rc.stream_mib or max(64, 4 * _llc_mib())
    result: dict[str, Any] = {"machine": _machine(device), "bandwidth": [], "compute": [], "forward": [],
                              "skipped": [], "context": [], "speedup": [], "few_rows": []}
    try:
        for threads in rc.threads:
            torch.set_num_threads(threads)
            result["bandwidth"].append({"threads": threads, **stream_bandwidth(device, stream_mib, rc.reps)})
            for dtype in rc.dtypes:
                flops = linear_peak(device, getattr(torch, dtype), rc.linear_size, rc.reps)
                result["compute"].append({"threads": threads, "dtype": dtype, "n": rc.linear_size,
                                          "gflop_s": flops / 1e9})
        for dtype in rc.dtypes:
            t = target if dtype == cfg.target.dtype else build_target(replace(cfg.target, dtype=dtype))
            _tune(t, rc.threads)
            rows, skipped = forward_sweep(t, rc, gen)
            result["forward"] += rows
            result["skipped"] += skipped
            result["few_rows"].append(_few_rows_report(t, dtype, rc.threads))
            del t
        torch.set_num_threads(rc.threads[0])
        result["context"] = context_sweep(target, rc, gen)
        result["speedup"] = speedup_sweep(cfg, target, out)
    finally:
        torch.set_num_threads(threads0)
    bandwidth = {b["threads"]: b for b in result["bandwidth"]}
    peak = {(p["dtype"], p["threads"]): p["gflop_s"] * 1e9 for p in result["compute"]}
    result["forward"] = _with_ratios([{**r, **_limits(r, bandwidth, peak)} for r in result["forward"]])
    dtype0 = str(target.dtype).removeprefix("torch.")
    if (dtype0, rc.threads[0]) in peak:
        result["context"] = [{**r, **_limits({**r, "dtype": dtype0, "threads": rc.threads[0]}, bandwidth, peak)}
                             for r in result["context"]]
    result["summary"] = summarize(result["forward"])
    if out is not None:
        write_config(cfg, out)
        (out / "roofline.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _tune(target: Target, threads: list[int]) -> None:
    """The few-row plans (packed, and unpacked for ``library_unpacked``) of every thread count,
    tuned (cached, else measured) before anything is timed: a timed forward never measures."""
    if not target.takes_row_plan():
        return
    for n in threads:
        torch.set_num_threads(n)
        for pack in dict.fromkeys((target.pack, False)):
            few_rows.autotune(target.model, packed=pack)


def _few_rows_report(target: Target, dtype: str, threads: list[int]) -> dict[str, Any]:
    """Which product the library's linear layers took per row count at each thread count (CPU; empty
    elsewhere), and the memory the packed copies hold."""
    plans = []
    for n in threads:
        torch.set_num_threads(n)
        plan = few_rows.plan_for(target.model, packed=target.pack) if target.device.type == "cpu" else {}
        plans.append({"threads": n, "plan": sorted(plan.items())})  # [[rows, product], ...]: JSON keeps ints
    return {"dtype": dtype, "plans": plans, "packed_mib": few_rows.packed_bytes(target.model) / 2**20}


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (dtype, threads, batch, mask, impl), in that order: t(1), % of the bandwidth limit
    at m = 1 and t(m)/t(1) per m, measured and by the roofline (the chain's m = 1 is every ratio's
    reference)."""
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["threads"], r["batch"], r["mask"], r["impl"]), []).append(r)
    ones = {(r["dtype"], r["threads"], r["batch"], r["impl"]): r for r in rows if r["m"] == 1 and r["mask"] == "chain"}
    out = []
    for key in sorted(groups, key=lambda k: (dtypes.index(k[0]), *k[1:])):
        dtype, threads, batch, mask, impl = key
        one, rs = ones.get((dtype, threads, batch, impl)), groups[key]
        out.append({"impl": impl, "dtype": dtype, "threads": threads, "batch": batch, "mask": mask,
                    "t1_s": one["time_s"] if one else None,
                    "pct_of_bandwidth_limit_m1": one["pct_of_bandwidth_limit"] if one else None,
                    "ratio": {r["m"]: r["ratio"] for r in rs},
                    "roofline_ratio": {r["m"]: r["roofline_ratio"] for r in rs}})
    return out

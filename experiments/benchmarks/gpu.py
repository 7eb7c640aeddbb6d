"""The GPU kit: kernels compiled, the loop at real scale, planted and real acceptance, in one run.

    make gpu-bench OUT=docs/gpu/h200            # a CUDA or ROCm machine (docs/gpu.md)
    make gpu-bench OUT=/tmp/dry DRY_RUN=1       # CPU, tiny shapes (the test suite runs this)

Writes into OUT: ``env.json`` (GPU, driver, versions, or "cpu dry run"), ``results.json`` (every
measurement, which sections were skipped for time, and the error of any section that failed) and
``results.md`` (the tables), both rewritten after every section, and, when matplotlib is there,
``kernels.png``, ``forward.png``, ``planted.png``. Hard dependencies: torch, transformers,
safetensors, and accelerate for the training section (the trainer's device placement); matplotlib
and Triton optional; PyYAML and tqdm come with transformers. Runs from a bare checkout: specdec
need not be installed, and no registry entry point, hydra or offline model package is used. A
section that raises is recorded and the next one still runs (so does a kernel case, within its
table; the 8B target is built as a step of its own, and when it fails forward and planted record
that they did not run); the exit status is then non-zero.

Sections, in order (``--budget-s`` skips the rest when the next step would not fit, and records it):

1. **kernels**: every Triton kernel against its torch reference on the same inputs: identical
   integers / allclose floats, median time (``triton.testing.do_bench`` on a GPU, a
   ``perf_counter`` loop on CPU), bytes over time as % of a measured device-to-device ``copy_``,
   speedup over the reference; a case that differs names its first differing element and the
   reference's value there; and the path ``auto`` takes there (``specdec.kernels.choice``). Real
   shapes on a GPU; tiny ones in the dry run, where the Triton path runs in Triton's CPU
   interpreter (``TRITON_INTERPRET=1``, set before triton is imported) under
   ``specdec.testing.triton_memory.weak_memory`` (a store seen only after a barrier, as on a GPU;
   each row counts its unsynchronised reads), or only the reference when triton is absent
   (``results.json`` says which).
2. **forward**: a random-weight Llama-3.1-8B (hidden 4096, 32 layers, 32/8 heads, MLP 14336,
   vocab 128256) in bf16 built on the GPU (nothing downloaded), wrapped in ``specdec.Target``:
   one forward over m new tokens after a 512-token context, ``t(m)/t(1)``, at batch 1, 4, 16, 64;
   the block is dropped after each forward and the store marked dense again, so every timed
   forward runs without a mask, as plain decoding does. The same table again with the step
   captured (``capture="graphs"``: CUDA graphs, docs/capture.md), side by side.
3. **planted**: end-to-end greedy decoding on that target at concurrency 1, 4, 16, 64 with
   :class:`PlantedDrafter` (its own greedy continuation, each position accepted in a share p of
   the times the walk reaches it), k drafts every step and again under the batch-aware prefix
   scheduler (:class:`specdec.policy.PrefixPolicy`: DSpark's rule, its confidences the planted p,
   its costs the forward section's verify times at that batch and the planted run's draft time):
   measured speedup vs the same loop without a drafter, and the speedup predicted from acceptance
   and measured costs (``specdec.eval.runner.predicted_speedup``: mean accepted length × the
   autoregressive step's phases / the speculative step's phases), for both; then the autoregressive
   and planted runs again on the captured target (``captured_rows``). The target's greedy
   choices are well separated (:func:`specdec.testing.planted.separate_choices`), so its block
   forwards choose what its one-token forwards choose, in bf16 too: every row is its own greedy
   output and accepts the planted p. Every timed run follows the same run untimed. A systems
   benchmark: acceptance is planted.
4. **mtp**: the committed tiny DeepSeek-V3 with its MTP modules, fp32 and bf16, k = 1..4: greedy
   output identical to autoregressive decoding, acceptance, speedup. Every timed run follows the
   same run untimed (kernel compiles and autotuning land there).
5. **train**: tokens/s of the EAGLE-3 recipe (``experiments/conf/train/smollm2_eagle3.yaml`` with
   the learning curves' options, ``experiments/benchmarks/learning_curves.py``) through the one trainer, on the committed corpus
   (``experiments/data/smollm2-135m``, prompts cut to 64 tokens), 350 steps of 32 sequences: 10x
   the 1 120 sequences of the CPU learning-curve runs. SmolLM2-135M's weights cannot travel to the
   GPU machine (no offline model package there, and they exceed the 64 MiB checkout), so the
   target has SmolLM2-135M's shape and vocabulary (the corpus's token ids fit) with random bf16
   weights: **a throughput measurement only**; its loss and acceptance say nothing about drafting.
   Features are computed per batch on the device. 384 corpus sequences (19 of them held out, and
   evaluated). Timed in two parts with the trainer's own stop-and-resume (8 steps, then as many
   more as fit, at the first part's rate, in the section's 90 s); each part's rate is its training
   loop alone, as the trainer records each part (start-up and held-out evaluation excluded); the
   dry run trains a narrow 8-layer model of the same vocabulary 2 + 2 steps.

**Time estimate for the real run on an H200** (the budget is 8 minutes; ``--budget-s`` defaults
to 360 s counted from process start, and a step starts only when its estimate fits, so the last
ones are dropped rather than the run overrunning; the 120 s left cover a step that runs long):

- start-up: imports, CUDA context, the copy probe: ~15 s.
- kernels: rejection sampler 3 variants (chain probs, tree probs, chain greedy logits) × 36 shapes
  = 108 shapes × 2 paths. Autotuning: 5 row configs × (3 variants × 4 V) keys, each config compiled
  once per constexpr set and draft-count bucket ``N_POW2`` (1, 4, 8): 15–30 compiles, ~1 s each,
  and timed by Triton's autotuner (~0.15 s each: 60 × 0.15 = 9 s): ~40 s. Timing: 216
  ``do_bench`` calls of ~35 ms (warm-up 5 ms, 20 ms of repeats, plus the first call) ≈ 8 s; input
  generation (multinomial over up to 64·8 × 262k) ≈ 15 s. Draft input 3 M × 2 paths, 4 GEMM
  configs compiled (~8 s); Markov 3 B × 2 paths, its own configs (BLOCK 128–512, those whose
  ``[BLOCK, 64]`` tile fits 16K elements: 3, ~5 s); KV gather 3 shapes (one compile). One call
  per case under ``auto``: each is a new bucket of the dispatcher, which times both paths (9 calls
  each: 117 cases × ~18 calls of 0.1–13 ms ≈ 10 s). Kernels total ≈ 100 s (a kernel's first case
  is budgeted at 20 s, the others at 3 s).
- forward: building 8.0 B bf16 parameters on the GPU ≈ 10 s. Per batch B ∈ {1, 4, 16, 64}: a
  512-token prefill (B = 64: 32k tokens × 16 GFLOP ≈ 0.5 PFLOP ≈ 1 s), then 7 m values × (1 warm-up
  + 5 timed) forwards: 168 forwards at ≤ 0.15 s (B = 64, m = 64: 4096 tokens ≈ 65 TFLOP ≈ 0.1 s;
  B = 1: 16 GB of weights at ~4 TB/s plus ~10 ms of eager launches ≈ 15 ms) ≈ 15 s. Total ≈ 30 s.
- planted: per concurrency c ∈ {1, 4, 16, 64}: an autoregressive run (64 new tokens, 64 steps ×
  15–40 ms ≈ 1–2.5 s), a speculative run (k = 4, p = 0.8: ~19 steps × 20–60 ms ≈ 1 s) and one
  under the scheduler (19–64 steps, ≤ 2.5 s; its schedule is ~1 ms of Python a step at c = 64),
  each twice (untimed, then timed), after the verifier's compiles for 0..k drafts (~5 s); phases
  synchronise the device (``timed``): ≈ 45 s. Prompts are 128 tokens.
- mtp: the 17 MB checkpoint, 2 dtypes × (1 AR + 4 speculative runs) of 4 prompts × 64 tokens on
  a 2-layer model, each run twice (untimed, then timed): ~2 000 small steps × ~10 ms of eager
  launches, plus the draft-input GEMM's autotuning for a few M buckets ≈ 30 s.
- train: the random 135M target (< 1 s, built once) and the corpus (384 sequences, < 1 s, read by
  each part). A step is the whole batch (32 sequences, every response position an anchor) × 7
  training-time-test steps of a one-layer head in one pass per step (~60 eager ops forward and
  about as many backward, no host read; the figures are read once per log interval) plus a
  30-layer feature forward over 32 × ~330 tokens; the table gives target tokens/s, response
  tokens/s and trained positions/s (loss positions at draft depth 1). The per-sequence loop this
  replaced took 4.5 s a step on the first H200 run. The section stops at 90 s: 8 steps, then as
  many as its rate says fit (the resumed part's start-up and evaluation counted at 20 s).

Sum ≈ 15 + 100 + 30 + 45 + 30 + 90 ≈ 310 s (5 minutes), under the 8 minutes with the 360 s
guard covering a slow compile cache or a slower GPU (a section starts only when its estimate fits
by 360 s; the training, the largest, is estimated at its whole 90 s).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform as host
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

# the budget counts from here, before torch's import and the CUDA start-up: those are spent too
# (the standard-library imports above take milliseconds); specdec.timing's clock, read before the
# source tree is importable (tests/test_layout.py allows this one line)
STARTED = time.perf_counter()

if "--dry-run" in sys.argv:  # the interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[2]
if importlib.util.find_spec("specdec") is None:  # a bare checkout on the GPU machine: nothing installed
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# experiments/ is on the path: the runner's own folder, or PYTHONPATH=experiments (make gpu-bench)
from benchmarks.kernels import (describe_difference, first_difference, make_inputs,  # noqa: E402
                               verification_difference)
from specdec.kernels import (choice, gather_slots, markov_sample, norm_concat_linear,  # noqa: E402
                             rejection_sample, triton_available, use_backend)
from specdec.kernels.dispatch import interpreting, platform  # noqa: E402
from specdec.testing.triton_memory import weak_memory  # noqa: E402
from specdec.timing import measure, now, sync  # noqa: E402

PLANTED_LABEL = "systems benchmark: acceptance is planted, not learned"
CHECKPOINT = ROOT / "experiments" / "checkpoints" / "tiny-deepseek-v3-mtp"
CORPUS = ROOT / "experiments" / "data" / "smollm2-135m"


# ------------------------------------------------------------------------------------------------
# measuring

def median_s(fn: Callable[[], Any], device: str, repeats: int = 3) -> float:
    """Median seconds of ``fn()``: ``do_bench`` (CUDA events, cache flushed) on a GPU, else
    :func:`specdec.timing.measure` after one warm-up."""
    if device == "cuda" and triton_available():
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=20, return_mode="median") / 1e3
    return measure(fn, repeats, warmup=1, device=device).median


class Budget:
    """Wall-clock seconds left since ``t0`` (process start); a step that would not fit is skipped
    and recorded."""

    def __init__(self, seconds: float, t0: float):
        self.t0, self.seconds, self.skipped = t0, seconds, []

    def elapsed(self) -> float:
        return now() - self.t0  # the clock STARTED read

    def allows(self, name: str, estimate_s: float) -> bool:
        if self.elapsed() + estimate_s <= self.seconds:
            return True
        self.skipped.append({"what": name, "estimate_s": estimate_s, "elapsed_s": round(self.elapsed(), 1)})
        print(f"skipped {name}: {self.elapsed():.0f} s spent, ~{estimate_s:.0f} s needed, budget {self.seconds:.0f} s")
        return False


def environment(device: str) -> dict[str, Any]:
    """What ran: GPU name, driver, versions; ``cpu dry run`` without a GPU."""
    env: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0], "host": host.node(),
                           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    for pkg in ("triton", "transformers", "safetensors", "matplotlib"):
        env[pkg] = _version(pkg)
    if device == "cpu":
        env["gpu"] = "cpu dry run"
        return env
    props = torch.cuda.get_device_properties(0)
    env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), platform=platform(),
               multiprocessors=props.multi_processor_count, cuda=torch.version.cuda, hip=torch.version.hip)
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["driver"] = None
    return env


def _version(pkg: str) -> str | None:
    if importlib.util.find_spec(pkg) is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return "present"


# ------------------------------------------------------------------------------------------------
# 1. kernels

def copy_bandwidth(device: str, dry: bool) -> float:
    """Bytes per second of a device-to-device ``copy_`` (read + write counted), the ceiling."""
    n = (64 if dry else 1024) * 2**20
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    return 2 * n / median_s(lambda: dst.copy_(src), device)


# the kit's kernel names -> the dispatcher's (specdec.kernels.choice)
DISPATCHED = {"rejection chain": "rejection", "rejection tree": "rejection", "rejection chain greedy": "rejection",
              "draft input": "norm_concat_linear", "markov sampler": "markov", "kv gather": "gather_slots"}


def kernel_cases(device: str, dry: bool):
    """(kernel, shape label, inputs builder) for every kernel and shape; builders return
    (call(), bytes moved, difference(ref, ker) -> the first differing element, or None)."""
    g = torch.Generator(device=device).manual_seed(0)
    Bs, ks, Vs = ((1, 2), (1, 3), (37,)) if dry else ((1, 8, 64), (1, 4, 8), (32_000, 128_256, 152_064, 262_144))
    for variant, mode, tree in (("chain", "probs", False), ("tree", "probs", True), ("chain greedy", "greedy", False)):
        for V in Vs:
            for B in Bs:
                for k in ks:
                    def build(B=B, k=k, V=V, mode=mode, tree=tree):
                        args, kw, nbytes = make_inputs(B, k, V, device, mode, tree=tree)
                        return (lambda: rejection_sample(*args, **kw)), nbytes, verification_difference
                    yield f"rejection {variant}", f"B={B} k={k} V={V}", build
    dt = torch.float32 if dry else torch.bfloat16
    D = 32 if dry else 4096
    for M in ((1, 5) if dry else (1, 8, 64)):
        def build_gemm(M=M):
            a, b = (torch.randn(M, D, device=device, generator=g).to(dt) for _ in range(2))
            wa, wb = (1 + 0.1 * torch.randn(D, device=device, generator=g)).to(dt), None
            w = (0.02 * torch.randn(D, 2 * D, device=device, generator=g)).to(dt)
            nbytes = (w.numel() + a.numel() + b.numel() + wa.numel() + M * D) * a.element_size()
            tol = 1e-4 if dt == torch.float32 else 2e-2
            return (lambda: norm_concat_linear([a, b], [wa, wb], w)), nbytes, \
                lambda x, y: first_difference(x, y, atol=tol, rtol=tol)
        yield "draft input", f"M={M} D={D} {str(dt).removeprefix('torch.')}", build_gemm
    gamma, rank, Vm = (3, 4, 37) if dry else (4, 64, 128_256)
    for B in ((1, 2) if dry else (1, 8, 64)):
        def build_markov(B=B):
            U = torch.randn(B, gamma, Vm, device=device, generator=g)
            W1, W2 = (0.1 * torch.randn(Vm, rank, device=device, generator=g) for _ in range(2))
            x0 = torch.randint(0, Vm, (B,), device=device, generator=g)
            u = torch.rand(B, gamma, device=device, generator=g)
            nbytes = (2 * U.numel() + W1.numel() + W2.numel()) * 4  # U read, q written, the bias tables
            def differs(x, y):  # the tokens exact, q within the module's tolerance
                return first_difference(x[0], y[0], where="tokens") or \
                    first_difference(x[1], y[1], atol=1e-6, rtol=1e-5, where="q")
            return (lambda: markov_sample(U, x0, W1, W2, 0.8, u)), nbytes, differs
        yield "markov sampler", f"B={B} γ={gamma} V={Vm} r={rank}", build_markov
    H, S, Dh = (2, 9, 4) if dry else (8, 1024, 128)
    for B in ((1, 2) if dry else (1, 8, 64)):
        def build_gather(B=B):
            x = torch.randn(B, H, S, Dh, device=device, generator=g).to(dt)
            order = torch.stack([torch.randperm(S, device=device, generator=g) for _ in range(B)])
            return (lambda: gather_slots(x, order)), 2 * x.numel() * x.element_size(), first_difference
        yield "kv gather", f"B={B} H={H} S={S} D={Dh} {str(dt).removeprefix('torch.')}", build_gather


def bench_kernels(device: str, dry: bool, budget: Budget) -> dict[str, Any]:
    kernel_path = "triton" if triton_available() and (device == "cuda" or interpreting()) else None
    mode = ("compiled" if device == "cuda" else "cpu interpreter (TRITON_INTERPRET=1)") if kernel_path \
        else "torch reference only (triton absent)"
    peak = copy_bandwidth(device, dry)
    rows, failed, seen = [], [], set()
    for kernel, shape, build in kernel_cases(device, dry):
        # a kernel's first case compiles and autotunes its configs (~5 x 1-2 s); later ones ~0.3 s
        if not budget.allows(f"kernels: {kernel} {shape}", 1.0 if dry else 3.0 if kernel in seen else 20.0):
            continue
        seen.add(kernel)
        try:
            row = kernel_row(build, peak, device, dry, with_triton=kernel_path is not None,
                             dispatched=DISPATCHED[kernel])
            rows.append({"kernel": kernel, "shape": shape, **row})
        except Exception as e:  # noqa: BLE001  (one broken case must not cost the rest of the table)
            failed.append({"kernel": kernel, "shape": shape, "error": f"{type(e).__name__}: {e}",
                           "traceback": traceback.format_exc()[-2000:]})
            print(failed[-1]["traceback"], file=sys.stderr)
    return {"path": mode, "copy_bandwidth_GBps": peak / 1e9, "rows": rows, "errors": failed,
            "autotune": autotune_winners()}


def kernel_row(build, peak: float, device: str, dry: bool, with_triton: bool, dispatched: str) -> dict[str, Any]:
    """One case: the torch reference timed, then (``with_triton``) the kernel timed and compared,
    then one call under ``auto``: the path the dispatcher takes there (measured on a GPU, once per
    shape bucket and machine; the reference off the GPU) and why."""
    call, nbytes, difference = build()
    with use_backend("torch"):
        ref = call()
        t_ref = median_s(call, device)
    row = {"bytes": nbytes, "torch_ms": t_ref * 1e3, "torch_pct_copy_bw": 100 * nbytes / t_ref / peak}
    if with_triton:
        with use_backend("triton"), (weak_memory() if interpreting() else contextlib.nullcontext()) as log:
            out = call()  # in the interpreter, as a GPU orders memory: a store is seen only after a barrier
            t_ker = median_s(call, device, repeats=1 if dry else 3)
        diff = difference(ref, out)
        row.update(triton_ms=t_ker * 1e3, triton_pct_copy_bw=100 * nbytes / t_ker / peak,
                   speedup=t_ref / t_ker, exact=diff is None, first_difference=diff)
        if log is not None:  # loads of the program's own stores not behind a barrier: races on a GPU
            row["unsynchronised_reads"] = len(log.hazards)
    with use_backend("auto"):
        call()
    row["auto"], row["auto_why"] = choice.last(dispatched) or ("torch", "not dispatched")
    return row


def autotune_winners() -> dict[str, dict[str, str]]:
    """Each autotuned kernel's winner per key (empty under the interpreter, which does not tune)."""
    out = {}
    for mod in ("rejection_triton", "norm_concat_linear_triton", "markov_triton"):
        tuned = getattr(sys.modules.get(f"specdec.kernels.{mod}"), "_tuned", None)
        if tuned is not None:
            out[mod] = {str(key): str(cfg) for key, cfg in getattr(tuned, "cache", {}).items()}
    return out


# ------------------------------------------------------------------------------------------------
# 2. the target at real scale

def random_llama(device: str, dtype: torch.dtype, **config: Any):
    """A Llama of the given shape with random weights, made on ``device`` in ``dtype`` (nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**config)
    cfg._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype).eval()


def build_target(device: str, dry: bool):
    """Llama-3.1-8B's shape with random bf16 weights, made on the GPU; a tiny Llama in the dry run.
    Its greedy choices are well separated (:func:`specdec.testing.planted.separate_choices`), so a
    block forward picks what a one-token forward picks, in bf16 too: the planted section's
    continuation stays the target's own output, and its acceptance is the planted one."""
    from specdec.target import Target
    from specdec.testing.planted import separate_choices

    if dry:
        from specdec.testing.tiny import tiny_model

        target = Target(tiny_model("llama", vocab_size=256, init_scale=0.3, seed=0))
    else:
        target = Target(random_llama(device, torch.bfloat16, hidden_size=4096, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                                     vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                                     tie_word_embeddings=False))
    separate_choices(target, seed=0)
    return target


FORWARD = {"dry": dict(context=32, ms=(1, 2, 4, 8), batches=(1, 4), reps=3),
           "real": dict(context=512, ms=(1, 2, 4, 8, 16, 32, 64), batches=(1, 4, 16, 64), reps=5)}


def forward_times(target, device: str, B: int, context: int, ms: tuple[int, ...], reps: int) -> dict[int, float]:
    """Median seconds of one forward over m new tokens per row after a ``context``-token prompt, batch B."""
    g = torch.Generator().manual_seed(B)
    session = target.new_session(B)
    target.prefill(session, torch.randint(0, target.vocab_size, (B, context), generator=g).tolist())
    times: dict[int, float] = {}
    for m in ms:
        tokens = torch.randint(0, target.vocab_size, (B, m), generator=g).to(target.device)

        def drop(m: int = m) -> None:
            target.commit(session, torch.zeros(B, m, dtype=torch.bool, device=target.device))
            session.cache.compact()  # drop the block again: every forward sees the same context,
            session.cache.refresh_dense()  # unmasked like plain decoding (a mask makes SDPA repeat KV heads)

        times[m] = measure(lambda: target.forward(session, tokens), reps, warmup=1, device=device, after=drop).median
    return times


def both_paths(target):
    """The target's model as an eager target and as a captured one (``capture="graphs"``: CUDA graphs
    on a GPU; on the dry run's CPU the same static step, unrecorded)."""
    from specdec.target import Target

    return Target(target.model, target.tokenizer, capture="eager"), Target(target.model, target.tokenizer, capture="graphs")


def captured_step_syncs(target, device: str) -> str:
    """One captured verify step (after its recording) under ``torch.cuda.set_sync_debug_mode("error")``:
    ``"none"`` when nothing in the step, captured or not, waits for the device; else the error."""
    if device != "cuda":
        return "not checked (cpu)"
    session = target.new_session(1, reserve=64)
    target.prefill(session, [[1, 2, 3, 4]])
    block = torch.tensor([[5, 6, 7]], device=device)
    target.forward(session, block)  # records
    target.commit(session, None)
    sync(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        target.forward(session, block)
        return "none"
    except RuntimeError as e:
        return f"{e}".splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def bench_forward(target, device: str, dry: bool, budget: Budget) -> dict[str, Any]:
    """t(m)/t(1): one forward over m new tokens after a ``context``-token prompt, per batch; eager
    and captured (``ms_captured``, ``t_over_t1_captured``) side by side."""
    f = FORWARD["dry" if dry else "real"]
    eager, captured = both_paths(target)
    rows = []
    for B in f["batches"]:
        if not budget.allows(f"forward: B={B}", 2.0 if dry else 24.0):
            continue
        times = forward_times(eager, device, B, f["context"], f["ms"], f["reps"])
        cap = forward_times(captured, device, B, f["context"], f["ms"], f["reps"])
        rows += [{"batch": B, "m": m, "context": f["context"], "ms": t * 1e3, "t_over_t1": t / times[f["ms"][0]],
                  "ms_captured": cap[m] * 1e3, "t_over_t1_captured": cap[m] / cap[f["ms"][0]]}
                 for m, t in times.items()]
    return {"model": "tiny llama (dry run)" if dry else "Llama-3.1-8B shape, random bf16 weights",
            "dtype": str(target.dtype).removeprefix("torch."), "rows": rows,
            "captured": {"mode": captured.capture_mode, "recordings": captured._steps.captures if captured._steps else 0,
                         "host_syncs_in_a_step": captured_step_syncs(captured, device)}}


# ------------------------------------------------------------------------------------------------
# 3. planted acceptance, 4. real acceptance

def decode(target, drafter, prompts: list[list[int]], new_tokens: int, k: int, policy=None):
    """One greedy run of the loop (no EOS: every row makes ``new_tokens``), under a draft-length
    ``policy`` if given. On a GPU its phases sync the device (``timed``): unsynced, they time the
    host's launches and the predicted speedup built from them is wrong."""
    from specdec.loop import Request, run
    from specdec.verifiers.greedy import GreedyVerifier

    return run(target, drafter, GreedyVerifier(), [Request(list(p), new_tokens) for p in prompts], k=k,
               eos_token_ids=set(), timed=target.device.type == "cuda", policy=policy)


def warm_verifier(target, k: int, batches: tuple[int, ...] = (1,)) -> None:
    """Compile the greedy verifier's kernel for every draft count 0..k at the target's vocabulary
    before anything is timed: its ``N_POW2`` is a constexpr (one compile per next_pow2(n)), ``n``
    is specialised at 0 and 1, and the autotuner keys on V; each would otherwise land in a timed run.
    At each batch size too: the dispatcher times both paths at the first call of each (rows, draft
    count) bucket (``specdec.kernels.choice``), and that must not land in a timed run either."""
    from specdec.kernels.rejection import rejection_sample
    from specdec.types import chain_parents

    dev, V = target.device, target.vocab_size
    for B in batches:
        for n in range(k + 1):
            rejection_sample(torch.zeros(B, n, dtype=torch.long, device=dev), chain_parents(n, B, dev),
                             torch.full((B,), n, dtype=torch.long, device=dev), torch.zeros(B, n, device=dev), None,
                             None, logits=torch.zeros(B, n + 1, V, device=dev), temperature=torch.zeros(B, device=dev))


def compare(ar, spec, k: int) -> dict[str, Any]:
    """An autoregressive and a speculative run of the same requests: the speedups measured and
    predicted (from the speculative run's acceptance and measured costs, against the autoregressive
    cost per token), acceptance, drafts verified per step, and whether the outputs are identical."""
    from specdec.eval.runner import predicted_speedup

    reqs = [r.metrics for r in spec.requests]
    row_steps = lambda res: max(sum(r.metrics.steps for r in res.requests), 1)  # noqa: E731
    a_steps, s_steps = row_steps(ar), row_steps(spec)
    am, sm = ar.metrics, spec.metrics
    drafted = [sum(r.drafted_at[d] if d < len(r.drafted_at) else 0 for r in reqs) for d in range(k)]
    accepted = [sum(r.accepted_at[d] if d < len(r.accepted_at) else 0 for r in reqs) for d in range(k)]
    # tested at depth d: accepted down to d and drafted past it (a policy's cut or the continuation's end is no test)
    reached = [drafted[0]] + [min(n, a) for n, a in zip(drafted[1:], accepted[:-1])]
    mal = sum(r.accepted for r in reqs) / s_steps + 1
    ar_token = (am.draft_s + am.target_s + am.verify_s) / a_steps
    n = len(spec.requests)
    decode_s = lambda res: (res.metrics.wall_s - res.metrics.prefill_s) / max(res.metrics.new_tokens - n, 1)  # noqa: E731
    predicted = predicted_speedup(mal, sm.draft_s / s_steps, (sm.target_s + sm.verify_s) / s_steps, ar_token)
    return {"concurrency": n, "k": k, "new_tokens": spec.requests[0].metrics.new_tokens,
            "identical": [r.tokens for r in spec.requests] == [r.tokens for r in ar.requests],
            "mean_accepted_length": mal, "drafts_verified_per_step": sum(r.drafted for r in reqs) / s_steps,
            "acceptance_given_reached": [a / c if c else None for a, c in zip(accepted, reached)],
            "speedup": am.wall_s / sm.wall_s, "decode_speedup": decode_s(ar) / decode_s(spec),
            "predicted_speedup": predicted, "measured_over_predicted": am.wall_s / sm.wall_s / predicted if predicted else None,
            "ar_wall_s": am.wall_s, "spec_wall_s": sm.wall_s}


def planted_costs(target, device: str, dry: bool, c: int, k: int, forward_rows: list[dict], plain) -> tuple[Any, str]:
    """The scheduler's step costs at concurrency ``c``: verify times of a [c, m] block from the
    forward section (measured here when it did not run at batch ``c``), the draft pass from the
    planted run without the scheduler (seconds per batch step)."""
    from specdec.policy import StepCosts

    at_c = {r["m"]: r["ms"] / 1e3 for r in forward_rows if r["batch"] == c}
    source = f"forward section, batch {c}"
    if not at_c:
        f = FORWARD["dry" if dry else "real"]
        at_c = forward_times(target, device, c, f["context"], tuple(range(1, k + 2)), f["reps"])
        source = f"measured for the scheduler, batch {c}"
    ms = sorted(at_c)
    draft = plain.metrics.draft_s / max(plain.metrics.batch_steps, 1)
    return StepCosts([c * m for m in ms], [at_c[m] for m in ms], [c], [draft]), source


# repeats: timed runs of each configuration, the one of median wall time kept (a CPU shared with
# other work can stall one run of a few milliseconds; a GPU run is seconds long)
PLANTED = {"dry": dict(prompt=16, new=64, concurrencies=(1, 4), repeats=3),
           "real": dict(prompt=128, new=64, concurrencies=(1, 4, 16, 64), repeats=1)}


def bench_planted(target, device: str, dry: bool, budget: Budget, p: float, k: int,
                  forward_rows: list[dict]) -> dict[str, Any]:
    """Per concurrency: autoregressive decoding, the planted drafter, and the planted drafter under
    the batch-aware prefix scheduler (:class:`specdec.policy.PrefixPolicy`, its confidences
    the planted p, its costs the measured verify and draft times); then, as ``captured_rows``, the
    autoregressive and planted runs again with the target's steps captured. The drafter plants its
    acceptance evenly (``pattern="even"``: each position right in a share p of the times it is
    reached), so a short run's acceptance is p, not p plus sampling noise.

    Every timed run follows the same run untimed. What a run meets first at its concurrency's
    shapes (the prompt's prefill, blocks of k + 1 tokens over contexts of 128-200, rows retiring,
    masked blocks after ragged acceptance, the verifier at that batch: kernel compiles and
    specialisations, library plan choices, allocations, graph recordings) is paid there, not by
    whichever timed run comes first: without it the drafter's first run at each concurrency paid
    for the scheduled run after it, which ran the same forwards 2-4x faster."""
    from specdec.policy import PrefixPolicy
    from specdec.testing.planted import PlantedDrafter

    target, captured = both_paths(target)  # the main rows eager, whatever the target's default
    f = PLANTED["dry" if dry else "real"]
    prompt_len, new_tokens = f["prompt"], f["new"]

    def timed(*args, **kwargs):
        runs = sorted((decode(*args, **kwargs) for _ in range(f["repeats"])), key=lambda r: r.metrics.wall_s)
        return runs[len(runs) // 2]

    g = torch.Generator().manual_seed(1)
    rows, costs_used = [], {}
    planted = lambda conts, t=target: PlantedDrafter.create(t, p=p, continuations=conts, seed=0, pattern="even")  # noqa: E731
    warm_verifier(target, k, f["concurrencies"])
    captured_rows: list[dict[str, Any]] = []
    for c in f["concurrencies"]:
        if not budget.allows(f"planted: concurrency {c}", 3.0 if dry else 18.0):
            continue
        prompts = torch.randint(0, target.vocab_size, (c, prompt_len), generator=g).tolist()
        ar_first = decode(target, None, prompts, new_tokens, k)  # untimed, as every run below
        conts = {tuple(q): r.tokens for q, r in zip(prompts, ar_first.requests)}
        decode(target, planted(conts), prompts, new_tokens, k)
        ar = timed(target, None, prompts, new_tokens, k)
        plain = timed(target, planted(conts), prompts, new_tokens, k)
        costs, source = planted_costs(target, device, dry, c, k, forward_rows, plain)
        decode(target, planted(conts), prompts, new_tokens, k, policy=PrefixPolicy(costs))
        scheduled = timed(target, planted(conts), prompts, new_tokens, k, policy=PrefixPolicy(costs))
        if [r.tokens for r in ar.requests] != [r.tokens for r in ar_first.requests]:
            raise RuntimeError(f"two autoregressive runs at concurrency {c} disagree: the target is not deterministic")
        rows += [{"scheduler": False, **compare(ar, plain, k)}, {"scheduler": True, **compare(ar, scheduled, k)}]
        costs_used[c] = {"source": source, **asdict(costs)}
        if budget.allows(f"planted, captured: concurrency {c}", 2.0 if dry else 6.0):
            decode(captured, None, prompts, new_tokens, k)  # untimed first: the recordings happen there
            ar_c = decode(captured, None, prompts, new_tokens, k)
            decode(captured, planted(conts, captured), prompts, new_tokens, k)
            spec_c = decode(captured, planted(conts, captured), prompts, new_tokens, k)
            captured_rows.append({"capture": captured.capture_mode, **compare(ar_c, spec_c, k),
                                  "identical_to_eager": [r.tokens for r in spec_c.requests] == [r.tokens for r in ar.requests],
                                  "ar_speedup_over_eager": ar.metrics.wall_s / ar_c.metrics.wall_s})
    return {"label": PLANTED_LABEL, "p": p, "prompt_tokens": prompt_len, "rows": rows, "scheduler_costs": costs_used,
            "captured_rows": captured_rows}


def native_mtp(device: str, dry: bool, budget: Budget) -> dict[str, Any]:
    """The committed tiny DeepSeek-V3 with its MTP modules: real, learned acceptance."""
    from specdec.api import load_target
    from specdec.drafters.mtp.drafter import MTPDrafter
    from specdec.data.datasets import stdlib_files

    new_tokens, n_prompts = (12, 2) if dry else (64, 4)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        if not budget.allows(f"mtp: {dtype}", 10.0 if dry else 20.0):
            continue
        target = load_target(str(CHECKPOINT), dtype=dtype)
        target.model.to(device)
        prompts = [target.tokenizer.encode(f.read_text())[:48] for f in stdlib_files("heldout")[:n_prompts]]
        drafter = lambda: MTPDrafter.create(target, checkpoint=str(CHECKPOINT), policy="cycle")  # noqa: E731
        decode(target, None, prompts, new_tokens, 1)  # warm-up, untimed, as before every timed run below
        ar = decode(target, None, prompts, new_tokens, 1)
        for k in (1, 2, 3, 4):
            # the same run untimed first: the draft-input GEMM's autotuning (per M bucket) and the
            # verifier's compiles (per draft count) happen there, not in the timed run
            decode(target, drafter(), prompts, new_tokens, k)
            rows.append({"dtype": str(dtype).removeprefix("torch."),
                         **compare(ar, decode(target, drafter(), prompts, new_tokens, k), k)})
        del target, drafter
    return {"checkpoint": str(CHECKPOINT.relative_to(ROOT)), "prompts": "first 48 tokens of held-out stdlib files",
            "rows": rows}


# ------------------------------------------------------------------------------------------------
# 5. training throughput

TRAIN_LABEL = "training throughput only: the target has SmolLM2-135M's shape but random weights"
# The CPU recipe it scales: the corpus learning-curve runs (smollm2-135m-dflash's training.json; the committed corpus, 384
# sequences, prompts cut to 64 tokens, 280 steps of 4 sequences = 1 120 sequences drawn).
CPU_SEQUENCES = 280 * 4
# seconds: the section's own budget (start-up, both parts, their evaluations); steps: the schedule's length,
# of which the run trains the first part and then what fits; first: the part the rate is read from
TRAIN = {"dry": dict(batch=2, steps=4, first=2, use=24, eval=4, max_len=96, seconds=90.0),
         "real": dict(batch=32, steps=350, first=8, use=384, eval=19, max_len=None, seconds=90.0)}  # 11 200 sequences: 10x
RESUME_S = 20.0  # the resumed part's start-up (state, data, model) and its final evaluation on a GPU


def smollm2_shaped(device: str, dry: bool):
    """A random-weight target with SmolLM2-135M's shape (the corpus's vocabulary, so its token ids
    fit), bf16 on the GPU; narrower and shallower in the dry run (same vocabulary)."""
    from specdec.target import Target

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2) if dry else \
        dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)
    model = random_llama(device, torch.float32 if dry else torch.bfloat16, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, **shape)
    return Target(model)


def timed_train(cfg, target) -> tuple[Any, float, str]:
    """One ``train`` call: its record and the seconds of its training loop alone, from the part the
    trainer records (its loop less its held-out evaluations: start-up and evaluation left out)."""
    from specdec.training.trainer import train

    result = train(cfg, target=target)
    part = result.part
    return result.record, part["loop_seconds"] - part["eval_seconds"] - part["profile_seconds"], \
        "the training loop alone (start-up, evaluation and the profiled step excluded)"


def bench_train(device: str, dry: bool, budget: Budget, attention: str | None = None) -> dict[str, Any]:
    """The EAGLE-3 recipe (experiments/conf/train/smollm2_eagle3.yaml, with learning_curves.py's
    options) through the one trainer on the committed corpus at 10x the CPU recipe's sequences,
    target features computed per batch on the device. Timed in two parts with the trainer's own
    stop-and-resume: the first ``first`` steps (allocator, kernel selection), then as many of the
    rest as fit, at the rate of the first part's training loop (start-up and held-out evaluation
    left out, as the trainer records each part), in the section's ``seconds`` (90) and the run's
    budget, whichever ends first. ``attention``: the TTT attention (``Eagle3Options.attention``: split,
    sdpa or flex) instead of the recipe's."""
    import tempfile

    import yaml  # a dependency of transformers

    from benchmarks.learning_curves import OPTIONS  # noqa: E402  (experiments/ is on the path)
    from specdec.training.config import DataConfig, OptimConfig, TrainConfig

    t0, t = now(), TRAIN["dry" if dry else "real"]
    recipe = yaml.safe_load((ROOT / "experiments" / "conf" / "train" / "smollm2_eagle3.yaml").read_text())
    options = {**recipe["options"], **{o.split("=")[0].removeprefix("options."): int(o.split("=")[1])
                                       for o in OPTIONS["eagle3"]}}
    if dry:
        options.update(draft_vocab=64)
    if attention:
        options.update(attention=attention)
    target = smollm2_shaped(device, dry)
    with tempfile.TemporaryDirectory() as tmp:
        def config(stop_after: int | None, resume: bool, profile_step: int = 0) -> TrainConfig:
            optim = {k: v for k, v in recipe["optim"].items()}
            optim.update(batch=t["batch"], steps=t["steps"], stop_after=stop_after, bf16=not dry)
            data = DataConfig(source="corpus", path=str(CORPUS), use=t["use"], max_prompt=64, max_len=t["max_len"],
                              cache_features=False, feature_dtype="float32" if dry else "bfloat16")
            return TrainConfig(recipe=recipe["recipe"], options=options, target=None, data=data,
                               optim=OptimConfig(**optim), out=f"{tmp}/out", work=f"{tmp}/work", seed=0,
                               threads=1 if dry else min(8, os.cpu_count() or 1), resume=resume, log_every=10,
                               eval_sequences=t["eval"], progress=False, profile_step=profile_step)

        # the first part's last step runs under torch.profiler (left out of its rate): one warm step's operators
        first, first_s, what = timed_train(config(t["first"], False, profile_step=t["first"]), target)
        profile = (Path(tmp) / "work" / f"profile-step{t['first']}.txt").read_text()
        parts = [{"steps": t["first"], "seconds": first_s, "tokens": first.tokens,
                  "response_tokens": first.response_tokens, "positions": first.positions, "what": what}]
        record, rest = first, t["steps"] - t["first"]
        left = min(t["seconds"] - (now() - t0), budget.seconds - budget.elapsed()) - RESUME_S
        extra = min(rest, int(left / (first_s / t["first"]))) if first_s > 0 else rest
        if extra >= 1 and budget.allows(f"train: {extra} more steps", first_s / t["first"] * extra + RESUME_S):
            stop = None if t["first"] + extra == t["steps"] else t["first"] + extra
            record, rest_s, what = timed_train(config(stop, True), target)
            parts.append({"steps": extra, "seconds": rest_s, "tokens": record.tokens - first.tokens,
                          "response_tokens": record.response_tokens - first.response_tokens,
                          "positions": record.positions - first.positions, "what": what})
        trained = sum(part["steps"] for part in parts)
        if trained < t["steps"]:
            budget.skipped.append({"what": f"train: steps {trained + 1}-{t['steps']} (beyond the section's "
                                           f"{t['seconds']:.0f} s)", "estimate_s": round(first_s / t["first"] * (t["steps"] - trained), 1),
                                   "elapsed_s": round(budget.elapsed(), 1)})
    steady = parts[-1]
    losses = [e["loss"] for e in record.log if "loss" in e]
    return {"label": TRAIN_LABEL, "recipe": recipe["recipe"], "options": options,
            "target": "tiny SmolLM2-vocabulary llama (dry run)" if dry else "SmolLM2-135M shape, random bf16 weights",
            "data": f"{CORPUS.relative_to(ROOT)}, prompts cut to 64 tokens, target features per batch on the device",
            "batch": t["batch"], "steps": record.steps, "sequences": record.steps * t["batch"],
            "cpu_recipe_sequences": CPU_SEQUENCES, "data_ratio": record.steps * t["batch"] / CPU_SEQUENCES,
            "tokens": record.tokens, "response_tokens": record.response_tokens, "parts": parts,
            "tokens_per_s": steady["tokens"] / steady["seconds"],
            "response_tokens_per_s": steady["response_tokens"] / steady["seconds"],
            "positions": record.positions, "positions_per_token": record.positions_per_token,
            "positions_per_s": steady["positions"] / steady["seconds"], "rate_from": steady["what"],
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "profile": profile}


# ------------------------------------------------------------------------------------------------
# writing

def _f(x: Any, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec) if isinstance(x, float) else str(x)


def _exact(row: dict[str, Any]) -> str:
    """The exact column: True, or the first differing element with the reference's value there."""
    return describe_difference(row["first_difference"]).replace("|", "/") if "exact" in row else "–"


def _auto(row: dict[str, Any]) -> str:
    return f"{row['auto']} ({row['auto_why']})" if "auto" in row else "–"


def _bucket(shape: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items()).replace("|", "/")


def markdown(results: dict[str, Any], env: dict[str, Any]) -> str:
    out = [f"# GPU kit results: {env['gpu']}", "",
           f"{env['date']}; torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}"
           f"{'; driver ' + str(env.get('driver')) if env.get('driver') else ''}.", ""]
    if "kernels" in results:
        kr = results["kernels"]
        out += ["## Kernels against their torch references", "",
                f"Triton path: {kr['path']}. Copy bandwidth (device-to-device `copy_`, read + write): "
                f"{kr['copy_bandwidth_GBps']:.1f} GB/s; % columns are bytes moved / time against it.", "",
                "`auto`: the path the dispatcher takes in that case (`specdec.kernels.choice`: the faster,"
                " measured once per shape bucket on this GPU, or read from the cache of an earlier run).", "",
                "| kernel | shape | torch ms | torch % bw | triton ms | triton % bw | speedup | exact | auto |",
                "|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['kernel']} | {r['shape']} | {_f(r['torch_ms'], '.3f')} | {_f(r['torch_pct_copy_bw'], '.1f')} "
                f"| {_f(r.get('triton_ms'), '.3f')} | {_f(r.get('triton_pct_copy_bw'), '.1f')} "
                f"| {_f(r.get('speedup'))} | {_exact(r)} | {_auto(r)} |" for r in kr["rows"]]
        out += [f"| {r['kernel']} | {r['shape']} | failed: `{r['error'].splitlines()[0][:200].replace('|', '/')}` "
                "| | | | | | |" for r in kr.get("errors", [])]
        out += ["", f"Autotune winners: `{json.dumps(kr['autotune']) if kr['autotune'] else 'none (not tuned)'}`", ""]
    if "forward" in results:
        fr = results["forward"]
        out += ["## One target forward over m new tokens", "", f"{fr['model']}, {fr['dtype']}.", "",
                "| batch | context | m | ms | t(m)/t(1) | captured ms | captured t(m)/t(1) |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {r['batch']} | {r['context']} | {r['m']} | {r['ms']:.2f} | {r['t_over_t1']:.2f} "
                f"| {_f(r.get('ms_captured'))} | {_f(r.get('t_over_t1_captured'))} |" for r in fr["rows"]]
        if "captured" in fr:
            cf = fr["captured"]
            out += ["", f"Captured: `capture=\"graphs\"` resolved to `{cf['mode']}`, {cf['recordings']} recordings;"
                        f" host syncs in a captured step: {cf['host_syncs_in_a_step']}."]
        out.append("")
    if "planted" in results:
        pr = results["planted"]
        out += [f"## Planted-acceptance drafter ({pr['label']})", "",
                f"p = {pr['p']} per position, on the forward section's target; greedy; prompts of "
                f"{pr['prompt_tokens']} tokens. Each concurrency: one autoregressive run, the planted drafter at"
                " k drafts a step, and the same drafter under the batch-aware prefix scheduler"
                " (`specdec.policy.PrefixPolicy`: confidences = the planted p, costs = the measured"
                " verify times of a [concurrency, m] block and the planted run's draft time).", ""]
        out += _spec_table(pr["rows"], lead="scheduler")
        if pr.get("captured_rows"):
            out += ["Captured steps (every target step after the prefill replayed; no scheduler): the same"
                    " requests, autoregressive and planted, both captured.", ""]
            out += _spec_table(pr["captured_rows"], lead="capture")
            out += ["| concurrency | identical to eager AR | captured AR speedup over eager AR |", "|---|---|---|"]
            out += [f"| {r['concurrency']} | {r['identical_to_eager']} | {r['ar_speedup_over_eager']:.2f} |"
                    for r in pr["captured_rows"]] + [""]
    if "mtp" in results:
        mr = results["mtp"]
        out += ["## Real acceptance: tiny DeepSeek-V3 with its MTP modules", "",
                f"`{mr['checkpoint']}`, {mr['prompts']}; greedy.", ""]
        out += _spec_table(mr["rows"], lead="dtype")
    if "train" in results:
        tr = results["train"]
        out += [f"## Training throughput: EAGLE-3 recipe ({tr['label']})", "",
                f"`{tr['recipe']}` through the one trainer, options {json.dumps(tr['options'])}; {tr['target']};"
                f" data: {tr['data']}. {tr['steps']} steps of {tr['batch']} sequences = {tr['sequences']} sequences,"
                f" {tr['data_ratio']:.3g}x the CPU recipe's {tr['cpu_recipe_sequences']}. The target's weights are"
                " random, so the loss and acceptance measure nothing about drafting quality.", "",
                f"Trained positions: loss positions at draft depth 1 (every response position with a label), "
                f"{_f(tr['positions_per_token'], '.3f')} per target token.", "",
                "| part | steps | seconds | tokens | target tokens/s | response tokens/s | trained positions/s | timed |",
                "|---|---|---|---|---|---|---|---|"]
        out += [f"| {i + 1} | {p['steps']} | {p['seconds']:.1f} | {p['tokens']} | {p['tokens'] / p['seconds']:.0f} "
                f"| {p['response_tokens'] / p['seconds']:.0f} | {p['positions'] / p['seconds']:.0f} | {p['what']} |"
                for i, p in enumerate(tr["parts"])]
        if tr.get("profile"):
            out += ["", f"One warm step (step {tr['parts'][0]['steps']}) under `torch.profiler`, operators by self time"
                        " (`specdec.training.profile`):", "", "```", tr["profile"].rstrip(), "```"]
        out.append("")
    if results.get("kernel_choices"):
        out += ["## The path each kernel took (all sections)", "",
                "| kernel | bucket | path | source | triton ms | torch ms |", "|---|---|---|---|---|---|"]
        out += [f"| {c['kernel']} | {_bucket(c['shape'])} | {c['backend']} | {c['source']} | {_f(c['triton_ms'], '.3f')} "
                f"| {_f(c['torch_ms'], '.3f')} |" for c in results["kernel_choices"]]
        out.append("")
    if results["errors"]:
        out += ["## Errors", ""] + [f"- {name}: `{e['error']}`" for name, e in results["errors"].items()] + [""]
    if results["skipped"]:
        out += ["## Skipped for time", ""] + [f"- {s['what']} (at {s['elapsed_s']} s)" for s in results["skipped"]] + [""]
    return "\n".join(out)


def _spec_table(rows: list[dict], lead: str) -> list[str]:
    head = f"| {lead} | concurrency | k | identical to AR | mean accepted length | drafts verified / step " \
        "| acceptance per position | measured speedup | decode speedup | predicted speedup | measured / predicted |"
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        acc = ", ".join(_f(a) for a in r["acceptance_given_reached"])
        lines.append(f"| {r[lead]} | {r['concurrency']} | {r['k']} | {r['identical']} | {r['mean_accepted_length']:.2f} "
                     f"| {r['drafts_verified_per_step']:.2f} | {acc} | {r['speedup']:.2f} | {r['decode_speedup']:.2f} "
                     f"| {r['predicted_speedup']:.2f} | {_f(r.get('measured_over_predicted'))} |")
    return lines + [""]


def figures(results: dict[str, Any], out: Path) -> list[str]:
    """kernels.png, forward.png, planted.png (those whose section ran); none without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    rows = results.get("kernels", {}).get("rows", [])
    if rows:
        fig, ax = plt.subplots(figsize=(max(6, 0.18 * len(rows)), 4))
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["torch_pct_copy_bw"] for r in rows], 0.4, label="torch reference")
        if "triton_pct_copy_bw" in rows[0]:
            ax.bar([i + 0.2 for i in x], [r["triton_pct_copy_bw"] for r in rows], 0.4, label="triton")
        ax.set_xticks(list(x), [f"{r['kernel']} {r['shape']}" for r in rows], rotation=90, fontsize=5)
        ax.set_ylabel("% of device-to-device copy bandwidth")
        ax.legend()
        made.append(_save(fig, out / "kernels.png"))
    rows = results.get("forward", {}).get("rows", [])
    if rows:
        fig, ax = plt.subplots(figsize=(5, 4))
        for B in sorted({r["batch"] for r in rows}):
            pts = [r for r in rows if r["batch"] == B]
            ax.plot([r["m"] for r in pts], [r["t_over_t1"] for r in pts], "o-", label=f"batch {B}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("new tokens per forward, m")
        ax.set_ylabel("t(m) / t(1)")
        ax.legend()
        made.append(_save(fig, out / "forward.png"))
    rows = results.get("planted", {}).get("rows", [])
    if rows:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        for i, sched in enumerate((False, True)):
            pts = [r for r in rows if r["scheduler"] == sched]
            c, name = [r["concurrency"] for r in pts], "with the scheduler" if sched else "k drafts every step"
            ax.plot(c, [r["speedup"] for r in pts], "o-", color=f"C{i}", label=f"measured, {name}")
            ax.plot(c, [r["predicted_speedup"] for r in pts], "^--", color=f"C{i}", markerfacecolor="none",
                    markersize=9, label=f"predicted, {name}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        cs = sorted({r["concurrency"] for r in rows})
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylabel("speedup over autoregressive")
        ax.set_title(PLANTED_LABEL, fontsize=8)
        ax.legend(fontsize=7)
        made.append(_save(fig, out / "planted.png"))
    return made


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


def kit(out: str, dry_run: bool = False, budget_s: float = 360.0, sections: str = "kernels,forward,planted,mtp,train",
        p: float = 0.8, k: int = 4, train_attention: str | None = None) -> None:
    """Mode ``gpu`` (the kit): each section named in ``sections`` into ``out``, within ``budget_s``
    counted from process start; ``dry_run``: CPU, tiny shapes, Triton's interpreter; ``p`` and ``k``:
    the planted run's acceptance per position and draft length; ``train_attention``: the training
    section's TTT attention (split, sdpa, flex) instead of the recipe's."""
    out = Path(out)
    if not dry_run and not torch.cuda.is_available():
        sys.exit("no GPU visible to torch: pass --dry-run for the CPU run")
    device = "cpu" if dry_run else "cuda"
    if dry_run:
        torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    budget, sections = Budget(budget_s, STARTED), sections.split(",")
    env = environment(device)
    (out / "env.json").write_text(json.dumps(env, indent=1, default=str))
    results: dict[str, Any] = {"dry_run": dry_run, "budget_s": budget_s, "skipped": budget.skipped,
                               "errors": {}, "section_s": {}}

    def write() -> None:
        """After every section: a machine lost halfway still leaves what it measured (results.json
        first, and whatever the tables fail on, they do not cost it)."""
        results["wall_s"] = round(budget.elapsed(), 2)
        results["kernel_choices"] = choice.record()  # every path auto chose on this GPU, every section
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        try:
            md = markdown(results, env)
        except Exception as e:  # noqa: BLE001
            md = f"# GPU kit results\n\nThe tables failed ({type(e).__name__}: {e}); results.json holds everything.\n"
        (out / "results.md").write_text(md)

    def section(name: str, fn: Callable[[], dict], wanted: bool | None = None) -> None:
        """Run one section (``wanted``: whether to, by default whether ``--sections`` names it); an
        error is recorded (and printed) and the next section still runs."""
        if not (name in sections if wanted is None else wanted):
            return
        t0 = now()
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001  (minutes on a lent GPU: one broken section must not cost the rest)
            results["errors"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            print(results["errors"][name]["traceback"], file=sys.stderr)
        results["section_s"][name] = round(now() - t0, 2)
        print(f"{name}: {results['section_s'][name]} s")
        write()

    section("kernels", lambda: bench_kernels(device, dry_run, budget))
    if results.get("kernels", {}).get("errors"):  # the table keeps the other cases; the run still fails
        results["errors"]["kernels"] = {"error": f"{len(results['kernels']['errors'])} case(s) failed: "
                                                 "kernels.errors in results.json"}
        write()
    on_target = [name for name in ("forward", "planted") if name in sections]
    target = None

    def make_target() -> dict[str, Any]:
        nonlocal target
        target = build_target(device, dry_run)
        return {"parameters": sum(p.numel() for p in target.model.parameters()),
                "dtype": str(target.dtype).removeprefix("torch.")}

    if on_target and budget.allows("forward + planted: the target", 1.0 if dry_run else 30.0):
        section("target", make_target, wanted=True)
        if target is None:  # its error is recorded under "target"; say why these did not run
            for name in on_target:
                results["errors"][name] = {"error": "not run: the target could not be built (see the target error)"}
            write()
        else:
            section("forward", lambda: bench_forward(target, device, dry_run, budget))
            section("planted", lambda: bench_planted(target, device, dry_run, budget, p, k,
                                                     results.get("forward", {}).get("rows", [])))
            target = None
            if device == "cuda":
                torch.cuda.empty_cache()
    section("mtp", lambda: native_mtp(device, dry_run, budget))
    if "train" in sections and budget.allows("train", 15.0 if dry_run else TRAIN["real"]["seconds"]):
        section("train", lambda: bench_train(device, dry_run, budget, train_attention))
    try:
        results["figures"] = figures(results, out)
    except Exception as e:  # noqa: BLE001  (the figures are a convenience: the results are written anyway)
        results["figures"] = []
        results["errors"]["figures"] = {"error": f"{type(e).__name__}: {e}",
                                        "traceback": traceback.format_exc()[-4000:]}
    write()
    print(f"wrote {out} in {results['wall_s']} s")
    if results["errors"]:
        sys.exit(f"errors in: {', '.join(results['errors'])} (results.md lists them)")


def main() -> None:
    """The kit on a bare GPU machine (no Hydra there): ``PYTHONPATH=experiments python -m benchmarks.gpu --out <folder>``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for env.json, results.json, results.md, figures")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton's interpreter")
    ap.add_argument("--budget-s", type=float, default=360.0,
                    help="skip what would not fit in this many seconds, counted from process start")
    ap.add_argument("--sections", default="kernels,forward,planted,mtp,train")
    ap.add_argument("--p", type=float, default=0.8, help="planted acceptance per position")
    ap.add_argument("--k", type=int, default=4, help="draft length of the planted run")
    ap.add_argument("--train-attention", choices=("split", "sdpa", "flex"),
                    help="the training section's TTT attention (default: the recipe's)")
    args = ap.parse_args()
    kit(args.out, args.dry_run, args.budget_s, args.sections, args.p, args.k, args.train_attention)


if __name__ == "__main__":
    main()

"""Compile every Triton kernel of ``specdec.kernels`` for real GPU targets, with no GPU present.

Triton compiles ahead of time to a target given by name: NVIDIA sm_90 (cubin), AMD gfx942
(MI300X) and gfx950 (MI355X) (hsaco). Each kernel variant is compiled with every autotune
configuration of its platform (``specdec/kernels/tuning.py``), so a kernel that only the
interpreter has run is at least known to type-check, lower and assemble for the GPUs it is tuned
for, with the AMD knobs (``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``) accepted by the
HIP backend. Nothing is executed. Run from anywhere but the repository root:

    .venv/bin/python experiments/run.py --config-name lab/compile_kernels                  # everything (a few minutes)
    .venv/bin/python experiments/run.py --config-name lab/compile_kernels quick=true       # one config and the widest variant
"""

from __future__ import annotations

import itertools
import os
import sys

# the interpreter has no compiler: leave it before triton is imported (a process that imported triton
# already keeps the mode it chose, and its environment is left alone for everything else it runs)
if "triton" not in sys.modules:
    os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from specdec.kernels.compaction_triton import _gather_kernel  # noqa: E402
from specdec.kernels.markov_triton import _markov_kernel  # noqa: E402
from specdec.kernels.norm_concat_linear_triton import _norm_concat_linear_kernel  # noqa: E402
from specdec.kernels.rejection_triton import _rejection_kernel  # noqa: E402
from specdec.kernels.tuning import fits_markov_tile, gemm_configs, markov_configs, row_configs  # noqa: E402
from specdec.timing import now  # noqa: E402

TARGETS = {"cuda": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64),
           "gfx950": GPUTarget("hip", "gfx950", 64)}
OPTION_KEYS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack", "enable_fp_fusion")  # compile options, not constexprs
F32, I64 = "*fp32", "*i64"


def _variants(flags: tuple[str, ...], quick: bool) -> list[dict[str, bool]]:
    combos = [dict(zip(flags, values)) for values in itertools.product((False, True), repeat=len(flags))]
    return combos[-1:] if quick else combos


def kernels(arch: str, quick: bool):
    """(name, jit function, pointer types, constexprs, tuning configs) for every variant."""
    rows = row_configs(arch)[:1] if quick else row_configs(arch)
    gemms = gemm_configs(arch)[:1] if quick else gemm_configs(arch)
    markovs = fits_markov_tile(markov_configs(arch), {"R": 64})  # what the autotuner keeps at rank 64
    markovs = markovs[:1] if quick else markovs
    rej_types = {**dict.fromkeys(("src_ptr", "temp_ptr", "q_ptr", "u_ptr", "noise_ptr", "scratch_ptr"), F32),
                 **dict.fromkeys(("tokens_ptr", "parents_ptr", "num_valid_ptr", "path_ptr", "out_ptr", "acc_ptr"), I64)}
    for v in _variants(("FROM_LOGITS", "HAS_Q", "HAS_NOISE"), quick):
        yield "rejection", _rejection_kernel, rej_types, {**v, "N_POW2": 16}, rows
    mk_types = {"U_ptr": F32, "x0_ptr": I64, "W1_ptr": F32, "W2_ptr": F32, "temp_ptr": F32, "u_ptr": "*fp64",
                "tokens_ptr": I64, "q_ptr": F32}
    for v in _variants(("WRITE_Q",), quick):
        yield "markov", _markov_kernel, mk_types, {**v, "R_POW2": 64}, markovs
    for dt in (("*bf16",) if quick else ("*bf16", "*fp16", "*fp32")):
        types = {**dict.fromkeys(("x0_ptr", "x1_ptr", "x2_ptr", "w0_ptr", "w1_ptr", "w2_ptr", "w_ptr", "bias_ptr",
                                  "out_ptr"), dt), **dict.fromkeys(("r0_ptr", "r1_ptr", "r2_ptr"), F32)}
        for n_in, norms, bias in ((2, (True, True, False), False), (3, (False, False, False), True)):
            yield (f"norm_concat_linear[{dt[1:]}]", _norm_concat_linear_kernel, types,
                   dict(NUM_INPUTS=n_in, NORM0=norms[0], NORM1=norms[1], NORM2=norms[2], HAS_BIAS=bias,
                        IEEE=dt == F32), gemms)
    gather_types = {"x_ptr": "*bf16", "order_ptr": I64, "out_ptr": "*bf16", **dict.fromkeys(("sxb", "sxh", "sxs",
                                                                                             "sxd"), "i64")}
    yield "gather_slots", _gather_kernel, gather_types, {}, [triton.Config({"BLOCK_S": 16, "BLOCK_D": 128})]


def compile_one(fn, types: dict[str, str], constexprs: dict, config: triton.Config, target: GPUTarget):
    consts = {**constexprs, **{k: v for k, v in config.kwargs.items() if k not in OPTION_KEYS}}
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages,
               **{k: v for k, v in config.kwargs.items() if k in OPTION_KEYS}}
    signature = {name: "constexpr" if name in consts else types.get(name, "i32") for name in fn.arg_names}
    src = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=target, options=options)


def compile_all(targets: list[str] | None = None, quick: bool = False) -> None:
    """Mode ``compile_kernels``: every kernel for each of ``targets`` (default: all); ``quick``: one
    config and the widest variant per kernel. Every failure is printed, then the job fails."""
    unknown = sorted(set(targets or []) - set(TARGETS))
    if unknown:
        raise SystemExit(f"unknown targets {unknown}: {sorted(TARGETS)}")
    print(f"triton {triton.__version__}; compiling, not running (no GPU is needed)")
    failures = 0
    for arch in targets or list(TARGETS):
        t0, count = now(), 0
        for name, fn, types, constexprs, configs in kernels(arch, quick):
            for config in configs:
                try:
                    binary = compile_one(fn, types, constexprs, config, TARGETS[arch])
                    count += 1
                    assert ("hsaco" if arch.startswith("gfx") else "cubin") in binary.asm
                except Exception as e:  # report every failure, then fail
                    failures += 1
                    print(f"FAIL {arch} {name} {constexprs} {config}: {e!r}"[:2000], flush=True)
        print(f"{arch}: {count} kernel binaries in {now() - t0:.0f} s", flush=True)
    print("all compiled" if not failures else f"{failures} failed")
    if failures:
        raise SystemExit(f"{failures} kernel binaries failed to compile")

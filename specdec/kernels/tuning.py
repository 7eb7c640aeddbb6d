"""Autotune configurations per platform; imported only by the Triton paths (needs ``triton``).

Two kernel shapes live here. *Row kernels* (rejection sampler, Markov sampler, KV compaction)
stream one row of the vocabulary or of the cache per program: only the block width and the
number of warps matter, and a deep software pipeline buys nothing for a loop whose body is a
reduction. The *GEMM* (the fused draft input) is a classic tiled matmul. The Markov sampler is a
row kernel with a ``[BLOCK, R]`` tile (the low-rank bias), so it has its own, narrower blocks:
with the row kernels' (1024–8192) at ``R = 64`` it spilled and took up to 90 s a config to compile
for sm_90.

AMD (ROCm's "Optimizing Triton kernels" guide, MI300X): a wavefront has 64 lanes, so
``num_warps=4`` is already 256 threads; ``num_stages=2`` turns on the stream pipeliner for loops
with a ``tl.dot`` and ``1`` is right for kernels without one; ``waves_per_eu`` caps occupancy so
that the register file is not spilled (0 = let the compiler pick); ``matrix_instr_nonkdim=16``
selects the 16×16 MFMA instructions, better than 32×32 for the skinny M of decode; ``kpack=2``
widens LDS loads on gfx942. gfx950 (MI355X) has 160 KB of LDS per CU against gfx942's 64 KB, so
it gets larger K tiles; its compiler ignores ``kpack``, which is left at 1 there.
The AMD knobs go in the config's dict, where the HIP backend reads them as compile options.
NVIDIA: ``num_warps`` 4–8 and ``num_stages`` 3–4 (cp.async pipelining on sm80+).

Under ``TRITON_INTERPRET=1`` every launcher bypasses autotuning (it would time each config in
the interpreter) and uses the single small config its tests pass.
"""

from __future__ import annotations

import triton

from specdec.kernels.dispatch import platform

__all__ = ["row_configs", "markov_configs", "fits_markov_tile", "gemm_configs", "describe"]


# The row kernels make decisions (accept, argmax) on float32 values the torch reference computes
# with separate multiplies and adds; a contracted a·b + c rounds once instead of twice. They are
# memory-bound, so exact rounding costs nothing measurable.
_NO_FMA = {"enable_fp_fusion": False}


def row_configs(arch: str | None = None) -> list[triton.Config]:
    """Block widths and warps for the one-program-per-row streaming kernels (``arch``: a
    :func:`~specdec.kernels.dispatch.platform` name; GPU 0's by default)."""
    arch = arch or platform()
    if arch.startswith("gfx"):
        return [triton.Config({"BLOCK": b, "waves_per_eu": e, **_NO_FMA}, num_warps=w, num_stages=1)
                for b, w, e in ((1024, 4, 0), (2048, 8, 0), (4096, 8, 2), (8192, 16, 1))]
    return [triton.Config({"BLOCK": b, **_NO_FMA}, num_warps=w, num_stages=1)
            for b, w in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 16))]


# Elements of the Markov sampler's [BLOCK, R_POW2] float32 tile held in registers; past this the
# compiler spills (and compiles for minutes).
MARKOV_TILE = 16 * 1024


def markov_configs(arch: str | None = None) -> list[triton.Config]:
    """Block widths for the Markov sampler: 128–512, pruned per rank by :func:`fits_markov_tile`."""
    arch = arch or platform()
    if arch.startswith("gfx"):
        return [triton.Config({"BLOCK": b, "waves_per_eu": e, **_NO_FMA}, num_warps=w, num_stages=1)
                for b, w, e in ((128, 2, 0), (256, 4, 0), (512, 8, 0))]
    return [triton.Config({"BLOCK": b, **_NO_FMA}, num_warps=w, num_stages=1)
            for b, w in ((128, 4), (256, 4), (256, 8), (512, 8))]


def fits_markov_tile(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    """``early_config_prune`` for the Markov sampler: the configs whose ``[BLOCK, next_pow2(R)]``
    tile fits :data:`MARKOV_TILE` (the narrowest when none does). Reads ``R``, a positional
    argument, so it works whatever Triton passes in ``kwargs``."""
    r_pow2 = triton.next_power_of_2(int(named_args["R"]))
    fit = [c for c in configs if c.kwargs["BLOCK"] * r_pow2 <= MARKOV_TILE]
    return fit or [min(configs, key=lambda c: c.kwargs["BLOCK"])]


def gemm_configs(arch: str | None = None) -> list[triton.Config]:
    """Tiles for the fused draft-input GEMM (M = draft tokens, small; N, K = hidden sizes)."""
    arch = arch or platform()
    if arch.startswith("gfx"):  # gfx942, gfx950; other CDNA archs take the gfx942 table
        big_lds = arch == "gfx950"
        kpack = 1 if big_lds else 2
        tiles = [(16, 64, 256 if big_lds else 128), (32, 64, 128), (64, 128, 64), (128, 128, 64)]
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "waves_per_eu": 2,
                               "matrix_instr_nonkdim": 16, "kpack": kpack}, num_warps=4, num_stages=2)
                for m, n, k in tiles]
    tiles = [(16, 64, 128, 4, 4), (32, 64, 64, 4, 4), (64, 128, 64, 8, 3), (128, 128, 32, 8, 3)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
            for m, n, k, w, s in tiles]


def describe(kernel: object) -> str:
    """The autotune winner of a ``triton.autotune`` kernel, for benchmark reports."""
    best = getattr(kernel, "best_config", None)
    return str(best) if best is not None else "not tuned yet"

"""The draft input of MTP and EAGLE-3: ``Linear(cat[rmsnorm(a)·w_a, rmsnorm(b)·w_b, ...])``.

MTP feeds ``eh_proj(cat[enorm(emb), hnorm(h)])``; EAGLE-3 feeds ``fc(cat[f_low, f_mid, f_high])``
(no norms) and projects ``cat[input_layernorm(emb), hidden_norm(g)]`` to q/k/v. The Triton path
multiplies the weight's column blocks by each normalised input in turn, so neither the
normalised inputs nor their ``[M, ΣD]`` concatenation is ever written to memory; only one
float32 reciprocal RMS per row and input (``[M]``) is computed beforehand.

RMSNorm here is the Llama form every DeepSeek-V3 / Llama / Qwen norm uses:
``w · (x₃₂ · rsqrt(mean(x₃₂²) + eps)).to(x.dtype)``. Gemma's ``(1 + w)`` form equals it with
``w_eff = 1 + w`` in float32 models and differs by one rounding in bf16; callers with such norms
pass ``w_eff`` or keep their modules (see :func:`rms_norm_params`).

Shapes: inputs ``[..., D_i]``; ``weight [N, ΣD_i]`` (an ``nn.Linear`` weight); output ``[..., N]``.
Tolerance of the Triton path against the reference: float32 accumulation in a different order,
so ``atol = rtol = 1e-4`` in float32 and ``2e-2`` in bf16 (tests: ``tests/test_kernels.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.kernels import choice
from specdec.kernels.choice import pow2

__all__ = ["fused_norm_concat_linear", "norm_concat_linear", "norm_concat_linear_reference",
           "rms_norm_reference", "rms_norm_params"]


def rms_norm_reference(x: Tensor, w: Tensor | None, eps: float) -> Tensor:
    """Llama-form RMSNorm, bit-identical to ``LlamaRMSNorm``; ``w is None`` means no norm."""
    if w is None:
        return x
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def norm_concat_linear_reference(xs: Sequence[Tensor], norm_weights: Sequence[Tensor | None], weight: Tensor,
                                 eps: float = 1e-6, bias: Tensor | None = None) -> Tensor:
    """The specification: normalise, concatenate, project (the concatenation is materialised)."""
    parts = [rms_norm_reference(x, w, eps) for x, w in zip(xs, norm_weights, strict=True)]
    return F.linear(torch.cat(parts, dim=-1), weight, bias)


def _check(xs: Sequence[Tensor], norm_weights: Sequence[Tensor | None], weight: Tensor) -> None:
    if not 1 <= len(xs) <= 3 or len(norm_weights) != len(xs):
        raise ValueError(f"1 to 3 inputs with one norm weight (or None) each, got {len(xs)} and {len(norm_weights)}")
    lead = xs[0].shape[:-1]
    for i, (x, w) in enumerate(zip(xs, norm_weights)):
        if x.shape[:-1] != lead:
            raise ValueError(f"input {i} has leading shape {tuple(x.shape[:-1])}, input 0 has {tuple(lead)}")
        if w is not None and w.shape != (x.shape[-1],):
            raise ValueError(f"norm weight {i} has shape {tuple(w.shape)}, expected ({x.shape[-1]},)")
    width = sum(x.shape[-1] for x in xs)
    if weight.dim() != 2 or weight.shape[1] != width:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not take the concatenated width {width}")


def norm_concat_linear(xs: Sequence[Tensor], norm_weights: Sequence[Tensor | None], weight: Tensor,
                       eps: float = 1e-6, bias: Tensor | None = None) -> Tensor:
    """``Linear(cat[rmsnorm(x_i)·w_i])`` for 1–3 inputs, each norm optional (``None``)."""
    _check(xs, norm_weights, weight)
    # the Triton kernel has no backward: anything autograd tracks (training) takes the reference
    tracked = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*xs, *norm_weights, weight))
    if tracked:
        return norm_concat_linear_reference(xs, norm_weights, weight, eps, bias)

    def fused() -> Tensor:
        from specdec.kernels.norm_concat_linear_triton import norm_concat_linear_triton

        return norm_concat_linear_triton(xs, norm_weights, weight, eps, bias)

    rows = xs[0].numel() // max(xs[0].shape[-1], 1)
    shape = {"M": min(pow2(rows), 256), "widths": [x.shape[-1] for x in xs], "N": weight.shape[0],
             "norms": [w is not None for w in norm_weights], "bias": bias is not None,
             "dtype": str(weight.dtype).removeprefix("torch.")}
    return choice.call("norm_concat_linear", shape, (*xs, weight),
                       lambda: norm_concat_linear_reference(xs, norm_weights, weight, eps, bias), fused)


def fused_norm_concat_linear(a: Tensor, b: Tensor, w_a: Tensor | None, w_b: Tensor | None, weight: Tensor,
                             eps: float = 1e-6, bias: Tensor | None = None) -> Tensor:
    """``Linear(cat[rmsnorm(a)·w_a, rmsnorm(b)·w_b])``: the two-input draft input (MTP's
    ``eh_proj``, EAGLE-3's q/k/v over ``cat[emb, g]``); ``None`` skips that norm."""
    return norm_concat_linear([a, b], [w_a, w_b], weight, eps, bias)


def rms_norm_params(norm: nn.Module) -> tuple[Tensor, float] | None:
    """``(weight, eps)`` of a Llama-form RMSNorm module (``weight`` and ``variance_epsilon``, as
    Llama, Qwen and DeepSeek-V3 name them), or ``None`` for any other norm: the caller then keeps
    calling its module, so an unknown form is never silently changed."""
    w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not isinstance(w, Tensor) or eps is None or getattr(norm, "bias", None) is not None:
        return None
    return w, float(eps)

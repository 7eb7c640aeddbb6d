"""Rejection-sampler benchmark: the Triton kernel against its torch reference, same inputs.

For B ∈ {1, 8, 64}, k ∈ {3, 7, 15}, V ∈ {32k, 152k} (a chain; ``inputs`` picks warped probs with
dense q, raw logits + temperature, a deterministic draft, or greedy: the greedy verifier's call): median time of each and the
achieved bandwidth, counting the bytes of target scores and q (``B·(k+1)·V`` and ``B·k·V``
float32s) over the time. That is what the torch reference reads; the kernel reads less when
drafts are rejected early, so its figure is an effective bandwidth. Prints a markdown table and the
backend, GPU, arch and autotune winner that ran.

    .venv/bin/python experiments/run.py --config-name lab/kernels                  # on a GPU
    .venv/bin/python experiments/run.py --config-name lab/kernels smoke=true   # CPU, tiny shapes
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

import torch

from specdec.kernels import platform, rejection_sample, triton_available, use_backend
from specdec.kernels.dispatch import interpreting
from specdec.timing import measure
from specdec.types import chain_parents


def make_inputs(B: int, k: int, V: int, device: str, mode: str, seed: int = 0, tree: bool = False):
    """Positional arguments and keyword arguments of one rejection_sample call, and the bytes of
    target scores and q it must read at most. ``tree``: two children of the root, then two chains
    (parents ``[-1, -1, 0, 1, 2, 3, …]``), so a rejected first child leaves its sibling to test."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(B, k + 1, V, device=device, generator=g)
    q = (logits[:, 1:] + 0.5 * torch.randn(B, k, V, device=device, generator=g)).softmax(-1)
    tokens = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, k)
    u = torch.rand(B, k, device=device, generator=g)
    noise = torch.empty(B, V, device=device).exponential_(generator=g)
    if mode in ("deterministic", "greedy"):  # greedy: the greedy verifier's call, no q and no noise
        q = None
    if mode == "greedy":
        noise = None
    parents = (torch.arange(k, device=device) - 2).clamp(min=-1).expand(B, k).clone() if tree else chain_parents(k, B, device)
    args = (tokens, parents, torch.full((B,), k, device=device), u, noise, q)
    if mode in ("logits", "greedy"):
        kwargs = dict(logits=logits, temperature=torch.full((B,), 0.8 if mode == "logits" else 0.0, device=device))
    else:
        kwargs = dict(probs=logits.softmax(-1))
    return args, kwargs, (logits.numel() + (q.numel() if q is not None else 0)) * 4


def first_difference(ref: Any, out: Any, atol: float = 0.0, rtol: float = 0.0, where: str = "") -> dict | None:
    """Where a kernel's output first differs from its reference's: ``{"where": "tokens[23, 0]",
    "reference": 25961, "kernel": 12089}``, or None when they agree. Walks dicts, dataclasses (a
    :class:`~specdec.types.Verification`: path, num_accepted, tokens), tuples and tensors in order;
    floats agree within ``atol + rtol·|ref|`` (NaN equals NaN), everything else must be equal.
    Row-major order, so the first differing row of a batch is the one named."""
    if is_dataclass(ref) and not isinstance(ref, type):
        for f in fields(ref):
            d = first_difference(getattr(ref, f.name), getattr(out, f.name), atol, rtol, f"{where}.{f.name}".lstrip("."))
            if d:
                return d
        return None
    if isinstance(ref, dict):
        for key, a in ref.items():
            d = first_difference(a, out[key], atol, rtol, f"{where}.{key}".lstrip("."))
            if d:
                return d
        return None
    if isinstance(ref, (tuple, list)):
        for i, (a, b) in enumerate(zip(ref, out, strict=True)):
            d = first_difference(a, b, atol, rtol, f"{where}[{i}]")
            if d:
                return d
        return None
    if not torch.is_tensor(ref) or not torch.is_tensor(out):
        return None if ref is out or ref == out else {"where": where, "reference": repr(ref), "kernel": repr(out)}
    if ref.shape != out.shape:
        return {"where": f"{where} shape", "reference": list(ref.shape), "kernel": list(out.shape)}
    if ref.is_floating_point():
        bad = ~torch.isclose(out.float(), ref.float(), atol=atol, rtol=rtol, equal_nan=True)
    else:
        bad = out != ref
    hits = torch.nonzero(bad.reshape(-1))
    if not len(hits):
        return None
    index = [int(i) for i in torch.unravel_index(hits[0, 0].cpu(), ref.shape)]
    return {"where": f"{where}[{', '.join(map(str, index))}]", "reference": ref[tuple(index)].item(),
            "kernel": out[tuple(index)].item()}


def verification_difference(ref: Any, out: Any) -> dict | None:
    """:func:`first_difference` of two rejection-sampler verdicts, counts first, then tokens, then path."""
    pick = lambda v: {"num_accepted": v.num_accepted, "tokens": v.tokens, "path": v.path}  # noqa: E731
    return first_difference(pick(ref), pick(out))


def describe_difference(d: dict | None) -> str:
    """``True``, or ``False: tokens[23, 0] = 12089, reference 25961`` (a table cell)."""
    return "True" if d is None else f"False: {d['where']} = {d['kernel']}, reference {d['reference']}"


def timed(fn, repeats: int, device: str) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up (and autotuning)."""
    return measure(fn, repeats, warmup=1, device=device).median


def bench(smoke: bool = False, repeats: int = 20, inputs: str = "probs") -> None:
    """Mode ``kernels``: the rejection-sampler kernel against its torch reference; ``smoke``: tiny
    shapes on CPU in Triton's interpreter (checks it runs); ``inputs``: probs (warped probabilities and
    dense q), logits (raw logits + temperature), deterministic (q None) or greedy."""
    if inputs not in ("probs", "logits", "deterministic", "greedy"):
        raise SystemExit(f"inputs must be probs, logits, deterministic or greedy, got {inputs!r}")
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    if smoke:
        shapes, repeats = [(b, k, v) for b in (1, 2) for k in (1, 3) for v in (37,)], 1
    else:
        shapes = [(b, k, v) for b in (1, 8, 64) for k in (3, 7, 15) for v in (32_000, 152_064)]
    kernel = "triton" if triton_available() and (device == "cuda" or interpreting()) else None
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "none (CPU)"
    print(f"backend: kernel={kernel or 'unavailable'} vs torch reference; inputs={inputs}; device={device}; "
          f"GPU={gpu}; platform={platform()}; interpreter={interpreting()}; torch={torch.__version__}")
    print("\n| B | k | V | torch ms | torch GB/s | triton ms | triton GB/s | speed-up | exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for B, k, V in shapes:
        args, kw, nbytes = make_inputs(B, k, V, device, inputs)
        with use_backend("torch"):
            ref = rejection_sample(*args, **kw)
            t_ref = timed(lambda: rejection_sample(*args, **kw), repeats, device)
        row = f"| {B} | {k} | {V} | {t_ref * 1e3:.3f} | {nbytes / t_ref / 1e9:.1f} |"
        if kernel:
            with use_backend("triton"):
                ker = rejection_sample(*args, **kw)
                t_ker = timed(lambda: rejection_sample(*args, **kw), repeats, device)
            same = describe_difference(verification_difference(ref, ker))
            row += f" {t_ker * 1e3:.3f} | {nbytes / t_ker / 1e9:.1f} | {t_ref / t_ker:.2f}× | {same} |"
        else:
            row += " – | – | – | – |"
        print(row)
    if kernel and not interpreting():
        from specdec.kernels.rejection_triton import tuned_kernel
        from specdec.kernels.tuning import describe

        print(f"\nautotune winner (last shape): {describe(tuned_kernel())}")
    else:
        print("\nautotune: not run (interpreter or no kernel): one fixed small block")

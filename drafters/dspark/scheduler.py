"""The prefix scheduler: how many drafts of each request to verify this step (DSpark, Algorithm 1).

A drafter with calibrated per-position confidences ``c_{r,j}`` (the probability that draft ``j``
of request ``r`` is accepted given drafts ``< j`` were) knows each draft's survival probability
``a_{r,j} = Π_{i≤j} c_{r,i}``: the expected number of tokens a step emits is
``τ = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j})`` when ``ℓ_r`` drafts of request ``r`` are verified. What a step
costs depends on how many tokens the target verifies together. The scheduler maximises expected
tokens per second ``Θ = τ / (verify(n) + draft(R))`` greedily: all ``(r, j)`` sorted by ``a``
(highest first; survival falls along a row, so every row keeps a contiguous prefix), admitted one
by one while ``Θ`` does not decrease, stopping at the first decrease or at the token budget.

It is lossless: it only sets ``num_valid``, which shortens what the verifier checks. It is
batch-aware: one budget is shared, so a confident request gets drafts a doubtful one gives up.

Costs come from :class:`~specdec.policy.StepCosts`, a table profiled once on this machine
(:func:`profile_step_costs`, cached on disk) or passed in. This library's loop verifies a
rectangular block (rows padded to the longest), so by default a step costs
``verify(R · (1 + max ℓ))``; ``ragged=True`` prices ``Σ (1 + ℓ_r)`` tokens instead, as a
variable-length attention kernel would.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from specdec.policy import StepCosts  # the cost table every draft-length decision reads

__all__ = ["StepCosts", "schedule", "survival", "best_throughput", "profile_step_costs"]


def survival(conf: Tensor) -> Tensor:
    """Survival probabilities ``a_{r,j} = Π_{i≤j} c_{r,i}``. [R, γ] → [R, γ]"""
    return conf.double().clamp(0, 1).cumprod(-1)


def _step_tokens(lengths: list[int], ragged: bool) -> int:
    return sum(1 + x for x in lengths) if ragged else len(lengths) * (1 + max(lengths, default=0))


def schedule(conf: Tensor, costs: StepCosts, budget: int | None = None, ragged: bool = False,
             draft_cost: bool = True) -> Tensor:
    """Drafts to verify per request, ``num_valid`` [R] in ``[0, γ]``, from confidences [R, γ].

    ``budget`` caps the drafts verified in total this step (None: no cap beyond γ per row).
    ``draft_cost`` includes the (already paid) draft pass in the step time; it shifts Θ but is the
    same for every choice, so it changes only where Θ is compared across steps.
    """
    R, gamma = conf.shape
    a = survival(conf.cpu())
    lengths = [0] * R
    fixed = costs.draft(R) if draft_cost else 0.0
    tau = float(R)
    theta = tau / (costs.verify(_step_tokens(lengths, ragged)) + fixed)
    # highest survival first; ties by position so a row's prefix stays contiguous
    order = sorted(((-float(a[r, j]), j, r) for r in range(R) for j in range(gamma)))
    admitted = 0
    for neg_a, j, r in order:
        if budget is not None and admitted >= budget:
            break
        if j != lengths[r]:  # not the next draft of its row (cannot happen with sorted survival)
            continue
        lengths[r] += 1
        new_theta = (tau - neg_a) / (costs.verify(_step_tokens(lengths, ragged)) + fixed)
        if new_theta < theta:
            lengths[r] -= 1
            break
        tau, theta, admitted = tau - neg_a, new_theta, admitted + 1
    return torch.tensor(lengths, dtype=torch.long, device=conf.device)


def best_throughput(conf: Tensor, costs: StepCosts, budget: int | None = None, ragged: bool = False) -> tuple[float, float]:
    """Expected tokens/s of the scheduled step (draft pass included) and of a plain
    autoregressive step for the same rows: the scheduler's case for drafting at all."""
    lengths = schedule(conf, costs, budget, ragged).tolist()
    a = survival(conf.cpu())
    tau = len(lengths) + sum(float(a[r, :n].sum()) for r, n in enumerate(lengths))
    spec = tau / (costs.verify(_step_tokens(lengths, ragged)) + costs.draft(len(lengths)))
    ar = len(lengths) / costs.verify(len(lengths))
    return spec, ar


def profile_step_costs(verify_fn: Callable[[int, int], float], draft_fn: Callable[[int], float],
                       rows: tuple[int, ...] = (1, 4, 16, 32), widths: tuple[int, ...] = (1, 3, 9),
                       repeats: int = 3, cache: str | Path | None = None) -> StepCosts:
    """Measure on this machine, once: ``verify_fn(rows, width)`` returns the seconds of one target
    forward over a [rows, width] block, ``draft_fn(rows)`` those of one draft pass (each timing
    only that call). Medians of ``repeats`` after a warm-up; read from / written to ``cache`` (a
    JSON path) so start-up profiles once. Verify times are indexed by tokens in the block."""
    if cache is not None and Path(cache).exists():
        return StepCosts.load(cache)

    def median(fn: Callable[[], float]) -> float:
        fn()  # warm-up
        return sorted(fn() for _ in range(repeats))[repeats // 2]

    by_tokens: dict[int, list[float]] = {}
    for r in rows:
        for w in widths:
            by_tokens.setdefault(r * w, []).append(median(lambda: verify_fn(r, w)))
    draft = [median(lambda: draft_fn(r)) for r in rows]
    tokens = sorted(by_tokens)
    costs = StepCosts(tokens, [sum(by_tokens[n]) / len(by_tokens[n]) for n in tokens], list(rows), draft)
    if cache is not None:
        costs.save(cache)
    return costs

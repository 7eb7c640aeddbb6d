"""The prefix scheduler: how many drafts of each request to verify this step (DSpark, Algorithm 1),
for any drafter whose drafts come with calibrated confidences.

A drafter with calibrated per-position confidences ``c_{r,j}`` (the probability that draft ``j``
of request ``r`` is accepted given drafts ``< j`` were) knows each draft's survival probability
``a_{r,j} = Π_{i≤j} c_{r,i}``: the expected number of tokens a step emits is
``τ = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j})`` when ``ℓ_r`` drafts of request ``r`` are verified. What a step
costs depends on how many tokens the target verifies together. The scheduler maximises expected
tokens per second ``Θ = τ / (verify(n) + draft(R))`` greedily: all ``(r, j)`` sorted by ``a``
(highest first; survival falls along a row, so every row keeps a contiguous prefix), admitted one
by one up to the token budget, keeping the admitted prefix with the highest ``Θ``. (Algorithm 1
stops at the first decrease of ``Θ``, which is the same prefix when every admission costs a
little more than the last; on a padded block the first draft of a new column pays for the whole
column, so stopping there would never draft past one column at batch > 1.)

It is lossless: it only sets ``num_valid``, which shortens what the verifier checks. It is
batch-aware: one budget is shared, so a confident request gets drafts a doubtful one gives up.
When the last step's confidences say even the best schedule is slower than autoregressive
decoding, the next step skips drafting (:func:`skip_step`), re-probing now and then.

DSpark's drafter applies it with its confidence head (:mod:`specdec.drafters.dspark.drafter`);
:class:`ScheduledDrafter` applies it to any other chain drafter given a confidence function
(the GPU kit wraps the planted-acceptance drafter, whose confidence is its planted ``p``).

Costs come from :class:`StepCosts`, a table profiled once on this machine
(:func:`profile_step_costs`, cached on disk) or passed in. This library's loop verifies a
rectangular block (rows padded to the longest), so by default a step costs
``verify(R · (1 + max ℓ))``; ``ragged=True`` prices ``Σ (1 + ℓ_r)`` tokens instead, as a
variable-length attention kernel would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specdec.drafter import Drafter
from specdec.policy import StepCosts  # the cost table every draft-length decision reads
from specdec.sampling import RowSampling
from specdec.target import Target
from specdec.types import Committed, DraftProposal, Requirements

__all__ = ["StepCosts", "schedule", "survival", "best_throughput", "profile_step_costs", "ScheduleState", "skip_step",
           "ScheduledDrafter"]


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
    best_theta, best = tau / (costs.verify(_step_tokens(lengths, ragged)) + fixed), list(lengths)
    # highest survival first; ties by position so a row's prefix stays contiguous
    order = sorted(((-float(a[r, j]), j, r) for r in range(R) for j in range(gamma)))
    for admitted, (neg_a, j, r) in enumerate(order):
        if budget is not None and admitted >= budget:
            break
        lengths[r] += 1  # j == lengths[r] before: survival never rises along a row
        tau -= neg_a
        theta = tau / (costs.verify(_step_tokens(lengths, ragged)) + fixed)
        if theta > best_theta:
            best_theta, best = theta, list(lengths)
    return torch.tensor(best, dtype=torch.long, device=conf.device)


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


@dataclass
class ScheduleState:
    """What the skip rule carries from step to step, per generation."""

    probe_gap: int  # steps the scheduler may skip before it drafts again to re-probe
    skipped: int = 0  # steps skipped since the last draft
    conf: Tensor | None = None  # [B, γ] the last drafts' calibrated confidences


def skip_step(state: ScheduleState, k: int, costs: StepCosts, budget: int | None = None, ragged: bool = False,
              probe_every: int = 8) -> bool:
    """Skip drafting this step when the last confidences say even the best schedule is slower than
    autoregressive decoding. A skipped row re-probes after ``probe_every`` steps; each probe that
    still says "skip" doubles that gap (up to 64), so a batch where drafting never pays spends
    almost nothing on probes."""
    if state.conf is None or state.conf.shape[1] != k:
        return False
    spec, ar = best_throughput(state.conf, costs, budget, ragged)
    if spec >= ar:
        state.skipped, state.probe_gap = 0, probe_every
        return False
    state.skipped += 1
    if state.skipped >= state.probe_gap:  # probe: draft once to refresh the confidences
        state.skipped, state.probe_gap = 0, min(2 * state.probe_gap, 64)
        return False
    return True


@dataclass
class _Wrapped(ScheduleState):
    inner: Any = None  # the wrapped drafter's own state


class ScheduledDrafter(Drafter):
    """Any chain drafter, verified only as far as the prefix scheduler says pays (DSpark's rule,
    batch-aware: :func:`schedule` per step, :func:`skip_step` between steps).

    ``confidences(state, proposal)`` gives [B, n] in [0, 1]: the probability each draft is accepted
    given the earlier ones were, from the wrapped drafter's state and proposal (default: the
    drafter's own ``draft_confidences`` method). A skipped step proposes nothing, so the wrapped
    drafter sees ``observe`` without a ``propose`` before it (as DSpark's own skip does); drafters
    whose state is rolled forward by ``observe`` alone, such as the planted one, allow that.
    """

    name = "scheduled"

    def __init__(self, drafter: Drafter, costs: StepCosts,
                 confidences: Callable[[Any, DraftProposal], Tensor] | None = None, budget: int | None = None,
                 ragged: bool = False, probe_every: int = 8):
        fn = confidences or getattr(drafter, "draft_confidences", None)
        if fn is None:
            raise ValueError(f"drafter {drafter.name!r} has no draft_confidences: pass confidences=")
        self.drafter, self.costs, self.confidences = drafter, costs, fn
        self.budget, self.ragged, self.probe_every = budget, ragged, probe_every
        if getattr(drafter, "target", None) is not None:
            self.target = drafter.target

    def requirements(self) -> Requirements:
        return self.drafter.requirements()

    def bind(self, target: Target) -> None:
        self.drafter.bind(target)
        self.target = target

    def check_k(self, k: int) -> None:
        self.drafter.check_k(k)

    def start(self, prefill: Committed, rows: RowSampling) -> _Wrapped:
        return _Wrapped(self.probe_every, inner=self.drafter.start(prefill, rows))

    def propose(self, state: _Wrapped, k: int, rows: RowSampling) -> DraftProposal:
        if skip_step(state, k, self.costs, self.budget, self.ragged, self.probe_every):
            assert state.conf is not None
            return DraftProposal.empty(state.conf.shape[0], self.target.device)
        proposal = self.drafter.propose(state.inner, k, rows)
        if not proposal.is_chain:
            raise ValueError(f"the prefix scheduler shortens chains; {self.drafter.name!r} proposed a tree")
        state.conf = self.confidences(state.inner, proposal)  # [B, n]
        lengths = schedule(state.conf, self.costs, self.budget, self.ragged)
        assert proposal.num_valid is not None
        return proposal.with_num_valid(torch.minimum(proposal.num_valid, lengths))

    def observe(self, state: _Wrapped, committed: Committed) -> None:
        self.drafter.observe(state.inner, committed)

    def select_rows(self, state: _Wrapped, rows: Tensor) -> None:
        self.drafter.select_rows(state.inner, rows)
        if state.conf is not None:
            state.conf = state.conf[rows.to(state.conf.device)]

    @classmethod
    def create(cls, target: Target, drafter: Drafter | None = None, costs: StepCosts | None = None,
               **options: Any) -> ScheduledDrafter:
        """Options: ``drafter`` (built, bound to ``target`` here), ``costs``, and ``confidences``,
        ``budget``, ``ragged``, ``probe_every`` as in the constructor."""
        if drafter is None or costs is None:
            raise ValueError("the scheduler wraps a drafter: pass drafter= and costs=")
        d = cls(drafter, costs, **options)
        d.bind(target)
        return d

    @classmethod
    def tiny(cls, target: Target, **overrides: Any) -> ScheduledDrafter:
        """Not a drafter of its own: it wraps one (:meth:`create`)."""
        return cls.create(target, **overrides)

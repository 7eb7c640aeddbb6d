"""Draft-length policies: how many of the proposed nodes each row verifies, decided per step.

The loop hands a policy every proposal before the target runs; the policy may only lower each
row's ``num_valid``. Verifying a prefix of a draft is verifying a shorter draft, and the choice is
made before the target's logits or the verifier's random numbers exist, so any policy is lossless
by construction (the conformance suite checks it: :mod:`specdec.testing.conformance`). A drafter
needs nothing to take part.

:class:`AdaptivePolicy` maximises the step's expected tokens per second,

    Θ(w) = Σ_r τ_r(w) / (draft_s(B) + verify_s(B · (1 + w))),   τ_r(w) = 1 + Σ_{d ≤ d_r(w)} s_{r,d}

over the block width ``w`` (this loop verifies a rectangular block of ``B`` rows and ``1 + w``
tokens: a row shorter than ``w`` saves nothing, so each row keeps every level of its draft that
fits). ``s_{r,d}`` is the probability that row ``r`` accepts ``d`` or more drafts:

- for a chain whose drafter reports a confidence (``DraftProposal.confidence``, DSpark's head) or
  a q (the q of the drafted token), the product of those per-node values, each calibrated online
  (acceptance observed per confidence bin, shrunk towards the reported value);
- otherwise (deterministic drafts, trees) the row's running acceptance per depth, shrunk towards
  the policy's global running acceptance per depth.

Trees are cut by levels: a row keeps the leading nodes of depth ≤ d. Costs are a
:class:`StepCosts` table (profiled) or, by default, :class:`MeasuredCosts`: the loop's own timings
of each step, where a block size never measured is assumed as cheap as the data allow (so the
policy tries it once and learns). Measured costs are as noisy as the machine: on a busy one a step
takes anywhere from one to several times its quiet time, and an average of such steps can make
drafting look cheaper than it is. So drafting's costs (the draft pass, a block wider than plain
decoding's) are weighed at an upper confidence bound, ``caution`` standard errors of the average
above it (:class:`Cautious`, :meth:`MeasuredCosts.noise`), plain decoding's at the estimate: noise
moves the choice towards fewer drafts or none, never towards more. When drafting cannot pay (plain
decoding, which skips the draft pass, expects more tokens per second than the best width with it),
the policy verifies nothing (``w = 0``; that step's draft pass was paid, as the policy decides
after it), skips the draft pass from the next step on (:meth:`AdaptivePolicy.skip`: the drafter
only observes) and re-probes the whole draft after ``probe_every`` such steps, doubling the gap
while drafting keeps not paying.

:class:`PrefixPolicy` is DSpark's prefix scheduler (below :func:`schedule`): a chain's confidences
admitted draft by draft under one budget for the batch, and a draft pass skipped altogether
(:meth:`DraftPolicy.skip`, asked before ``propose``) while the last confidences say drafting cannot
pay. DSpark's ``scheduler=True`` applies it to its own drafts; ``policy="prefix"`` to any drafter
that reports a confidence or a q.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import Tensor

from specdec.timing import repeat
from specdec.types import DraftProposal, node_depths

if TYPE_CHECKING:
    from specdec.sampling import RowSampling

__all__ = ["pinned_rows", "Costs", "StepCosts", "MeasuredCosts", "Cautious", "DraftPolicy", "AdaptivePolicy", "PrefixPolicy", "best_lengths",
           "schedule", "survival", "best_throughput", "profile_step_costs", "make_policy", "POLICIES"]

_HOST = torch.device("cpu")  # the policy's statistics and choices are small: kept and computed on the host


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear in x, extrapolated linearly past both ends."""
    if len(xs) == 1:
        return ys[0] * max(x, 1.0) / max(xs[0], 1.0)
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-9)


class Costs(Protocol):
    """Seconds of one step's parts: a target forward over ``tokens`` block tokens (verification
    included), and one draft pass (propose + observe) over ``rows`` rows."""

    def verify(self, tokens: float) -> float: ...

    def draft(self, rows: float) -> float: ...


@dataclass
class StepCosts:
    """A profiled table: ``verify_s[i]`` for a target forward over ``verify_tokens[i]`` tokens in
    total, ``draft_s[i]`` for one draft pass over ``draft_rows[i]`` rows. Both ascending."""

    verify_tokens: list[int]
    verify_s: list[float]
    draft_rows: list[int]
    draft_s: list[float]

    def __post_init__(self) -> None:
        for xs, ys, name in ((self.verify_tokens, self.verify_s, "verify"), (self.draft_rows, self.draft_s, "draft")):
            if not xs or len(xs) != len(ys):
                raise ValueError(f"{name} table needs matching, non-empty sizes and times")
            if list(xs) != sorted(set(xs)) or min(xs) < 0 or min(ys) < 0:
                raise ValueError(f"{name} sizes must be strictly ascending and times non-negative")

    @classmethod
    def linear(cls, per_token: float, fixed: float, draft: float) -> StepCosts:
        """A synthetic table: a verify forward over ``n`` tokens costs ``fixed + per_token·n``
        seconds, a draft pass ``draft`` whatever its rows (what-if studies, and tests that need
        the scheduler to draft whatever this machine measures)."""
        return cls([1, 2], [fixed + per_token, fixed + 2 * per_token], [1, 2], [draft, draft])

    def verify(self, tokens: float) -> float:
        return _interp([float(x) for x in self.verify_tokens], self.verify_s, float(tokens))

    def draft(self, rows: float) -> float:
        return _interp([float(x) for x in self.draft_rows], self.draft_s, float(rows))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> StepCosts:
        return cls(**json.loads(Path(path).read_text()))


class MeasuredCosts:
    """Step costs measured as the loop runs: a moving average per block size (verify) and per row
    count (draft). Optimistic where nothing was measured: a larger block costs what the largest
    measured one did, a smaller one its share of the smallest measured (proportional to tokens);
    in between, linear interpolation. With no measurement every size costs the same.

    Each average keeps its spread too (a moving average of the squares): :meth:`noise` is how far
    an average itself may be off, relative to it, the machine's noise (a busy machine's timings
    jump with the other work) as the policy's caution (:class:`Cautious`)."""

    def __init__(self, smoothing: float = 0.3):
        self.smoothing = smoothing  # weight of a new measurement in the moving average
        self.verify_s: dict[int, float] = {}  # block tokens -> seconds
        self.draft_s: dict[int, float] = {}  # rows -> seconds
        self._squares: dict[tuple[str, int], float] = {}  # (table, size) -> moving average of seconds²
        self._count: dict[tuple[str, int], int] = {}  # (table, size) -> measurements

    def record(self, rows: int, tokens: int, draft_s: float | None, verify_s: float) -> None:
        """One step's times; ``draft_s`` None when the step drafted nothing (its draft time is not
        a draft pass's)."""
        s = self.smoothing
        for name, table, key, x in (("verify", self.verify_s, tokens, verify_s), ("draft", self.draft_s, rows, draft_s)):
            if x is None:
                continue
            slot = (name, key)
            if key not in table:
                table[key], self._squares[slot], self._count[slot] = x, x * x, 1
            else:
                table[key] = (1 - s) * table[key] + s * x
                self._squares[slot] = (1 - s) * self._squares[slot] + s * x * x
                self._count[slot] += 1

    def noise(self) -> float:
        """The standard error of a moving average relative to it, the largest over the sizes
        measured at least twice (0 before): the measurements' coefficient of variation times
        ``sqrt(smoothing / (2 - smoothing))``, the spread of a moving average of independent draws."""
        worst = 0.0
        for (name, key), n in self._count.items():
            mean = (self.verify_s if name == "verify" else self.draft_s)[key]
            if n >= 2 and mean > 0:
                sd = math.sqrt(max(self._squares[(name, key)] - mean * mean, 0.0))
                worst = max(worst, sd / mean)
        return worst * math.sqrt(self.smoothing / (2 - self.smoothing))

    def verify(self, tokens: float) -> float:
        return self._lookup(self.verify_s, tokens)

    def draft(self, rows: float) -> float:
        return self._lookup(self.draft_s, rows) if self.draft_s else 0.0

    @staticmethod
    def _lookup(table: dict[int, float], x: float) -> float:
        if not table:
            return 1.0
        xs = sorted(table)
        if x >= xs[-1]:
            return table[xs[-1]]
        if x <= xs[0]:
            return table[xs[0]] * x / xs[0]
        return _interp([float(v) for v in xs], [table[v] for v in xs], x)


class Cautious:
    """Costs as a policy should weigh them when they are noisy: drafting (a draft pass, a block wider
    than ``plain`` tokens) at an upper confidence bound, ``(1 + z·noise)`` times the estimate, plain
    decoding (``plain`` tokens, no draft) at the estimate. Noise can then only move a choice towards
    fewer drafts, never away from them; with quiet costs (``noise`` 0) it is the estimate itself."""

    def __init__(self, costs: Costs, plain: int, noise: float, z: float = 2.0):
        self.costs, self.plain, self.factor = costs, plain, 1 + z * max(noise, 0.0)

    def verify(self, tokens: float) -> float:
        t = self.costs.verify(tokens)
        return t if tokens <= self.plain else t * self.factor

    def draft(self, rows: float) -> float:
        return self.costs.draft(rows) * self.factor


def best_lengths(survival: Tensor, levels: Tensor, costs: Costs, draft_optional: bool = False) -> Tensor:
    """Nodes each row verifies to maximise expected tokens per second of a rectangular block.

    ``survival`` [B, K]: P(the row accepts ``d`` or more drafts), d = 1..K, non-increasing.
    ``levels`` [B, K + 1]: nodes a row verifies when it keeps the draft's depths ≤ d (``levels[:, 0]
    = 0``, non-decreasing; a chain's is ``min(d, num_valid)``). Returns [B] in ``[0, levels[:, -1]]``;
    among equal throughputs, the fewest tokens. ``draft_optional``: verifying nothing also saves the
    draft pass (a policy that then skips it, :meth:`DraftPolicy.skip`), so width 0 costs no draft.
    """
    B, K = survival.shape
    levels = levels.long()
    n = int(levels[:, -1].max()) if B else 0
    widths = torch.arange(n + 1, device=levels.device)
    # deepest level of each row that fits in each width [n+1, B]: levels that add nodes (a row's
    # levels past its deepest node add none) and fit
    adds = levels[:, 1:] > levels[:, :-1]  # [B, K]
    depth = ((levels[:, 1:].unsqueeze(0) <= widths.view(-1, 1, 1)) & adds).sum(-1)
    kept = levels.gather(1, depth.T).T  # [n+1, B] nodes each row verifies at that width
    gain = torch.cat([survival.new_zeros(B, 1), survival.double().cumsum(1)], 1)  # [B, K+1]
    tau = B + gain.gather(1, depth.T).T.sum(1)  # [n+1] expected tokens of the step
    block = kept.max(1).values  # [n+1] the block width actually needed
    step = torch.tensor([costs.verify(B * (1 + int(w))) for w in block.tolist()], dtype=torch.float64,
                        device=tau.device)
    draft = torch.full_like(step, costs.draft(B))
    if draft_optional:
        draft[0] = 0.0  # width 0 verifies no node of any row (kept[0] is all zeros)
    theta = tau / (step + draft).clamp(min=1e-12)
    best = int(torch.nonzero(theta >= theta.max() * (1 - 1e-12))[0])
    return kept[best]


class DraftPolicy(ABC):
    """Decides, per row and per step, how many of the proposed nodes to verify. It sees the
    proposal and may only lower ``num_valid``; its state spans one run of the loop (per request),
    anything it keeps on itself spans every run it is handed to.

    ``couples_rows``: a row's choice may depend on the other rows of its batch or on timings (one
    block width, shared statistics, measured costs, a batch-wide skip). The loop then leaves seeded
    sampled rows their whole draft and never skips a draft pass they are in, so a seed pins a row's
    tokens whatever its batch; under the ``coupled`` verifier, whose tokens no choice can move, the
    policy decides for them too."""

    name: ClassVar[str]
    couples_rows: ClassVar[bool] = True

    @abstractmethod
    def start(self, batch: int, k: int) -> Any:
        """Per-run state for ``batch`` requests drafted at up to ``k``."""

    @abstractmethod
    def choose(self, state: Any, proposal: DraftProposal, requests: Tensor) -> Tensor:
        """``num_valid`` [B] for this step, each at most the proposal's; ``requests`` [B] are the
        rows' request indices in the run (rows leave the batch as they finish)."""

    def skip(self, state: Any, k: int, requests: Tensor) -> bool:
        """Whether to skip this step's draft pass altogether (plain decoding: an empty proposal,
        the drafter not asked). Asked before ``propose``; never by default."""
        return False

    def observe(self, state: Any, proposal: DraftProposal, num_accepted: Tensor, requests: Tensor,
                draft_s: float, verify_s: float) -> None:
        """What the step verified (``proposal`` as trimmed, with the chosen ``num_valid``), accepted,
        and cost (the loop's timings in seconds). Nothing by default."""


@dataclass
class _RunState:
    tested: Tensor  # [R, K] decayed count of steps a request's depth-d draft was reached (depth d-1 accepted)
    accepted: Tensor  # [R, K] ... and accepted
    idle: int = 0  # consecutive steps that had drafts and verified none, or skipped the draft pass
    probe_gap: int = 0  # idle steps before the next probe
    off: bool = False  # the last choice was plain decoding: the draft pass is skipped until a probe


class AdaptivePolicy(DraftPolicy):
    """Expected tokens per second, maximised per step (see the module docstring)."""

    name = "adaptive"
    BINS: ClassVar[int] = 10  # confidence calibration bins over [0, 1]

    def __init__(self, costs: Costs | None = None, prior: float = 0.5, prior_weight: float = 2.0,
                 memory: float = 0.9, global_memory: float = 0.99, probe_every: int = 4, max_probe_gap: int = 64,
                 caution: float = 2.0):
        if not 0 < prior <= 1 or prior_weight <= 0 or not 0 < memory <= 1 or not 0 < global_memory <= 1:
            raise ValueError("AdaptivePolicy needs 0 < prior <= 1, prior_weight > 0 and memories in (0, 1]")
        if not (isinstance(caution, (int, float)) and math.isfinite(caution) and caution >= 0):
            raise ValueError(f"AdaptivePolicy needs a finite caution >= 0 (standard errors of the cost), got {caution!r}")
        if not 1 <= probe_every <= max_probe_gap:
            raise ValueError(f"AdaptivePolicy needs 1 <= probe_every <= max_probe_gap, got {probe_every}, {max_probe_gap}")
        self.costs = costs if costs is not None else MeasuredCosts()
        self.prior, self.prior_weight = prior, prior_weight  # acceptance before any observation, and its weight
        self.memory, self.global_memory = memory, global_memory  # per-step decay of a request's / all counts
        self.probe_every, self.max_probe_gap = probe_every, max_probe_gap
        self.caution = float(caution)  # drafting's costs weighed at this many standard errors above their estimate
        self.tested = torch.zeros(0, dtype=torch.float64, device=_HOST)  # [K] over every request seen: the shrinkage target
        self.accepted = torch.zeros(0, dtype=torch.float64, device=_HOST)
        self.cal_tested = torch.zeros(self.BINS, dtype=torch.float64, device=_HOST)  # per confidence bin
        self.cal_accepted = torch.zeros(self.BINS, dtype=torch.float64, device=_HOST)
        self.cal_reported = torch.zeros(self.BINS, dtype=torch.float64, device=_HOST)  # Σ confidence of those tested

    def start(self, batch: int, k: int) -> _RunState:
        z = torch.zeros(batch, k, dtype=torch.float64, device=_HOST)
        return _RunState(z, z.clone(), probe_gap=self.probe_every)

    # --- choosing ---------------------------------------------------------------------------
    def choose(self, state: _RunState, proposal: DraftProposal, requests: Tensor) -> Tensor:
        assert proposal.num_valid is not None
        if proposal.n == 0:
            return proposal.num_valid
        depth, levels, K = self._levels(proposal)
        self._grow(state, K)
        conf = self._confidence(proposal)
        if conf is not None:  # chain: node j is depth j + 1
            c = self._calibrated(conf)[:, :K]
        else:
            c = self._acceptance(state, requests)[:, :K]
        B = proposal.tokens.shape[0]
        noise = self.costs.noise() if isinstance(self.costs, MeasuredCosts) else 0.0
        costs = Cautious(self.costs, B, noise, self.caution) if noise > 0 else self.costs
        lengths = best_lengths(c.cumprod(1), levels, costs, draft_optional=True)
        if int(lengths.max()) == 0 and int(levels[:, -1].max()) > 0:  # drafting does not pay: probe now and then
            state.idle += 1
            state.off = self.costs.draft(proposal.tokens.shape[0]) > 0  # skipping a free draft pass saves nothing
            if state.idle >= state.probe_gap:
                state.idle, state.probe_gap = 0, min(2 * state.probe_gap, self.max_probe_gap)
                lengths = levels[:, -1]
        elif int(lengths.max()) > 0:
            state.idle, state.probe_gap, state.off = 0, self.probe_every, False
        return torch.minimum(lengths.to(proposal.num_valid.device), proposal.num_valid)

    def skip(self, state: _RunState, k: int, requests: Tensor) -> bool:
        """Once drafting does not pay (the last choice verified nothing), the draft pass is skipped
        too, each skipped step counting towards the next probe: at a probe the drafter drafts
        again and :meth:`choose` verifies the whole draft, to learn whether it pays now."""
        if not state.off:
            return False
        state.idle += 1
        if state.idle >= state.probe_gap:
            state.idle -= 1  # choose() counts the probe step itself
            return False
        return True

    @staticmethod
    def _levels(proposal: DraftProposal) -> tuple[Tensor, Tensor, int]:
        """Node depths [B, n] and, per row, the nodes kept when keeping depths ≤ d: the leading
        nodes before the first deeper one, within ``num_valid``. [B, K + 1] with K the max depth."""
        assert proposal.num_valid is not None
        depth = node_depths(proposal.parents).cpu()  # [B, n]
        nv = proposal.num_valid.cpu()
        valid = torch.arange(proposal.n, device=_HOST).unsqueeze(0) < nv.unsqueeze(1)
        depth = torch.where(valid, depth, 0)
        K = int(depth.max())
        run_max = torch.where(valid, depth.cummax(1).values, K + 1)  # [B, n], padding past every level
        levels = (run_max.unsqueeze(1) <= torch.arange(K + 1, device=_HOST).view(1, -1, 1)).sum(-1)  # [B, K+1]
        return depth, levels, K

    @staticmethod
    def _confidence(proposal: DraftProposal) -> Tensor | None:
        """Per-node confidence of a chain [B, n] (the drafter's own, else q of the drafted token)."""
        if not proposal.is_chain:
            return None
        if proposal.confidence is not None:
            return proposal.confidence.detach().double().cpu().clamp(0, 1)
        if proposal.q is not None:
            return proposal.q.gather(-1, proposal.tokens.unsqueeze(-1)).squeeze(-1).double().cpu().clamp(0, 1)
        return None

    def _calibrated(self, conf: Tensor) -> Tensor:
        """Acceptance observed for confidences in the same bin, shrunk towards the confidence scaled by
        the drafter's overall calibration (accepted over reported, every bin together, itself shrunk
        towards 1): a drafter that is overconfident everywhere is believed less in a bin it has not
        been seen in yet, so the policy stops paying for its drafts within a few steps."""
        b = self._bin(conf)
        w = self.prior_weight
        overall = (self.cal_accepted.sum() + w) / (self.cal_reported.sum() + w)
        return (self.cal_accepted[b] + w * (conf * overall).clamp(max=1)) / (self.cal_tested[b] + w)

    def _bin(self, conf: Tensor) -> Tensor:
        return (conf * self.BINS).long().clamp(0, self.BINS - 1)

    def _acceptance(self, state: _RunState, requests: Tensor) -> Tensor:
        """Per-depth acceptance of each row's request, shrunk towards the global one. [B, K]"""
        g = (self.accepted + self.prior_weight * self.prior) / (self.tested + self.prior_weight)
        r = requests.cpu()
        return (state.accepted[r] + self.prior_weight * g) / (state.tested[r] + self.prior_weight)

    def _grow(self, state: _RunState, K: int) -> None:
        """The run's and the global counts, both as deep as the deepest draft either has seen."""
        K = max(K, state.tested.shape[1], self.tested.numel())
        pad = torch.zeros(state.tested.shape[0], K - state.tested.shape[1], dtype=torch.float64, device=_HOST)
        state.tested, state.accepted = torch.cat([state.tested, pad], 1), torch.cat([state.accepted, pad], 1)
        pad = torch.zeros(K - self.tested.numel(), dtype=torch.float64, device=_HOST)
        self.tested, self.accepted = torch.cat([self.tested, pad]), torch.cat([self.accepted, pad])

    # --- learning -----------------------------------------------------------------------------
    def observe(self, state: _RunState, proposal: DraftProposal, num_accepted: Tensor, requests: Tensor,
                draft_s: float, verify_s: float) -> None:
        assert proposal.num_valid is not None
        B = proposal.tokens.shape[0]
        if isinstance(self.costs, MeasuredCosts):  # a step without drafts (skipped) says nothing of a draft pass
            self.costs.record(B, B * (1 + proposal.n), draft_s if proposal.n else None, verify_s)
        if proposal.n == 0:
            return
        depth, _, K = self._levels(proposal)
        self._grow(state, K)
        verified = depth.max(1).values  # [B] deepest node verified
        acc = num_accepted.cpu()
        d = torch.arange(1, state.tested.shape[1] + 1, device=_HOST).unsqueeze(0)  # [1, K]
        reached = (d <= verified.unsqueeze(1)) & (d <= acc.unsqueeze(1) + 1)  # depth d was tested
        won = reached & (d <= acc.unsqueeze(1))
        r, seen = requests.cpu(), verified > 0
        decay = torch.where(seen, self.memory, 1.0).unsqueeze(1)  # only rows that verified something forget
        state.tested[r] = state.tested[r] * decay + reached
        state.accepted[r] = state.accepted[r] * decay + won
        if bool(seen.any()):
            self.tested = self.tested * self.global_memory + reached.sum(0)
            self.accepted = self.accepted * self.global_memory + won.sum(0)
        conf = self._confidence(proposal)
        if conf is not None:
            j = torch.arange(proposal.n, device=_HOST).unsqueeze(0)
            tried = (j < proposal.num_valid.cpu().unsqueeze(1)) & (j <= acc.unsqueeze(1))
            b = self._bin(conf)[tried]
            self.cal_tested = self.cal_tested * self.global_memory + torch.bincount(b, minlength=self.BINS)
            hit = (j < acc.unsqueeze(1))[tried]
            self.cal_accepted = self.cal_accepted * self.global_memory + torch.bincount(b[hit], minlength=self.BINS)
            self.cal_reported = self.cal_reported * self.global_memory + torch.bincount(
                b, weights=conf[tried], minlength=self.BINS)


# --- the prefix scheduler (DSpark, arXiv 2607.05147, Algorithm 1) -------------------------------
#
# A drafter with calibrated per-draft confidences ``c_{r,j}`` (the probability that draft ``j`` of
# row ``r`` is accepted given drafts ``< j`` were) knows each draft's survival ``a_{r,j} = Π_{i≤j}
# c_{r,i}``; verifying ``ℓ_r`` drafts of row ``r`` emits ``τ = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j})`` tokens
# in expectation. The scheduler maximises ``Θ = τ / (verify(n) + draft(R))`` greedily: every
# ``(r, j)`` sorted by ``a`` (highest first; survival falls along a row, so each row keeps a
# contiguous prefix), admitted one by one up to the step's token budget, keeping the admitted
# prefix with the highest Θ. (Algorithm 1 stops at the first decrease of Θ, the same prefix when
# each admission costs a little more than the last; on a padded block the first draft of a column
# pays for the whole column, so stopping there would never draft past one column at batch > 1.)
# One budget is shared by the batch: a confident row gets drafts a doubtful one gives up.
# This loop verifies a rectangular block (rows padded to the longest), so a step costs
# ``verify(R · (1 + max ℓ))``; ``ragged=True`` prices ``Σ (1 + ℓ_r)`` tokens instead, as a
# variable-length attention kernel would.

def survival(conf: Tensor) -> Tensor:
    """Survival probabilities ``a_{r,j} = Π_{i≤j} c_{r,i}``. [R, γ] → [R, γ]"""
    return conf.double().clamp(0, 1).cumprod(-1)


def _step_tokens(lengths: list[int], ragged: bool) -> int:
    return sum(1 + x for x in lengths) if ragged else len(lengths) * (1 + max(lengths, default=0))


def schedule(conf: Tensor, costs: Costs, budget: int | None = None, ragged: bool = False,
             draft_cost: bool = True) -> Tensor:
    """Drafts to verify per row, ``num_valid`` [R] in ``[0, γ]``, from confidences [R, γ].

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


def best_throughput(conf: Tensor, costs: Costs, budget: int | None = None, ragged: bool = False
                    ) -> tuple[float, float]:
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
    """A :class:`StepCosts` table measured on this machine, once: ``verify_fn(rows, width)`` returns
    the seconds of one target forward over a [rows, width] block, ``draft_fn(rows)`` those of one
    draft pass (each timing only that call, :class:`specdec.timing.Stopwatch`). Medians of
    ``repeats`` after a warm-up (:func:`specdec.timing.repeat`); read from / written to ``cache``
    (a JSON path) so start-up profiles once. Verify times are indexed by tokens in the block."""
    if cache is not None and Path(cache).exists():
        return StepCosts.load(cache)
    by_tokens: dict[int, list[float]] = {}
    for r in rows:
        for w in widths:
            by_tokens.setdefault(r * w, []).append(repeat(lambda: verify_fn(r, w), repeats).median)
    draft = [repeat(lambda: draft_fn(r), repeats).median for r in rows]
    tokens = sorted(by_tokens)
    costs = StepCosts(tokens, [sum(by_tokens[n]) / len(by_tokens[n]) for n in tokens], list(rows), draft)
    if cache is not None:
        costs.save(cache)
    return costs


@dataclass
class _PrefixState:
    probe_gap: int  # steps the scheduler may skip before it drafts again to re-probe
    skipped: int = 0  # steps skipped since the last draft
    conf: Tensor | None = None  # [R, γ] each request's last drafts' confidences (host)


class PrefixPolicy(DraftPolicy):
    """DSpark's prefix scheduler as a draft-length policy: per step, :func:`schedule` on the chain's
    confidences; between steps, when the last confidences say even the best schedule is slower
    than autoregressive decoding, the draft pass is skipped (:meth:`skip`), re-probing after
    ``probe_every`` steps and doubling that gap (up to 64) while it keeps saying so.

    It reads ``DraftProposal.confidence`` where the drafter reports one (DSpark's confidence head,
    the planted drafter's ``p``), else the q of each drafted token; a chain with neither, or a
    tree, is an error (the adaptive policy handles those). Costs: a :class:`StepCosts` table (DSpark
    profiles one at start-up) or, by default, :class:`MeasuredCosts` learnt from the loop's timings.
    One budget shared by the batch makes a row's random stream (not its distribution) depend on
    the other rows. DSpark's ``scheduler=True`` applies this policy to its own proposals."""

    name = "prefix"

    def __init__(self, costs: Costs | None = None, budget: int | None = None, ragged: bool = False,
                 probe_every: int = 8):
        if budget is not None and budget < 0:
            raise ValueError(f"PrefixPolicy budget must be >= 0 drafts a step or None, got {budget}")
        if probe_every < 1:
            raise ValueError(f"PrefixPolicy probe_every must be >= 1, got {probe_every}")
        self.costs = costs if costs is not None else MeasuredCosts()
        self.budget, self.ragged, self.probe_every = budget, ragged, probe_every

    def start(self, batch: int, k: int = 0) -> _PrefixState:
        return _PrefixState(self.probe_every)

    def skip(self, state: _PrefixState, k: int, requests: Tensor) -> bool:
        if state.conf is None or state.conf.shape[1] != k:
            return False
        spec, ar = best_throughput(state.conf[requests.cpu()], self.costs, self.budget, self.ragged)
        if spec >= ar:
            state.skipped, state.probe_gap = 0, self.probe_every
            return False
        state.skipped += 1
        if state.skipped >= state.probe_gap:  # probe: draft once to refresh the confidences
            state.skipped, state.probe_gap = 0, min(2 * state.probe_gap, 64)
            return False
        return True

    def choose(self, state: _PrefixState, proposal: DraftProposal, requests: Tensor) -> Tensor:
        assert proposal.num_valid is not None
        if proposal.n == 0:
            return proposal.num_valid
        if not proposal.is_chain:
            raise ValueError("the prefix scheduler shortens chains; this drafter proposed a tree"
                             " (the adaptive policy cuts trees by levels)")
        conf = AdaptivePolicy._confidence(proposal)
        if conf is None:
            raise ValueError("the prefix scheduler reads each draft's confidence (DraftProposal.confidence, or"
                             " the q of the drafted token); this drafter reports neither: use the adaptive policy")
        r = requests.cpu()
        if state.conf is None or state.conf.shape[1] != conf.shape[1]:
            state.conf = torch.zeros(int(r.max()) + 1, conf.shape[1], dtype=torch.float64, device=_HOST)
        elif int(r.max()) >= state.conf.shape[0]:
            pad = state.conf.new_zeros(int(r.max()) + 1 - state.conf.shape[0], conf.shape[1])
            state.conf = torch.cat([state.conf, pad])
        state.conf[r] = conf
        lengths = schedule(conf, self.costs, self.budget, self.ragged)
        return torch.minimum(proposal.num_valid, lengths.to(proposal.num_valid.device))

    def observe(self, state: _PrefixState, proposal: DraftProposal, num_accepted: Tensor, requests: Tensor,
                draft_s: float, verify_s: float) -> None:
        if isinstance(self.costs, MeasuredCosts):
            B = proposal.tokens.shape[0]
            self.costs.record(B, B * (1 + proposal.n), draft_s, verify_s)


def pinned_rows(policy: DraftPolicy | None, rows: RowSampling) -> Tensor | None:
    """[B] bool host mask of the rows whose tokens a seed must pin but whose draft length
    ``policy`` would choose from other rows or timings (:attr:`DraftPolicy.couples_rows`): seeded
    sampled rows, unless the verifier keyed every row's noise by position (``coupled``), where no
    choice moves a token. None when there is none. The loop applies it to the policy it is given,
    a drafter to a policy it applies to its own proposals (DSpark's scheduler)."""
    if policy is None or not policy.couples_rows or rows.keyed:
        return None
    mask = [p.seed is not None and not p.greedy for p in rows.params]
    return torch.tensor(mask, device="cpu") if any(mask) else None


POLICIES: dict[str, type[DraftPolicy]] = {"adaptive": AdaptivePolicy, "prefix": PrefixPolicy}


def make_policy(spec: DraftPolicy | str | None) -> DraftPolicy | None:
    """A policy from its name (``"adaptive"``), itself, or ``None`` / ``"fixed"``: every proposed
    node is verified (a fixed k)."""
    if spec is None or isinstance(spec, DraftPolicy):
        return spec
    if spec == "fixed":
        return None
    if isinstance(spec, str) and spec in POLICIES:
        return POLICIES[spec]()
    raise ValueError(f"policy must be 'fixed' (verify every proposed node), one of {sorted(POLICIES)},"
                     f" a specdec.policy.DraftPolicy or None; got {spec!r}")

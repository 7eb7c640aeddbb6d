"""What a run measures, per request and for the whole run.

Mean accepted length counts the bonus token, as Spec-Bench does: plain autoregressive decoding
scores 1.0. Acceptance per position is by tree depth (a chain's depth is its position):
``accepted_at[d] / drafted_at[d]`` is the rate at which a draft of depth ``d + 1`` survived, given
that the row drafted that deep.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["RequestMetrics", "RunMetrics", "summarize"]


@dataclass
class RequestMetrics:
    prompt_tokens: int
    new_tokens: int = 0
    steps: int = 0  # verification steps (the prefill's first token not counted)
    drafted: int = 0  # draft nodes sent to verification
    accepted: int = 0  # draft tokens accepted
    drafted_at: list[int] = field(default_factory=list)  # per depth
    accepted_at: list[int] = field(default_factory=list)  # per depth
    finish_reason: str = ""  # "eos" or "length"
    ttft_s: float = 0.0  # the batch prefill: with static batching every row of a batch gets its first token together
    latency_s: float = 0.0  # from the start of the run to the step that finished this request

    def record(self, depth_drafted: int, depth_accepted: int, drafted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += depth_accepted
        grow = max(depth_drafted - len(self.drafted_at), 0)
        self.drafted_at += [0] * grow
        self.accepted_at += [0] * grow
        for d in range(depth_drafted):
            self.drafted_at[d] += 1
        for d in range(depth_accepted):
            self.accepted_at[d] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification step, bonus included."""
        return (self.accepted + self.steps) / self.steps if self.steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_at(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def to_dict(self) -> dict:
        return {**asdict(self), "mean_accepted_length": self.mean_accepted_length,
                "acceptance_rate": self.acceptance_rate, "acceptance_at": self.acceptance_at}


@dataclass
class RunMetrics:
    """Time split of one batched run: where the wall-clock went."""

    wall_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0  # drafter propose + observe
    target_s: float = 0.0  # target forward passes (after the prefill)
    verify_s: float = 0.0  # verifier
    batch_steps: int = 0  # draft → verify steps of the whole batch (a request counts its own in RequestMetrics.steps)
    new_tokens: int = 0

    @property
    def other_s(self) -> float:
        """Loop overhead: everything that is neither drafting, target forwards nor verification."""
        return self.wall_s - self.prefill_s - self.draft_s - self.target_s - self.verify_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "other_s": self.other_s, "tokens_per_s": self.tokens_per_s}


def summarize(requests: list[RequestMetrics]) -> dict:
    """Aggregate over requests: sums first, ratios after (a request's weight is its steps)."""
    total = RequestMetrics(prompt_tokens=sum(r.prompt_tokens for r in requests))
    for r in requests:
        total.new_tokens += r.new_tokens
        total.steps += r.steps
        total.drafted += r.drafted
        total.accepted += r.accepted
        grow = max(len(r.drafted_at) - len(total.drafted_at), 0)
        total.drafted_at += [0] * grow
        total.accepted_at += [0] * grow
        for d, (n, a) in enumerate(zip(r.drafted_at, r.accepted_at)):
            total.drafted_at[d] += n
            total.accepted_at[d] += a
    return {
        "requests": len(requests),
        "new_tokens": total.new_tokens,
        "steps": total.steps,
        "mean_accepted_length": total.mean_accepted_length,
        "acceptance_rate": total.acceptance_rate,
        "acceptance_at": total.acceptance_at,
    }

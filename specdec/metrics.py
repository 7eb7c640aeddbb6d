"""What a run measures, per request and for the whole run.

Mean accepted length counts the bonus token, as Spec-Bench does: plain autoregressive decoding
scores 1.0. Acceptance per position is by tree depth (a chain's depth is its position):
``accepted_at[d] / drafted_at[d]`` is the rate at which a draft of depth ``d + 1`` survived, given
that the row drafted that deep.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["RequestMetrics", "RunMetrics", "summarize", "GenerationSummary"]


@dataclass
class RequestMetrics:
    prompt_tokens: int
    new_tokens: int = 0
    steps: int = 0  # verification steps (the prefill's first token not counted)
    drafted: int = 0  # draft nodes sent to verification
    accepted: int = 0  # draft tokens accepted
    drafted_at: list[int] = field(default_factory=list)  # per depth
    accepted_at: list[int] = field(default_factory=list)  # per depth
    finish_reason: str = ""  # "eos", "length" or "repeat" (Request.stop_repeat)
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
    prefill_s: float = 0.0  # the target's prefill and the drafter's pass over the prompt (its start)
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


@dataclass(frozen=True)
class GenerationSummary:
    """One generation at a glance, every field with its unit in its name or comment.

    ``lossless`` is False when the verifier changes the target's distribution (``typical``):
    such results are not speculative decoding of the target and say so wherever they are read.
    Mapping access (``summary["mean_accepted_length"]``) reads :meth:`to_dict`.
    """

    drafter: str | None  # registered name; None = autoregressive decoding through the same loop
    verifier: str
    lossless: bool
    k: int  # draft tokens per step asked of the drafter; 0 for autoregressive decoding
    requests: int
    prompt_tokens: int
    new_tokens: int
    steps: int  # verification steps, summed over requests
    mean_accepted_length: float  # tokens per verification step, bonus token included (1.0 = no speculation)
    acceptance_rate: float  # accepted / drafted tokens
    acceptance_at: list[float]  # per draft depth: P(accepted | drafted that deep)
    wall_s: float
    prefill_s: float
    draft_s: float  # drafter propose + observe
    target_s: float  # target forwards after the prefill
    verify_s: float  # verification math
    other_s: float  # the loop's own overhead: wall time that is neither prefill, drafting, target forwards nor verification
    batch_steps: int  # draft → verify steps of the whole batch
    tokens_per_s: float  # new tokens / wall_s
    draft_ms_per_step: float
    verify_ms_per_step: float  # target forward + verification, per batch step
    other_ms_per_step: float  # the loop's own overhead per batch step (bookkeeping, the one host read, compaction)
    other_step_frac: float  # other_s / (wall_s - prefill_s): the loop's share of the decoding time
    policy: str | None = None  # draft-length policy (specdec.policy); None = every proposed node verified (fixed k)
    # the few-row plan the target's linear layers followed (specdec.few_rows.plan_record: source, threads,
    # row count -> product, the conditions it was measured under, its age, why, how to re-tune); None
    # where none applies (off the CPU, compiled, fast=False)
    few_rows: dict[str, Any] | None = None
    # which path each GPU kernel took, per shape bucket (specdec.kernels.choice.record: kernel, shape,
    # backend, source, both times); None where no choice was made (off the GPU, or a forced backend)
    kernels: list[dict[str, Any]] | None = None
    # how the target's steps after the prefill ran (specdec.capture): "eager", "graphs" or "compile"
    capture: str = "eager"

    @classmethod
    def of(cls, requests: list[RequestMetrics], run: RunMetrics, drafter: str | None, verifier: str,
           lossless: bool, k: int, policy: str | None = None, few_rows: dict[str, Any] | None = None,
           kernels: list[dict[str, Any]] | None = None, capture: str = "eager") -> GenerationSummary:
        per_step = 1e3 / run.batch_steps if run.batch_steps else 0.0
        decoding_s = run.wall_s - run.prefill_s
        return cls(drafter=drafter, verifier=verifier, lossless=lossless, k=k, policy=policy, few_rows=few_rows,
                   kernels=kernels or None, capture=capture,
                   prompt_tokens=sum(r.prompt_tokens for r in requests), **summarize(requests),
                   **{k_: v for k_, v in run.to_dict().items() if k_ != "new_tokens"},
                   draft_ms_per_step=run.draft_s * per_step, verify_ms_per_step=(run.target_s + run.verify_s) * per_step,
                   other_ms_per_step=run.other_s * per_step,
                   other_step_frac=run.other_s / decoding_s if decoding_s > 0 else 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_json(self, path: str | Path | None = None) -> str:
        """The summary as JSON text; written to ``path`` too when given."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __str__(self) -> str:
        lossy = "" if self.lossless else " (LOSSY verifier: not the target's distribution)"
        acc = ", ".join(f"{a:.2f}" for a in self.acceptance_at) or "-"
        k = f"k<={self.k} ({self.policy})" if self.policy else f"k={self.k}"
        return (f"{self.drafter or 'autoregressive'} / {self.verifier}{lossy}, {k}: "
                f"{self.new_tokens} tokens in {self.wall_s:.2f} s ({self.tokens_per_s:.1f} tokens/s); "
                f"mean accepted length {self.mean_accepted_length:.2f} tokens/step; acceptance by depth [{acc}]; "
                f"per step: draft {self.draft_ms_per_step:.1f} ms, verify {self.verify_ms_per_step:.1f} ms, "
                f"loop overhead {self.other_ms_per_step:.2f} ms ({self.other_step_frac:.1%})" + self._plan_text()
                + self._kernels_text())

    def _kernels_text(self) -> str:
        if not self.kernels:
            return ""
        paths = sorted({(c["kernel"], c["backend"]) for c in self.kernels})
        return "; kernels: " + ", ".join(f"{kernel} {backend}" for kernel, backend in paths)

    def _plan_text(self) -> str:
        if self.few_rows is None:
            return ""
        from specdec.few_rows import describe

        plan = ", ".join(f"{r} rows {how}" for r, how in self.few_rows["plan"].items()) or "F.linear at every row count"
        how = describe(self.few_rows) if "retune" in self.few_rows else self.few_rows["source"]  # older records
        return f"; few-row plan ({self.few_rows['threads']} threads, {how}): {plan}"

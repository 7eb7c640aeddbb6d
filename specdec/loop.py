"""The one draft → verify loop, for every drafter.

    prefill → first token → drafter.start
    repeat: drafter.propose → target.forward (chain or tree) → verifier.verify
            → target.commit (accepted path) → drafter.observe → emit, retire finished rows

Rows accept different numbers of tokens each step; the ragged KV store (:mod:`specdec.kv`)
keeps each row exact. Finished rows leave the batch at the next step, so a request that hits
EOS or its limit never touches the others. With ``drafter=None`` the same loop is plain
autoregressive decoding (an empty proposal every step), an honest baseline measured by the
same code.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from tqdm import tqdm

from specdec.drafter import Drafter
from specdec.metrics import RequestMetrics, RunMetrics
from specdec.policy import DraftPolicy, make_policy
from specdec.sampling import RowSampling, SamplingParams
from specdec.target import Target
from specdec.types import Committed, DraftProposal, Requirements, node_depths
from specdec.validate import as_int, as_token_ids
from specdec.verifier import Verifier

__all__ = ["LossyVerifierWarning", "Request", "RequestResult", "RunResult", "interactive", "run", "validate_requests"]


class LossyVerifierWarning(UserWarning):
    """A run uses a verifier that does not preserve the target's distribution."""


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class RequestResult:
    tokens: list[int]  # new tokens only (EOS included when it ended the request)
    metrics: RequestMetrics


@dataclass
class RunResult:
    requests: list[RequestResult]
    metrics: RunMetrics


def validate_requests(target: Target, drafter: Drafter | None, requests: list[Request], k: int) -> None:
    """Every bad-input error, raised before any work starts."""
    if not isinstance(requests, list) or not requests:
        raise ValueError("no requests given")
    if drafter is not None:
        as_int("k (num_speculative_tokens)", k, minimum=1)
        if getattr(drafter, "target", None) is not target:
            raise ValueError(f"drafter {drafter.name!r} is not bound to this target: call drafter.bind(target)")
        drafter.check_k(k)
    for i, r in enumerate(requests):
        if not isinstance(r, Request):
            raise TypeError(f"request {i} must be a specdec.Request, got {type(r).__name__}")
        if len(r.prompt) == 0:
            raise ValueError(f"request {i}: empty prompt")
        r.prompt = as_token_ids(f"request {i}: prompt", r.prompt, target.vocab_size)
        r.max_new_tokens = as_int(f"request {i}: max_new_tokens", r.max_new_tokens, minimum=1)
        if not isinstance(r.sampling, SamplingParams):
            raise TypeError(f"request {i}: sampling must be a SamplingParams, got {type(r.sampling).__name__}")
        need = len(r.prompt) + r.max_new_tokens + (k if drafter is not None else 0)
        if need > target.max_positions:
            raise ValueError(
                f"request {i}: prompt ({len(r.prompt)} tokens) + max_new_tokens ({r.max_new_tokens})"
                f" + drafts ({k if drafter else 0}) exceed the context window of {target.max_positions}"
            )


class _Clock:
    """Accumulates wall-clock seconds per phase (synchronising the device first)."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self) -> float:
        self.sync()
        return time.perf_counter()


def interactive() -> bool:
    """Someone is watching: stderr is a terminal, outside pytest and CI (where bars only clutter logs)."""
    return sys.stderr.isatty() and "PYTEST_CURRENT_TEST" not in os.environ and not os.environ.get("CI")


def run(target: Target, drafter: Drafter | None, verifier: Verifier, requests: list[Request], k: int = 4,
        eos_token_ids: set[int] | None = None, progress: bool | None = False,
        policy: DraftPolicy | str | None = None) -> RunResult:
    """Generate for a batch of requests. See the module docstring for the step.

    ``progress``: a tqdm bar on stderr, new tokens out of the requests' ``max_new_tokens`` in
    total; None shows it when :func:`interactive`. Off by default here, as the runner, the training
    data pipeline and the test tools call this many times (the first two with bars of their own);
    :func:`specdec.generate` shows it by default when interactive. ``policy``
    (:mod:`specdec.policy`) chooses how many of the proposed nodes each row verifies; None (or
    ``"fixed"``) verifies them all.
    """
    validate_requests(target, drafter, requests, k)
    policy = make_policy(policy)
    policy = policy if drafter is not None else None  # plain decoding has nothing to shorten
    if not verifier.lossless:
        warnings.warn(f"verifier {verifier.name!r} is lossy: the output is not distributed as the target's",
                      LossyVerifierWarning, stacklevel=2)
    rows = RowSampling([r.sampling for r in requests], target.device)
    verifier.check(rows)
    show = interactive() if progress is None else progress
    bar = tqdm(total=sum(r.max_new_tokens for r in requests), desc="generate", unit="tok", disable=not show,
               file=sys.stderr)
    with bar, target.capturing(drafter.requirements() if drafter is not None else Requirements()):
        return _generate(target, drafter, verifier, requests, k, rows, eos_token_ids, bar, policy)


def _generate(target: Target, drafter: Drafter | None, verifier: Verifier, requests: list[Request], k: int,
              rows: RowSampling, eos_token_ids: set[int] | None, bar: tqdm, policy: DraftPolicy | None) -> RunResult:
    """The loop itself, inside the target's capture scope for this run; ``bar`` counts new tokens."""
    eos = target.eos_token_ids if eos_token_ids is None else set(eos_token_ids)
    B, dev = len(requests), target.device
    clock, rm = _Clock(dev), RunMetrics()
    metrics = [RequestMetrics(prompt_tokens=len(r.prompt)) for r in requests]
    outputs: list[list[int]] = [[] for _ in requests]

    t0 = clock()
    session = target.new_session(B)
    wants_cache = drafter is not None and drafter.requirements().target_cache
    shared_cache = session.cache if wants_cache else None
    out, padded, lengths = target.prefill(session, [r.prompt for r in requests])
    first = verifier.verify(DraftProposal.empty(B, dev), out.logits, rows)
    committed = Committed(
        tokens=padded, num_tokens=lengths,
        positions=torch.arange(padded.shape[1], device=dev).expand_as(padded),
        next_tokens=first.next_tokens, active=torch.ones(B, dtype=torch.bool, device=dev),
        hidden=out.hidden, final_hidden=out.final_hidden, target_cache=shared_cache,
    )
    live = torch.arange(B)  # request index of each batch row
    active = _emit(first.tokens, first.num_emitted, live, outputs, requests, metrics, eos)
    t1 = clock()
    rm.prefill_s = t1 - t0
    bar.update(sum(len(o) for o in outputs))
    for m in metrics:
        m.ttft_s = m.latency_s = rm.prefill_s
    state = drafter.start(committed, rows) if drafter is not None else None
    chosen = policy.start(B, k) if policy is not None else None
    rm.draft_s += clock() - t1
    last = first.next_tokens

    while True:
        if not bool(active.all()):  # retire finished rows before the next step
            keep = active.nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            session.cache.select_rows(keep.to(dev))
            rows, last, live = rows.select(keep), last[keep], live[keep.cpu()]
            if drafter is not None:
                drafter.select_rows(state, keep)
        nb = live.numel()
        ta = clock()
        proposal = drafter.propose(state, k, rows) if drafter is not None else DraftProposal.empty(nb, dev)
        proposal.validate(nb, target.vocab_size)
        if policy is not None:  # before the target runs: it only shortens drafts, so it is lossless
            proposal = replace(proposal, num_valid=policy.choose(chosen, proposal, live))
        proposal = _trim(proposal)
        tb = clock()
        inputs = torch.cat([last.unsqueeze(1), proposal.tokens], dim=1)
        parents = torch.cat([torch.full((nb, 1), -1, dtype=torch.long, device=dev), proposal.parents + 1], dim=1)
        base = session.cache.lengths.clone()
        out = target.forward(session, inputs, parents)
        tc = clock()
        ver = verifier.verify(proposal, out.logits, rows)
        td = clock()

        n = proposal.n
        order = torch.cat([torch.zeros(nb, 1, dtype=torch.long, device=dev), ver.path + 1], dim=1)  # block slots, path order
        in_path = torch.arange(n + 1, device=dev).unsqueeze(0) <= ver.num_accepted.unsqueeze(1)
        order = torch.where(in_path, order, 0)
        # Slots off the path scatter into a spare column n+1, then dropped (duplicates would race).
        keep = torch.zeros(nb, n + 2, dtype=torch.bool, device=dev)
        keep = keep.scatter_(1, torch.where(in_path, order, n + 1), True)[:, : n + 1]
        target.commit(session, keep)
        active = _emit(ver.tokens, ver.num_emitted, live, outputs, requests, metrics, eos)
        bar.update(sum(len(o) for o in outputs) - bar.n)
        _record(metrics, live, proposal, ver.num_accepted)
        committed = Committed(
            tokens=torch.where(in_path, inputs.gather(1, order), -1), num_tokens=ver.num_accepted + 1,
            positions=base.unsqueeze(1) + torch.arange(n + 1, device=dev), next_tokens=ver.next_tokens,
            active=active.to(dev), hidden={i: _gather(h, order) for i, h in out.hidden.items()},
            final_hidden=None if out.final_hidden is None else _gather(out.final_hidden, order),
            verification=ver, target_cache=shared_cache,
        )
        te = clock()
        if drafter is not None:
            drafter.observe(state, committed)
        tf = clock()
        if policy is not None:
            policy.observe(chosen, proposal, ver.num_accepted, live, (tb - ta) + (tf - te), td - tb)
        last = ver.next_tokens
        session.cache.maybe_compact()
        tg = clock()
        rm.draft_s += (tb - ta) + (tf - te)
        rm.target_s += tc - tb
        rm.verify_s += td - tc
        rm.batch_steps += 1
        for i in live[~active].tolist():
            metrics[i].latency_s = tg - t0
    rm.wall_s = clock() - t0
    rm.new_tokens = sum(len(o) for o in outputs)
    return RunResult([RequestResult(o, m) for o, m in zip(outputs, metrics)], rm)


def _trim(proposal: DraftProposal) -> DraftProposal:
    """Drop trailing nodes no row verifies (they would only cost target compute)."""
    assert proposal.num_valid is not None
    n = int(proposal.num_valid.max()) if proposal.n else 0
    if n == proposal.n:
        return proposal
    q = None if proposal.q is None else proposal.q[:, :n]
    conf = None if proposal.confidence is None else proposal.confidence[:, :n]
    return replace(proposal, tokens=proposal.tokens[:, :n], parents=proposal.parents[:, :n], q=q, confidence=conf)


def _gather(h: Tensor, order: Tensor) -> Tensor:
    return h.gather(1, order.unsqueeze(-1).expand(-1, -1, h.shape[-1]))


def _emit(tokens: Tensor, counts: Tensor, live: Tensor, outputs: list[list[int]], requests: list[Request],
          metrics: list[RequestMetrics], eos: set[int]) -> Tensor:
    """Append each row's emitted tokens, stopping at EOS or the limit. Returns rows still active."""
    active = torch.ones(len(live), dtype=torch.bool)
    for b, (i, row, c) in enumerate(zip(live.tolist(), tokens.tolist(), counts.tolist())):
        out, limit = outputs[i], requests[i].max_new_tokens
        for t in row[:c]:
            out.append(t)
            if t in eos or len(out) >= limit:
                metrics[i].finish_reason = "eos" if t in eos else "length"
                active[b] = False
                break
        metrics[i].new_tokens = len(out)
    return active


def _record(metrics: list[RequestMetrics], live: Tensor, proposal: DraftProposal, num_accepted: Tensor) -> None:
    """Per-depth drafted/accepted counts for each row of this step."""
    assert proposal.num_valid is not None
    if proposal.n:
        valid = torch.arange(proposal.n, device=proposal.tokens.device).unsqueeze(0) < proposal.num_valid.unsqueeze(1)
        depth = torch.where(valid, node_depths(proposal.parents), 0).max(1).values.tolist()
    else:
        depth = [0] * len(live)
    for i, d, a, v in zip(live.tolist(), depth, num_accepted.tolist(), proposal.num_valid.tolist()):
        metrics[i].record(d, a, v)

"""The one draft → verify loop, for every drafter.

    prefill → first token → drafter.start
    repeat: drafter.propose → target.forward (chain or tree) → verifier.verify
            → target.commit (accepted path) → drafter.observe → emit, retire finished rows

Rows accept different numbers of tokens each step; the ragged KV store (:mod:`specdec.kv`)
keeps each row exact. Finished rows leave the batch at the next step, so a request that hits
EOS or its limit never touches the others. With ``drafter=None`` the same loop is plain
autoregressive decoding (an empty proposal every step), an honest baseline measured by the
same code.

**One device→host read per step**: the accepted counts, with the emitted tokens, the depths the
metrics record and the proposal's value checks, in one transfer after verification. Everything
else the loop decides on is known on the host (the rows' committed lengths, which rows are
active, whether a proposal is a chain); a drafter that sets ``num_valid`` costs one more read
(:func:`_trim`). Phase timings synchronise the device only when ``run(timed=True)`` asks.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm import tqdm

from specdec.drafter import Drafter
from specdec.metrics import RequestMetrics, RunMetrics
from specdec.policy import DraftPolicy, make_policy, pinned_rows
from specdec.sampling import RowSampling, SamplingParams
from specdec.target import Target
from specdec.timing import now
from specdec.types import Committed, DraftProposal, Requirements, node_depths
from specdec.validate import as_int, as_token_ids
from specdec.verifier import Verifier

__all__ = ["LossyVerifierWarning", "Request", "RequestResult", "RunResult", "interactive", "run", "validate_requests"]


class LossyVerifierWarning(UserWarning):
    """A run uses a verifier that does not preserve the target's distribution."""


_WARNED_LOSSY: set[str] = set()  # lossy verifiers already warned about in this process: once is enough


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_repeat: int = 0  # N > 0: end the answer at the token that completes an N-gram it already wrote (a loop)


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
        r.stop_repeat = as_int(f"request {i}: stop_repeat", r.stop_repeat, minimum=0)
        if not isinstance(r.sampling, SamplingParams):
            raise TypeError(f"request {i}: sampling must be a SamplingParams, got {type(r.sampling).__name__}")
        need = len(r.prompt) + r.max_new_tokens + (k if drafter is not None else 0)
        if need > target.max_positions:
            raise ValueError(
                f"request {i}: prompt ({len(r.prompt)} tokens) + max_new_tokens ({r.max_new_tokens})"
                f" + drafts ({k if drafter else 0}) exceed the context window of {target.max_positions}"
            )


class _Clock:
    """Wall-clock time at phase boundaries. ``timed`` synchronises the device at every boundary,
    so the phase split is exact on an asynchronous device at the cost of a wait per phase;
    otherwise only the run's end waits for the device, and the phases time the host's dispatch
    (the device's work then lands wherever the host next waits: the step's one read)."""

    def __init__(self, device: torch.device, timed: bool):
        self.device, self.timed = device, timed

    def __call__(self, final: bool = False) -> float:
        return now(self.device if self.timed or final else None)


def interactive() -> bool:
    """Someone is watching: stderr is a terminal, outside pytest and CI (where bars only clutter logs)."""
    return sys.stderr.isatty() and "PYTEST_CURRENT_TEST" not in os.environ and not os.environ.get("CI")


def run(target: Target, drafter: Drafter | None, verifier: Verifier, requests: list[Request], k: int = 4,
        eos_token_ids: set[int] | None = None, progress: bool | None = False,
        policy: DraftPolicy | str | None = None, timed: bool = False, max_batch: int | None = None) -> RunResult:
    """Generate for a batch of requests. See the module docstring for the step.

    ``progress``: a tqdm bar on stderr, new tokens out of the requests' ``max_new_tokens`` in
    total; None shows it when :func:`interactive`. Off by default here, as the runner, the training
    data pipeline and the test tools call this many times (the first two with bars of their own);
    :func:`specdec.generate` shows it by default when interactive. ``policy``
    (:mod:`specdec.policy`) chooses how many of the proposed nodes each row verifies; None (or
    ``"fixed"``) verifies them all. ``timed`` synchronises the device at every phase boundary, for
    an exact time split. ``max_batch``: continuous batching for plain decoding (``drafter=None``):
    at most this many requests decode at once, in the given order, and a finished row's place is
    refilled from the requests still waiting (admitted a few at a time, once a :data:`ADMIT_SHARE`-th
    of the batch is free, with one prefill), so the batch stays full instead of shrinking to its longest answer.
    Each request's tokens are what it gets in any batch (seeded rows exactly; greedy rows up to the
    batch's floating-point order, as everywhere).
    """
    validate_requests(target, drafter, requests, k)
    if max_batch is not None:
        as_int("max_batch", max_batch, minimum=1)
        if drafter is not None and max_batch < len(requests):
            raise ValueError(f"max_batch={max_batch} < {len(requests)} requests: continuous batching runs plain "
                             "decoding (drafter=None); a drafter's state takes no new rows mid-run")
    policy = make_policy(policy)
    policy = policy if drafter is not None else None  # plain decoding has nothing to shorten
    if not verifier.lossless and verifier.name not in _WARNED_LOSSY:  # once per process; every summary says so
        _WARNED_LOSSY.add(verifier.name)
        warnings.warn(f"verifier {verifier.name!r} is lossy: the output is not distributed as the target's"
                      " (said once per process; every summary marks its runs lossy)", LossyVerifierWarning, stacklevel=2)
    rows = RowSampling([r.sampling for r in requests], target.device)
    verifier.check(rows)
    show = interactive() if progress is None else progress
    bar = tqdm(total=sum(r.max_new_tokens for r in requests), desc="generate", unit="tok", disable=not show,
               file=sys.stderr)
    with bar, target.capturing(drafter.requirements() if drafter is not None else Requirements()):
        return _generate(target, drafter, verifier, requests, k, rows, eos_token_ids, bar, policy, timed,
                         len(requests) if max_batch is None else min(max_batch, len(requests)))


ADMIT_SHARE = 8  # continuous batching admits waiting requests once 1/8 of the batch is free (or none runs)


def _generate(target: Target, drafter: Drafter | None, verifier: Verifier, requests: list[Request], k: int,
              all_rows: RowSampling, eos_token_ids: set[int] | None, bar: tqdm, policy: DraftPolicy | None,
              timed: bool, max_batch: int) -> RunResult:
    """The loop itself, inside the target's capture scope for this run; ``bar`` counts new tokens.
    The first ``max_batch`` requests start; the rest wait for rows (plain decoding only)."""
    eos = target.eos_token_ids if eos_token_ids is None else set(eos_token_ids)
    B, dev, V = max_batch, target.device, target.vocab_size
    waiting = list(range(len(requests) - 1, B - 1, -1))  # request ids not yet admitted, next one last
    rows = all_rows if B == len(requests) else all_rows.select(list(range(B)))
    clock, rm = _Clock(dev, timed), RunMetrics()
    metrics = [RequestMetrics(prompt_tokens=len(r.prompt)) for r in requests]
    outputs: list[list[int]] = [[] for _ in requests]
    seen: list[set[tuple[int, ...]]] = [set() for _ in requests]  # each answer's N-grams (stop_repeat)

    t0 = clock()
    # the slots a dense run can reach: the longest prompt and new tokens, and a chain block past them
    # (trees and holes may need more: the store then grows past it a block at a time)
    room = max(len(r.prompt) for r in requests[:B]) + max(r.max_new_tokens for r in requests[:B])
    room += k + 1 if drafter is not None else 0
    session = target.new_session(B, reserve=room)
    wants_cache = drafter is not None and drafter.requirements().target_cache
    shared_cache = session.cache if wants_cache else None
    out, padded, lengths = target.prefill(session, [r.prompt for r in requests[:B]])
    first = verifier.verify(DraftProposal.empty(B, dev), out.logits, rows)
    committed = Committed(
        tokens=padded, num_tokens=lengths,
        positions=torch.arange(padded.shape[1], device=dev).expand_as(padded),
        next_tokens=first.next_tokens, active=torch.ones(B, dtype=torch.bool, device=dev),
        hidden=out.hidden, final_hidden=out.final_hidden, target_cache=shared_cache,
    )
    live = list(range(B))  # request index of each batch row
    committed_len = [len(r.prompt) for r in requests[:B]]  # each row's committed tokens, known on the host
    active = _emit(first.tokens[:, :1].tolist(), [1] * B, live, outputs, requests, metrics, eos, seen)
    t1 = clock()
    rm.prefill_s = t1 - t0
    bar.update(sum(len(o) for o in outputs))
    for m in metrics[:B]:
        m.ttft_s = m.latency_s = rm.prefill_s
    # the drafter's pass over the prompt (EAGLE-3 and the block drafters read the target's features
    # of every prompt token) is prefill: it runs once, as one block over the whole prompt, right after
    # the target's (it reads that pass's features, so it cannot run inside it); TTFT is the target's
    state = drafter.start(committed, rows) if drafter is not None else None
    chosen = policy.start(B, k) if policy is not None else None
    rm.prefill_s += clock() - t1
    last = first.next_tokens
    admit_at = max(1, B // ADMIT_SHARE)  # free rows that make a refill worth its prefill

    while True:
        free = B - sum(active)
        while not all(active) or (waiting and free >= admit_at):
            kept = [b for b, a in enumerate(active) if a]  # retire finished rows before the next step
            if not kept and not waiting:
                break
            if len(kept) < len(active):
                keep_rows = torch.tensor(kept, dtype=torch.long, device="cpu")  # the drafters' selection is a host tensor
                on_dev = _upload(keep_rows, dev)
                session.cache.select_rows(keep_rows)
                rows, last = rows.select(kept), last[on_dev]
                live, committed_len = [live[b] for b in kept], [committed_len[b] for b in kept]
                active = [True] * len(kept)
                if drafter is not None:
                    drafter.select_rows(state, keep_rows)
            free = B - len(live)
            if waiting and (free >= admit_at or not live):  # refill (plain decoding only)
                ta = clock()
                ids = [waiting.pop() for _ in range(min(free, len(waiting)))]
                new_rows = all_rows.select(ids)
                out, _, _ = target.admit(session, [requests[i].prompt for i in ids])
                first = verifier.verify(DraftProposal.empty(len(ids), dev), out.logits, new_rows)
                rows, last = rows.joined(new_rows), torch.cat([last, first.next_tokens])
                live, committed_len = live + ids, committed_len + [len(requests[i].prompt) for i in ids]
                active += _emit(first.tokens[:, :1].tolist(), [1] * len(ids), ids, outputs, requests, metrics, eos, seen)
                tb = clock()
                rm.prefill_s += tb - ta
                bar.update(sum(len(o) for o in outputs) - bar.n)
                for i in ids:
                    metrics[i].ttft_s = metrics[i].latency_s = tb - t0
        if not live or not all(active):
            break
        nb = len(live)
        ta = clock()
        live_ids = torch.tensor(live, device="cpu") if policy is not None else None  # [nb] request ids (host)
        pinned = pinned_rows(policy, rows)  # seeded sampled rows the policy must not move, or None
        skip = policy is not None and policy.skip(chosen, k, live_ids) and pinned is None  # a plain step
        proposal = drafter.propose(state, k, rows) if drafter is not None and not skip else DraftProposal.empty(nb, dev)
        proposal.check_shapes(nb, V)
        bad = proposal.invalid(V)  # read with the step's one synchronisation, below
        if policy is not None:  # before the target runs: it only shortens drafts, so it is lossless
            nv = policy.choose(chosen, proposal, live_ids)
            if pinned is not None:  # a seeded row verifies its whole draft, as it would in any batch
                nv = torch.where(_upload(pinned, nv.device), proposal.num_valid, nv)
            proposal = proposal.with_num_valid(nv)
        proposal = _trim(proposal)
        tb = clock()
        n = proposal.n
        inputs = torch.cat([last.unsqueeze(1), proposal.tokens.clamp(0, V - 1)], dim=1)  # a bad id fails below, not in the embedding
        parents = None if proposal.is_chain else torch.cat(
            [torch.full((nb, 1), -1, dtype=torch.long, device=dev), proposal.parents.clamp(-1, max(n - 1, 0)) + 1], dim=1)
        base = session.cache.lengths
        out = target.forward(session, inputs, parents)
        tc = clock()
        ver = verifier.verify(proposal, out.logits, rows)
        td = clock()

        # The step's one device→host read: accepted counts, depths, num_valid, the checks, emitted tokens.
        read = torch.cat([torch.stack([ver.num_accepted, _depths(proposal), proposal.num_valid,
                                       bad.long().expand(nb)], 1), ver.tokens], 1).tolist()
        if any(r[3] for r in read):
            proposal.validate(nb, V)  # raises, naming what is wrong
        accepted = [r[0] for r in read]
        order = torch.cat([torch.zeros(nb, 1, dtype=torch.long, device=dev), ver.path + 1], dim=1)  # block slots, path order
        in_path = torch.arange(n + 1, device=dev).unsqueeze(0) <= ver.num_accepted.unsqueeze(1)
        order = torch.where(in_path, order, 0)
        if all(a == n for a in accepted):
            target.commit(session, None)  # the whole block: a dense store stays dense
        elif proposal.is_chain and len(set(accepted)) == 1:
            target.commit(session, accepted[0] + 1)  # the same prefix of a chain in every row (batch 1): still dense
        else:
            # Slots off the path scatter into a spare column n+1, then dropped (duplicates would race).
            keep = torch.zeros(nb, n + 2, dtype=torch.bool, device=dev)
            target.commit(session, keep.scatter_(1, torch.where(in_path, order, n + 1), True)[:, : n + 1])
        active = _emit([r[4:] for r in read], [a + 1 for a in accepted], live, outputs, requests, metrics, eos, seen)
        bar.update(sum(len(o) for o in outputs) - bar.n)
        for b, (i, r) in enumerate(zip(live, read)):
            metrics[i].record(r[1], r[0], r[2])
            committed_len[b] += r[0] + 1
        committed = Committed(
            tokens=torch.where(in_path, inputs.gather(1, order), -1), num_tokens=ver.num_accepted + 1,
            positions=base.unsqueeze(1) + torch.arange(n + 1, device=dev), next_tokens=ver.next_tokens,
            active=_upload(torch.tensor(active, device="cpu"), dev), hidden={i: _gather(h, order) for i, h in out.hidden.items()},
            final_hidden=None if out.final_hidden is None else _gather(out.final_hidden, order),
            verification=ver, target_cache=shared_cache,
        )
        te = clock()
        if drafter is not None:
            drafter.observe(state, committed)
        tf = clock()
        if policy is not None:
            policy.observe(chosen, proposal, ver.num_accepted, live_ids, (tb - ta) + (tf - te), td - tb)
        last = ver.next_tokens
        session.cache.maybe_compact(committed_len)
        tg = clock()
        rm.draft_s += (tb - ta) + (tf - te)
        rm.target_s += tc - tb
        rm.verify_s += td - tc
        rm.batch_steps += 1
        for i, a in zip(live, active):
            if not a:
                metrics[i].latency_s = tg - t0
    rm.wall_s = clock(final=True) - t0
    rm.new_tokens = sum(len(o) for o in outputs)
    return RunResult([RequestResult(o, m) for o, m in zip(outputs, metrics)], rm)


def _upload(x: Tensor, device: torch.device) -> Tensor:
    """A host tensor on the device, without waiting for the device's queue (pinned memory and
    a non-blocking copy on CUDA; a plain copy elsewhere)."""
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def _trim(proposal: DraftProposal) -> DraftProposal:
    """Drop trailing nodes no row verifies (they would only cost target compute). A proposal whose
    ``num_valid`` the drafter set costs a device read here; one that left it full does not."""
    assert proposal.num_valid is not None
    if proposal.all_valid or not proposal.n:
        return proposal
    n = int(proposal.num_valid.max())
    if n == proposal.n:
        return proposal
    q = None if proposal.q is None else proposal.q[:, :n]
    conf = None if proposal.confidence is None else proposal.confidence[:, :n]
    trimmed = DraftProposal(proposal.tokens[:, :n], proposal.parents[:, :n], q, proposal.num_valid, conf)
    trimmed.is_chain = proposal.is_chain
    return trimmed


def _depths(proposal: DraftProposal) -> Tensor:
    """The depth each row drafted to (its deepest valid node; a chain's is its length). [B]"""
    assert proposal.num_valid is not None
    if proposal.is_chain or not proposal.n:
        return proposal.num_valid.clamp(0, proposal.n)
    valid = torch.arange(proposal.n, device=proposal.tokens.device).unsqueeze(0) < proposal.num_valid.unsqueeze(1)
    return torch.where(valid, node_depths(proposal.parents.clamp(-1, proposal.n - 1)), 0).max(1).values


def _gather(h: Tensor, order: Tensor) -> Tensor:
    return h.gather(1, order.unsqueeze(-1).expand(-1, -1, h.shape[-1]))


def _emit(tokens: list[list[int]], counts: list[int], live: list[int], outputs: list[list[int]],
          requests: list[Request], metrics: list[RequestMetrics], eos: set[int],
          seen: list[set[tuple[int, ...]]]) -> list[bool]:
    """Append each row's emitted tokens, stopping at EOS, the limit or a repeated N-gram
    (``stop_repeat``, whose earlier copies ``seen`` holds). Returns rows still active."""
    active = [True] * len(live)
    for b, (i, row, c) in enumerate(zip(live, tokens, counts)):
        out, limit, n = outputs[i], requests[i].max_new_tokens, requests[i].stop_repeat
        for t in row[:c]:
            out.append(t)
            repeat = False
            if n and len(out) >= n:
                gram = tuple(out[-n:])
                repeat = gram in seen[i]
                seen[i].add(gram)
            if t in eos or len(out) >= limit or repeat:
                metrics[i].finish_reason = "eos" if t in eos else "length" if len(out) >= limit else "repeat"
                active[b] = False
                break
        metrics[i].new_tokens = len(out)
    return active

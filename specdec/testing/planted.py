"""A drafter whose acceptance is planted, not learned: for systems benchmarks of the loop.

:class:`PlantedDrafter` proposes the target's own greedy continuation of each prompt (computed
first, by plain decoding), with proposed tokens replaced by wrong ones: each position the walk
reaches is accepted with probability ``p`` (``pattern="random"``, seeded), or accepted in a share
``p`` of the times it is reached, to within half a trial (``pattern="even"``). The loop's costs can
then be measured at any acceptance on a random-weight target of real size. Deterministic
(``q = None``), so any lossless verifier keeps the target's output.

The measured acceptance equals the planted one only while the verify forward's argmax agrees with
the plain decoding's. A random-weight model's logits are close to Gaussian over the vocabulary: the
top two are a few percent of their size apart, and a block forward's rounding differs from a
one-token forward's by about as much in bf16, so its greedy choice flips every few tokens and the
planted continuation is lost from there on. Scaling the head changes nothing (gap and rounding
scale alike). :func:`separate_choices` gives such a model choices with a structural margin instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specdec.drafter import Drafter
from specdec.sampling import RowSampling
from specdec.target import Target
from specdec.types import Committed, DraftProposal, padded_ids

__all__ = ["PlantedDrafter", "greedy_continuations", "separate_choices", "choice_margin"]


@torch.no_grad()
def separate_choices(target: Target, seed: int = 0, dominance: float = 16.0) -> None:
    """Give a random-weight target well-separated greedy choices, in place: the token after ``x``
    is ``π(x)`` for a seeded permutation ``π`` of the vocabulary, by a margin no rounding reaches.

    The input embeddings are redrawn ``dominance`` times larger (per element, RMS) than what the
    decoder layers add to the residual stream (measured on a random block first), so the final
    hidden state points along the current token's embedding; the head's row for ``π(x)`` is that
    embedding's direction. The top logit is then ``≈ √D`` times the final norm's scale, every other
    one a random projection of size ``≈ 1`` (``√(2 ln V)`` at most): with D = 4096 a margin of ~90%
    of the top logit, far beyond bf16 rounding (0.4%). The layers, shapes and costs are untouched
    (each layer normalises its input), so the target still measures what a forward costs. Needs an
    untied head (a tied one would be the embeddings themselves)."""
    emb, head = target.embed_tokens.weight, target.lm_head.weight
    if emb.data_ptr() == head.data_ptr():
        raise ValueError("separate_choices needs a head that is not tied to the input embeddings")
    V, dev = emb.shape[0], emb.device
    g = torch.Generator(device="cpu").manual_seed(seed)
    probe = torch.randint(0, V, (1, 32), generator=g).to(dev)
    seen: dict[str, Tensor] = {}
    hook = target.final_norm.register_forward_pre_hook(lambda m, args: seen.setdefault("last", args[0]))
    try:
        target.decoder(input_ids=probe, use_cache=False)
    finally:
        hook.remove()
    added = (seen["last"] - target.embed(probe)).float().pow(2).mean().sqrt()  # RMS of what the layers add
    gen = torch.Generator(device=dev).manual_seed(seed)
    emb.normal_(0.0, float(dominance * added), generator=gen)
    follows = torch.randperm(V, generator=g).to(dev)  # π: token x is followed by follows[x]
    unit = emb.float() / emb.float().norm(dim=-1, keepdim=True)
    head.zero_()
    head[follows] = unit.to(head.dtype)
    bias = getattr(target.lm_head, "bias", None)
    if bias is not None:
        bias.zero_()


@torch.inference_mode()
def choice_margin(logits: Tensor) -> Tensor:
    """(top logit − runner-up) / |top logit| per position: how far a greedy choice is from a tie. [..]"""
    top = logits.float().topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1]) / top[..., 0].abs().clamp_min(1e-30)


@torch.inference_mode()
def greedy_continuations(target: Target, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The first ``n`` argmax tokens after each prompt, one token per forward (no EOS stop)."""
    session = target.new_session(len(prompts))
    out, _, _ = target.prefill(session, prompts)
    nxt = out.logits[:, -1].argmax(-1)  # [B]
    tokens = [nxt]
    for _ in range(n - 1):
        out = target.forward(session, nxt.unsqueeze(1))
        target.commit(session, torch.ones(len(prompts), 1, dtype=torch.bool, device=target.device))
        nxt = out.logits[:, -1].argmax(-1)
        tokens.append(nxt)
    return torch.stack(tokens, 1).tolist()


@dataclass
class _Row:
    reference: list[int]  # the greedy continuation; reference[0] is the prefill's token
    pos: int  # tokens emitted so far: the next draft starts at reference[pos]
    plan: list[bool] = field(default_factory=list)  # "even": the outcomes planted at the positions the walk reaches


class _State(list):
    """The rows (a list, as the loop's row selection expects) and, for ``pattern="even"``, each draft
    position's credit: a reached position is right when its credit, plus p, reaches 1."""

    def __init__(self, rows: list[_Row]):
        super().__init__(rows)
        self.credit: list[float] = []


PATTERNS = ("random", "even")


class PlantedDrafter(Drafter):
    name = "planted"

    def __init__(self, p: float, continuations: dict[tuple[int, ...], list[int]] | None = None,
                 horizon: int = 64, seed: int = 0, pattern: str = "random"):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must lie in [0, 1], got {p}")
        if pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
        self.p, self.continuations, self.horizon, self.pattern = p, dict(continuations or {}), horizon, pattern
        self.generator = torch.Generator().manual_seed(seed)

    def start(self, prefill: Committed, rows: RowSampling) -> _State:
        prompts = [tuple(t[:n]) for t, n in zip(prefill.tokens.tolist(), prefill.num_tokens.tolist())]
        missing = sorted({p for p in prompts if p not in self.continuations})
        if missing:  # not given: plain greedy decoding of those prompts, now
            for p, cont in zip(missing, greedy_continuations(self.target, [list(p) for p in missing], self.horizon)):
                self.continuations[p] = cont
        return _State([_Row(self.continuations[p], 1) for p in prompts])

    def _even(self, state: _State, lengths: list[int], k: int) -> Tensor:
        """[B, k] bool: which drafts are right, each reached position right in a share p of the times
        it is reached (to within half a trial over the run, rows taken in turn). A row's walk reaches
        position d only when every earlier draft is right, so its positions past the first wrong one
        are left wrong and spend no credit."""
        state.credit += [0.5] * (k - len(state.credit))
        for row, n in zip(state, lengths):
            row.plan = []
            for d in range(n):
                state.credit[d] += self.p
                ok = state.credit[d] >= 1.0
                state.credit[d] -= ok
                row.plan.append(ok)
                if not ok:
                    break
        return torch.tensor([row.plan + [False] * (k - len(row.plan)) for row in state], dtype=torch.bool).view(-1, k)

    def propose(self, state: _State, k: int, rows: RowSampling) -> DraftProposal:
        B, V, host = len(state), self.target.vocab_size, self.generator.device  # drafted on the host
        refs = [row.reference[row.pos:row.pos + k] for row in state]
        tokens = padded_ids(refs, k, 0, host)
        num_valid = torch.tensor([len(r) for r in refs], dtype=torch.long, device=host)
        wrong = (tokens + torch.randint(1, V, (B, k), generator=self.generator, device=host)) % V  # never the reference
        if self.pattern == "even":
            corrupt = ~self._even(state, [len(r) for r in refs], k)
        else:
            corrupt = torch.rand(B, k, generator=self.generator, device=host) >= self.p
        tokens = torch.where(corrupt, wrong, tokens)
        dev = self.target.device
        # the planted acceptance, known exactly: p at every position (what a prefix policy schedules by)
        confidence = torch.full((B, k), self.p, device=dev)
        return DraftProposal.chain(tokens.to(dev), None, num_valid.to(dev), confidence)

    def observe(self, state: _State, committed: Committed) -> None:
        for row, n in zip(state, committed.num_tokens.tolist()):
            row.pos += n
            # "even": a draft-length policy that verified fewer drafts than the walk would have reached
            # left those positions untested (a right draft is always accepted): their credit goes back
            leading = next((d for d, ok in enumerate(row.plan) if not ok), len(row.plan))
            if n - 1 < leading:
                for d in range(n - 1, len(row.plan)):
                    state.credit[d] += row.plan[d] - self.p
            row.plan = []

    def select_rows(self, state: _State, rows: Tensor) -> None:
        state[:] = [state[i] for i in rows.tolist()]

    @classmethod
    def create(cls, target: Target, **options: Any) -> PlantedDrafter:
        """Options: ``p`` (acceptance per position), ``continuations`` (prompt tuple → greedy
        tokens; missing prompts are decoded at start), ``horizon``, ``seed``, ``pattern``
        (``"random"``: each reached position right with probability p; ``"even"``: right in a share
        p of the times it is reached)."""
        d = cls(**options)
        d.bind(target)
        return d

    @classmethod
    def tiny(cls, target: Target, **overrides: Any) -> PlantedDrafter:
        return cls.create(target, **{"p": 0.7, **overrides})

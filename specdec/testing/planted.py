"""A drafter whose acceptance is planted, not learned: for systems benchmarks of the loop.

:class:`PlantedDrafter` proposes the target's own greedy continuation of each prompt (computed
first, by plain decoding), with every proposed token replaced by a wrong one with probability
``1 − p`` (seeded). Under greedy verification each position the walk reaches is then accepted
with probability ``p``, whatever the model: the loop's costs can be measured at any acceptance on
a random-weight target of real size. Deterministic (``q = None``), so any lossless verifier keeps
the target's output; the measured acceptance equals ``p`` only while the verify forward's argmax
agrees with the plain decoding's (exactly in float32; bf16 near-ties can differ).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specdec.drafter import Drafter
from specdec.sampling import RowSampling
from specdec.target import Target
from specdec.types import Committed, DraftProposal, padded_ids

__all__ = ["PlantedDrafter", "greedy_continuations"]


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


class PlantedDrafter(Drafter):
    name = "planted"

    def __init__(self, p: float, continuations: dict[tuple[int, ...], list[int]] | None = None,
                 horizon: int = 64, seed: int = 0):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must lie in [0, 1], got {p}")
        self.p, self.continuations, self.horizon = p, dict(continuations or {}), horizon
        self.generator = torch.Generator().manual_seed(seed)

    def start(self, prefill: Committed, rows: RowSampling) -> list[_Row]:
        prompts = [tuple(t[:n]) for t, n in zip(prefill.tokens.tolist(), prefill.num_tokens.tolist())]
        missing = sorted({p for p in prompts if p not in self.continuations})
        if missing:  # not given: plain greedy decoding of those prompts, now
            for p, cont in zip(missing, greedy_continuations(self.target, [list(p) for p in missing], self.horizon)):
                self.continuations[p] = cont
        return [_Row(self.continuations[p], 1) for p in prompts]

    def propose(self, state: list[_Row], k: int, rows: RowSampling) -> DraftProposal:
        B, V, host = len(state), self.target.vocab_size, self.generator.device  # drafted on the host
        refs = [row.reference[row.pos:row.pos + k] for row in state]
        tokens = padded_ids(refs, k, 0, host)
        num_valid = torch.tensor([len(r) for r in refs], dtype=torch.long, device=host)
        wrong = (tokens + torch.randint(1, V, (B, k), generator=self.generator, device=host)) % V  # never the reference
        corrupt = torch.rand(B, k, generator=self.generator, device=host) >= self.p
        tokens = torch.where(corrupt, wrong, tokens)
        dev = self.target.device
        # the planted acceptance, known exactly: p at every position (what a prefix policy schedules by)
        confidence = torch.full((B, k), self.p, device=dev)
        return DraftProposal.chain(tokens.to(dev), None, num_valid.to(dev), confidence)

    def observe(self, state: list[_Row], committed: Committed) -> None:
        for row, n in zip(state, committed.num_tokens.tolist()):
            row.pos += n

    def select_rows(self, state: list[_Row], rows: Tensor) -> None:
        state[:] = [state[i] for i in rows.tolist()]

    @classmethod
    def create(cls, target: Target, **options: Any) -> PlantedDrafter:
        """Options: ``p`` (acceptance per position), ``continuations`` (prompt tuple → greedy
        tokens; missing prompts are decoded at start), ``horizon``, ``seed``."""
        d = cls(**options)
        d.bind(target)
        return d

    @classmethod
    def tiny(cls, target: Target, **overrides: Any) -> PlantedDrafter:
        return cls.create(target, **{"p": 0.7, **overrides})

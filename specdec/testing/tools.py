"""Conformance tools: what the test suite runs on every drafter, usable on a new one.

- :func:`chi_square` — a goodness-of-fit p-value against a known distribution (torch only).
- :func:`greedy_reference` and :func:`assert_greedy_equivalent` — the target's own greedy
  decoding, and equality up to exact-tie flips (a divergence is accepted only where the target's
  scores for the two tokens are allclose, as transformers' ``_check_similar_generate_outputs``).
- :func:`sampled_gof` — sample many rows of one prompt through the loop and test every emitted
  position against the target's exact distribution *conditioned on the sampled prefix*.
- :func:`q_contract` — the q a drafter returns is the distribution it sampled from.
- :class:`RandomDrafter` — an adversarial drafter: random chains or trees, with i.i.d.,
  without-replacement or deterministic siblings and random (but exactly reported) q.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache

from specdec.drafter import Drafter
from specdec.loop import LossyVerifierWarning, Request, run
from specdec.policy import DraftPolicy
from specdec.sampling import RowSampling, SamplingParams
from specdec.target import Target
from specdec.transformers_versions import CACHE_ARG, cache_kwargs
from specdec.types import Committed, DraftProposal
from specdec.verifier import Verifier

__all__ = ["chi_square", "greedy_reference", "assert_greedy_equivalent", "assert_batch_independent", "sampled_gof",
           "q_contract", "RandomDrafter", "Recording", "tree_parents"]


def chi_square(counts: Tensor, probs: Tensor, min_expected: float = 5.0) -> float:
    """Pearson χ² p-value of ``counts`` [V] against ``probs`` [V].

    Bins with expected count below ``min_expected`` are pooled (the χ² approximation needs it).
    A count in a zero-probability bin gives p = 0: that is an impossible token, not noise.
    """
    counts, probs = counts.double(), probs.double() / probs.sum()
    n = counts.sum()
    if bool(((probs == 0) & (counts > 0)).any()):
        return 0.0
    expected = probs * n
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if obs.numel() < 2:
        return 1.0
    if exp[-1] < min_expected and obs.numel() > 2:  # pooled tail still too small: fold it in
        obs = torch.cat([obs[:-2], (obs[-2] + obs[-1]).view(1)])
        exp = torch.cat([exp[:-2], (exp[-2] + exp[-1]).view(1)])
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), stat / 2))


@torch.inference_mode()
def greedy_reference(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], Tensor]:
    """The target's own greedy decoding, one token per forward with a stock ``DynamicCache``
    (no logits processors, no EOS), and the raw logits at every step. [T], [T, V]"""
    cache = DynamicCache()
    ids = torch.tensor([prompt], device=model.device)
    tokens, logits = [], []
    for t in range(max_new_tokens):
        step = model(input_ids=ids, **cache_kwargs(cache), use_cache=True).logits[0, -1].float()
        if cache.get_seq_length() != len(prompt) + t:  # a cache argument the model swallowed: a wrong reference
            raise RuntimeError(f"{type(model).__name__} did not fill the DynamicCache passed as {CACHE_ARG}= "
                               f"(specdec.transformers_versions)")
        logits.append(step)
        tokens.append(int(step.argmax()))
        ids = torch.tensor([[tokens[-1]]], device=model.device)
    return tokens, torch.stack(logits)


def assert_batch_independent(alone: list[int], batched: list[int], row: int, batch: int) -> None:
    """Fail, saying where and what it means, unless request ``row`` of a batch of ``batch`` gave the
    tokens it gave alone (``alone``, ``batched``: its new tokens)."""
    if batched == alone:
        return
    i = next((i for i, (a, b) in enumerate(zip(alone, batched)) if a != b), min(len(alone), len(batched)))
    raise AssertionError(
        f"batch independence: request {row} of a batch of {batch} gave other tokens than the same request alone,"
        f" from new token {i} on (alone {alone[i:i + 4]}, in the batch {batched[i:i + 4]}; {len(alone)} and"
        f" {len(batched)} tokens in all). A row's output may not depend on the rows beside it: the drafter's"
        " proposal or state for one row reads another row's (a reduction over the batch, a counter or cache"
        " shared by the rows, one random stream drawn for the whole batch), so a seeded request would give"
        " other tokens in another batch")


def assert_greedy_equivalent(ours: list[int], ref: list[int], ref_logits: Tensor,
                             atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Equal, or diverging first at a position where both tokens' target scores are allclose."""
    for t, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            sa, sb = ref_logits[t, a], ref_logits[t, b]
            assert torch.isclose(sa, sb, atol=atol, rtol=rtol), (
                f"greedy divergence at new token {t}: got {a} (score {sa:.6g}), target argmax {b} (score {sb:.6g})"
            )
            return
    assert len(ours) == len(ref), f"lengths differ: {len(ours)} vs {len(ref)}"


@dataclass
class GofResult:
    pvalues: list[float]
    tests: list[str]
    samples: Tensor  # [N, positions]

    @property
    def min_p(self) -> float:
        return min(self.pvalues)


@torch.inference_mode()
def sampled_gof(target: Target, drafter: Drafter | None, verifier: Verifier, prompt: list[int],
                sampling: SamplingParams, n_samples: int = 3000, positions: int = 3, k: int = 3,
                min_group: int = 150, batch: int = 1000, policy: DraftPolicy | None = None) -> GofResult:
    """χ² of every emitted position against the target's exact conditional distribution.

    Position 1 is tested against p(· | prompt); position j > 1 against p(· | prompt, prefix) for
    every sampled prefix seen at least ``min_group`` times. Seeds are fixed (row i uses seed i),
    so the result is reproducible; callers apply a multiple-comparison correction to ``min_p``.
    ``policy`` (a draft-length policy) is handed to every run.
    """
    rows = []
    for lo in range(0, n_samples, batch):
        reqs = [Request(list(prompt), positions, SamplingParams(sampling.temperature, sampling.top_k,
                                                                 sampling.top_p, seed=lo + i))
                for i in range(min(batch, n_samples - lo))]
        res = run(target, drafter, verifier, reqs, k=k, eos_token_ids=set(), policy=policy)
        rows += [r.tokens for r in res.requests]
    samples = torch.tensor(rows)
    rs = RowSampling([sampling])
    pvalues, tests = [], []
    for j in range(positions):
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for row in samples.tolist():
            groups[tuple(row[:j])].append(row[j])
        for prefix, nxt in groups.items():
            if len(nxt) < min_group:
                continue
            ids = torch.tensor([list(prompt) + list(prefix)], device=target.device)
            p = rs.probs(target.model(ids).logits[:, -1].float())[0]
            counts = torch.bincount(torch.tensor(nxt), minlength=target.vocab_size)
            pvalues.append(chi_square(counts.cpu(), p.cpu()))
            tests.append(f"position {j + 1} | prefix {prefix}")
    return GofResult(pvalues, tests, samples)


class Recording(Drafter):
    """Delegates to a drafter and keeps every proposal it made (for contract tests)."""

    name = "recording"

    def __init__(self, inner: Drafter):
        self.inner, self.proposals = inner, []
        self.target = inner.target

    def requirements(self):
        return self.inner.requirements()

    def check_k(self, k: int) -> None:
        self.inner.check_k(k)

    def start(self, prefill: Committed, rows: RowSampling) -> Any:
        self.anchors = prefill.next_tokens.clone()
        return self.inner.start(prefill, rows)

    def propose(self, state: Any, k: int, rows: RowSampling) -> DraftProposal:
        p = self.inner.propose(state, k, rows)
        self.proposals.append(p)
        return p

    def observe(self, state: Any, committed: Committed) -> None:
        self.inner.observe(state, committed)

    def select_rows(self, state: Any, rows: Tensor) -> None:
        self.inner.select_rows(state, rows)

    @classmethod
    def create(cls, target: Target, **options: Any) -> Drafter:
        raise TypeError("Recording wraps an existing drafter")

    @classmethod
    def tiny(cls, target: Target, **overrides: Any) -> Drafter:
        raise TypeError("Recording wraps an existing drafter")


@torch.inference_mode()
def q_contract(target: Target, drafter: Drafter, prompt: list[int], sampling: SamplingParams, k: int = 3,
               n_samples: int = 3000, min_group: int = 200) -> GofResult:
    """Sample one proposal per row from identical states and test each node's tokens against
    the q the drafter reported for it.

    Rows are grouped by everything that can condition node j (the anchor token and the tokens of
    every earlier node); within a group q must be identical, and the node's tokens must follow
    it. A deterministic drafter must propose identical tokens within a group.
    """
    rec = Recording(drafter)
    reqs = [Request(list(prompt), 1 + k, SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p,
                                                        seed=i)) for i in range(n_samples)]
    with warnings.catch_warnings():  # _FirstOnly only drives the proposals tested here: no output is read
        warnings.simplefilter("ignore", LossyVerifierWarning)
        run(target, rec, _FirstOnly(), reqs, k=k, eos_token_ids=set())
    prop = rec.proposals[0]
    anchors = rec.anchors
    pvalues, tests = [], []
    for j in range(prop.n):
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for b in range(prop.tokens.shape[0]):
            if int(prop.num_valid[b]) > j:
                groups[(int(anchors[b]),) + tuple(prop.tokens[b, :j].tolist())].append(b)
        for key, members in groups.items():
            if len(members) < min_group:
                continue
            idx = torch.tensor(members)
            toks = prop.tokens[idx, j]
            if prop.q is None:
                assert bool((toks == toks[0]).all()), f"deterministic drafter gave different node-{j} tokens from one state"
                continue
            q = prop.q[idx, j].float()
            assert torch.allclose(q, q[:1].expand_as(q), atol=1e-6), f"node {j}: q differs between identical states"
            assert torch.allclose(q.sum(-1), torch.ones(len(members), dtype=q.dtype, device=q.device), atol=1e-4)
            counts = torch.bincount(toks.cpu(), minlength=target.vocab_size)
            pvalues.append(chi_square(counts, q[0].cpu()))
            tests.append(f"node {j} | {key}")
    return GofResult(pvalues, tests, prop.tokens)


class _FirstOnly(Verifier):
    """Accepts nothing and emits the root's argmax: enough to drive one proposal per row."""

    name = "first_only"
    lossless = False

    def verify(self, proposal, logits, rows):
        from specdec.types import Verification

        B, n = proposal.tokens.shape
        tokens = torch.full((B, n + 1), -1, dtype=torch.long, device=logits.device)
        tokens[:, 0] = logits[:, 0].argmax(-1)
        return Verification(torch.full((B, n), -1, dtype=torch.long, device=logits.device),
                            torch.zeros(B, dtype=torch.long, device=logits.device), tokens)


def tree_parents(branching: list[int]) -> list[int]:
    """Parent list of a full tree with ``branching[d]`` children per node at depth d, in
    breadth-first order (siblings consecutive, in draw order)."""
    parents: list[int] = []
    frontier = [-1]
    for width in branching:
        nxt = []
        for p in frontier:
            for _ in range(width):
                parents.append(p)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return parents


class RandomDrafter(Drafter):
    """Adversarial drafts from random logits; q is reported exactly.

    ``siblings``: ``"iid"`` (children drawn independently from one q), ``"without_replacement"``
    (each child from q renormalised without the earlier siblings), or ``"deterministic"`` (the
    top children of q, distinct, q declared None). ``branching`` gives the tree (``[1]*k`` is a
    chain of length k; ``None`` means a chain of the requested k).
    """

    name = "random"

    def __init__(self, siblings: str = "iid", branching: list[int] | None = None, seed: int = 0):
        if siblings not in ("iid", "without_replacement", "deterministic"):
            raise ValueError(f"unknown sibling mode {siblings!r}")
        self.siblings, self.branching, self.seed = siblings, branching, seed

    def start(self, prefill: Committed, rows: RowSampling) -> dict:
        return {"step": 0}

    def propose(self, state: dict, k: int, rows: RowSampling) -> DraftProposal:
        parents = tree_parents(self.branching or [1] * k)
        B, V, n, dev = rows.batch, self.target.vocab_size, len(parents), self.target.device
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + state["step"])
        state["step"] += 1
        # Draft logits depend on the node's parent token only, as a real drafter's would. The
        # drafting runs on the host (the generator's device); the draws and the proposal on the target's.
        host = g.device
        table = torch.randn(V + 1, V, generator=g, device=host) * 2.0
        tokens = torch.zeros(B, n, dtype=torch.long, device=host)
        qs = torch.zeros(B, n, V, device=host)
        used = torch.zeros(B, n + 1, V, device=host)  # mass removed from each parent's q by earlier siblings
        for j, p in enumerate(parents):
            parent_tok = tokens[:, p] if p >= 0 else torch.full((B,), V, device=host)
            q = rows.probs(table[parent_tok].to(dev)).cpu()
            if self.siblings == "deterministic":
                q = q.masked_fill(used[:, p + 1] > 0, 0.0)
                x = q.argmax(-1)
            else:
                if self.siblings == "without_replacement":
                    q = q.masked_fill(used[:, p + 1] > 0, 0.0)
                    mass = q.sum(-1, keepdim=True)
                    # top-k/top-p left fewer tokens than siblings: the sibling is deterministic (one-hot
                    # on the best unused raw score), as EAGLE-3's static tree does; that q is exact too
                    best = table[parent_tok].masked_fill(used[:, p + 1] > 0, float("-inf")).argmax(-1)
                    q = torch.where(mass > 0, q / mass.clamp(min=1e-30), F.one_hot(best, V).float())
                x = rows.sample(q.to(dev)).cpu()
            used[torch.arange(B, device=host), p + 1, x] = 1.0
            tokens[:, j], qs[:, j] = x, q
        q_out = None if self.siblings == "deterministic" else qs.to(dev)
        return DraftProposal(tokens.to(dev), torch.tensor(parents, device=dev).expand(B, n).clone(), q_out)

    def observe(self, state: dict, committed: Committed) -> None:
        pass

    def select_rows(self, state: dict, rows: Tensor) -> None:
        pass

    @classmethod
    def create(cls, target: Target, **options: Any) -> RandomDrafter:
        d = cls(**options)
        d.bind(target)
        return d

    @classmethod
    def tiny(cls, target: Target, **overrides: Any) -> RandomDrafter:
        return cls.create(target, **overrides)

"""A hybrid drafter: a model-free part (SuffixDecoding, prompt lookup) and a learned part (EAGLE-3,
or any drafter), and per row and step the proposal of whichever part is expected to get more
tokens accepted.

Both parts draft (the learned part's draft is its evidence; it sits out a greedy step no row could
choose it in) and both observe every commit, whichever part was chosen, so each keeps its state in
step with the target. A row's proposal comes wholly from one part; rows of one batch may choose different parts, merged into
one :class:`~specdec.types.DraftProposal` padded to the longer part with ``num_valid``.

**Rules** (``rule``):

- ``"expected"``: each part's expected accepted length on its own evidence, per row. The raw
  estimate is ``Σ_nodes Π_{path} c``: the sum over the draft's nodes of the product of the
  per-node confidences down its path (the suffix tree's frequency scores ``count(child) /
  count(node)``, a learned draft's probability of its drafted token: its ``confidence`` or the q of
  the drafted token; 1 where a part reports neither, as prompt lookup). Each part's estimate is
  then calibrated on the same row's history: after every step, each part's draft, chosen or not,
  is walked along the tokens the target emitted (the accepted length it would have had under
  greedy verification, censored at the emitted length), and the raw estimate over the same
  window is set beside it: ``E = raw · (observed + prior) / (predicted + prior)``. The learned
  part is chosen when its ``E`` is larger; ties and rows whose learned draft is empty take the
  model-free part.
- ``"ngram_first"``: vLLM's ngram-eagle rule: the model-free draft whenever it has one, else the
  learned one.

When every row is greedy and no row could choose the learned part (under ``expected``: its model-free
draft's expected length is at least the learned part's upper bound, every node of its last
proposal accepted, calibrated), the learned part does not draft that step.

The choice reads only the row's own draft and history, never another row's, so a row's output
does not depend on its batch (whether the learned part sits out depends on every row, but only
greedy steps, which draw no random numbers, are skipped); and a choice made before verification never changes the output
distribution (each part's draft is lossless on its own).

``q``: a deterministic draft is ``q=None``; when the learned part samples (q given), the merged q
carries the learned rows' q and one-hot rows for the model-free rows and for padding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specdec.drafter import Drafter
from specdec.registry import drafter_class
from specdec.sampling import RowSampling
from specdec.target import Target
from specdec.types import Committed, DraftProposal, Requirements

__all__ = ["HybridConfig", "HybridDrafter", "HybridState", "RULES", "choose", "calibrated", "expected_length", "walk",
           "BEST_CHECKPOINTS"]

RULES = ("expected", "ngram_first")
MODEL_FREE, LEARNED = 0, 1

# The measured best committed checkpoint of each learned family, tried in order for a target
# given no ``learned_options`` checkpoint (the first whose shapes fit the target is used).
BEST_CHECKPOINTS: dict[str, tuple[str, ...]] = {"eagle3": ("smollm2-135m-eagle3",)}


@dataclass(frozen=True)
class HybridConfig:
    model_free: str = "suffix"  # registered name of the model-free part
    learned: str = "eagle3"  # registered name of the learned part
    model_free_options: dict = field(default_factory=dict)
    learned_options: dict = field(default_factory=dict)  # eagle3: checkpoint defaults to BEST_CHECKPOINTS
    rule: str = "expected"  # expected | ngram_first
    learned_k: int | None = 1  # the learned part drafts min(k, learned_k) tokens; None = k
    prior: float = 2.0  # calibration: pseudo-tokens of evidence that the raw estimate is right

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"hybrid rule must be one of {RULES}, got {self.rule!r}")
        for name in ("model_free", "learned"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"hybrid {name} must be a registered drafter name, got {getattr(self, name)!r}")
        if self.model_free == "hybrid" or self.learned == "hybrid":
            raise ValueError("a hybrid's parts cannot be hybrids")
        for name in ("model_free_options", "learned_options"):
            if not isinstance(getattr(self, name), dict):
                raise TypeError(f"hybrid {name} must be a dict of the part's options, got {getattr(self, name)!r}")
        if self.learned_k is not None and (isinstance(self.learned_k, bool) or not isinstance(self.learned_k, int)
                                           or self.learned_k < 1):
            raise ValueError(f"hybrid learned_k must be an int >= 1 or None (= k), got {self.learned_k!r}")
        if isinstance(self.prior, bool) or not isinstance(self.prior, (int, float)) or not self.prior > 0:
            raise ValueError(f"hybrid prior must be a number > 0, got {self.prior!r}")


@dataclass
class _Draft:
    """One part's draft for one row, on the host: what the evidence is computed from."""

    tokens: list[int]
    parents: list[int]
    conf: list[float]  # per node: probability it is accepted given its parent is


@dataclass
class HybridState:
    parts: list[Any]  # [model-free state, learned state]
    predicted: list[list[float]]  # per row, per part: Σ raw estimates over the windows seen
    observed: list[list[float]]  # per row, per part: Σ shadow accepted lengths over the same windows
    last: list[list[_Draft | None]]  # per row, per part: the last step's draft (None: it did not draft)
    chosen: list[int]  # per row: the part the last proposal came from
    learned_nodes: int | None = None  # nodes of the learned part's last proposal (None: it never drafted)


def path_probs(d: _Draft) -> list[float]:
    """Probability each node is accepted: the product of the confidences down its path."""
    out: list[float] = []
    for p, c in zip(d.parents, d.conf):
        out.append(c * (out[p] if p >= 0 else 1.0))
    return out


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def expected_length(d: _Draft | None, window: int | None = None) -> float:
    """Raw expected accepted length of a draft, over the nodes of depth <= ``window`` (all: None)."""
    if d is None:
        return 0.0
    return sum(pp for pp, dep in zip(path_probs(d), depths(d.parents)) if window is None or dep <= window)


def walk(d: _Draft, emitted: list[int]) -> int:
    """How many of ``emitted`` the draft holds as a path from the root: the length it would have
    had accepted under greedy verification, censored at ``len(emitted)``."""
    node, length = -1, 0
    for tok in emitted:
        nxt = next((j for j, (t, p) in enumerate(zip(d.tokens, d.parents)) if p == node and t == tok), None)
        if nxt is None:
            break
        node, length = nxt, length + 1
    return length


def choose(rule: str, drafts: list[_Draft | None], predicted: list[float], observed: list[float],
           prior: float) -> int:
    """The part one row proposes from: MODEL_FREE or LEARNED (see the module docstring)."""
    mf, learned = drafts
    if learned is None or not learned.tokens:
        return MODEL_FREE
    if mf is None or not mf.tokens:
        return LEARNED
    if rule == "ngram_first":
        return MODEL_FREE
    score = [calibrated(expected_length(d), p, o, prior) for d, p, o in zip(drafts, predicted, observed)]
    return LEARNED if score[LEARNED] > score[MODEL_FREE] else MODEL_FREE


def calibrated(raw: float, predicted: float, observed: float, prior: float) -> float:
    """A raw expected length scaled by the row's record of this part: observed over predicted,
    both shrunk towards 1 by ``prior`` pseudo-tokens."""
    return raw * (observed + prior) / (predicted + prior)


def _host_drafts(p: DraftProposal) -> list[_Draft]:
    """Each row's valid nodes, with per-node confidences (the part's own, else q of the drafted
    token, else 1)."""
    tokens, parents, nv = p.tokens.tolist(), p.parents.tolist(), p.num_valid.tolist()
    if p.confidence is not None:
        conf = p.confidence.float().clamp(0, 1).tolist()
    elif p.q is not None and p.n:
        conf = p.q.gather(-1, p.tokens.unsqueeze(-1)).squeeze(-1).float().clamp(0, 1).tolist()
    else:
        conf = [[1.0] * p.n for _ in tokens]
    return [_Draft(t[:n], [x if x < n else -1 for x in par[:n]], c[:n])
            for t, par, c, n in zip(tokens, parents, conf, nv)]


def _pad(x: Tensor, n: int, fill: float) -> Tensor:
    return torch.nn.functional.pad(x, (0, n - x.shape[1]), value=fill) if x.shape[1] < n else x


def _q_of(p: DraftProposal, tokens: Tensor, n: int, V: int) -> Tensor:
    """The part's q padded to ``n`` nodes, one-hot on ``tokens`` (its padded tokens) where it has none."""
    onehot = torch.nn.functional.one_hot(tokens, V).to(p.q.dtype if p.q is not None else torch.float32)
    if p.q is None:
        return onehot
    return torch.cat([p.q, onehot[:, p.n:]], dim=1)


class HybridDrafter(Drafter):
    name = "hybrid"
    options_class = HybridConfig

    def __init__(self, model_free: Drafter, learned: Drafter, config: HybridConfig = HybridConfig()):
        self.parts = [model_free, learned]
        self.config = config

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def create(cls, target: Target, **options: Any) -> HybridDrafter:
        """Both parts by name, each with its options; with none, suffix and the best committed
        checkpoint of the learned family that fits ``target`` (:data:`BEST_CHECKPOINTS`)."""
        from specdec.api import make_drafter

        config = HybridConfig(**options)
        _check_part_options(config)
        learned_options = dict(config.learned_options)
        if "checkpoint" in (drafter_class(config.learned).option_names() or ()) and not learned_options.get("checkpoint"):
            learned_options["checkpoint"] = _best_checkpoint(config.learned, target)
        learned_options = {**_confidence_on(config.learned), **learned_options}
        d = cls(make_drafter(config.model_free, target, **config.model_free_options),
                make_drafter(config.learned, target, **learned_options), config)
        d.bind(target)
        return d

    @classmethod
    def tiny(cls, target: Target, **overrides: Any) -> HybridDrafter:
        """Both parts from their own ``tiny`` factories (random weights for the learned one)."""
        config = HybridConfig(**overrides)
        _check_part_options(config)
        learned = drafter_class(config.learned).tiny(target, **{**_confidence_on(config.learned),
                                                                **config.learned_options})
        d = cls(drafter_class(config.model_free).tiny(target, **config.model_free_options), learned, config)
        d.bind(target)
        return d

    def requirements(self) -> Requirements:
        return self.parts[MODEL_FREE].requirements().union(self.parts[LEARNED].requirements())

    def check_k(self, k: int) -> None:
        self.parts[MODEL_FREE].check_k(k)
        self.parts[LEARNED].check_k(self._learned_k(k))

    def _learned_k(self, k: int) -> int:
        return k if self.config.learned_k is None else min(k, self.config.learned_k)

    # --- the contract -------------------------------------------------------------------------
    def start(self, prefill: Committed, rows: RowSampling) -> HybridState:
        B = prefill.tokens.shape[0]
        return HybridState([part.start(prefill, rows) for part in self.parts], [[0.0, 0.0] for _ in range(B)],
                           [[0.0, 0.0] for _ in range(B)], [[None, None] for _ in range(B)], [MODEL_FREE] * B)

    def propose(self, state: HybridState, k: int, rows: RowSampling) -> DraftProposal:
        mf = self.parts[MODEL_FREE].propose(state.parts[MODEL_FREE], k, rows)
        mf_drafts = _host_drafts(mf)
        # the learned part sits out only when it would draw no random numbers (greedy) and no row could choose it
        skip = rows.all_greedy and all(self._settled(state, b, d) for b, d in enumerate(mf_drafts))
        learned = None if skip else self.parts[LEARNED].propose(state.parts[LEARNED], self._learned_k(k), rows)
        if learned is not None:
            state.learned_nodes = learned.n
        l_drafts = [None] * len(mf_drafts) if learned is None else _host_drafts(learned)
        for b, pair in enumerate(zip(mf_drafts, l_drafts)):
            state.last[b] = list(pair)
            state.chosen[b] = choose(self.config.rule, list(pair), state.predicted[b], state.observed[b],
                                     self.config.prior)
        if learned is None:
            return mf
        chains = all(d.parents == list(range(-1, len(d.parents) - 1))
                     for d in (pair[c] for pair, c in zip(state.last, state.chosen)))
        return self._merge(mf, learned, state.chosen, chains)

    def _settled(self, state: HybridState, b: int, mf: _Draft) -> bool:
        """Whether row ``b`` takes its model-free draft ``mf`` whatever the learned part drafts:
        under ``ngram_first`` when there is one; under ``expected`` when its expected length is at
        least the most the learned part's could be (each of its last proposal's nodes accepted
        for sure, scaled by the row's record of it)."""
        if not mf.tokens:
            return False
        if self.config.rule == "ngram_first":
            return True
        if state.learned_nodes is None:
            return False
        c, p, o = self.config.prior, state.predicted[b], state.observed[b]
        return calibrated(expected_length(mf), p[MODEL_FREE], o[MODEL_FREE], c) >= \
            calibrated(state.learned_nodes, p[LEARNED], o[LEARNED], c)

    def _merge(self, mf: DraftProposal, learned: DraftProposal, chosen: list[int], chains: bool) -> DraftProposal:
        """One proposal: each row's nodes from its chosen part, padded to the longer part; a chain
        when every row's chosen draft is one (the target's and the block verifier's chain path)."""
        dev = mf.tokens.device
        pick = torch.tensor([c == LEARNED for c in chosen], device=dev)
        n = max(mf.n, learned.n)
        t_mf, t_l = _pad(mf.tokens, n, 0), _pad(learned.tokens.to(dev), n, 0)
        tokens = torch.where(pick.unsqueeze(1), t_l, t_mf)
        num_valid = torch.where(pick, learned.num_valid.to(dev), mf.num_valid)
        q = None
        if mf.q is not None or learned.q is not None:
            V = self.target.vocab_size
            q = torch.where(pick.view(-1, 1, 1), _q_of(learned, t_l, n, V).to(dev),
                            _q_of(mf, t_mf, n, V).to(dev))
        if chains:
            return DraftProposal.chain(tokens, q, num_valid)
        parents = torch.where(pick.unsqueeze(1), _pad(learned.parents.to(dev), n, -1), _pad(mf.parents, n, -1))
        return DraftProposal(tokens, parents, q, num_valid)

    def observe(self, state: HybridState, committed: Committed) -> None:
        for part, s in zip(self.parts, state.parts):
            part.observe(s, committed)
        if committed.verification is None:
            return
        toks, num, nxt = committed.tokens.tolist(), committed.num_tokens.tolist(), committed.next_tokens.tolist()
        for b, (t, n, x) in enumerate(zip(toks, num, nxt)):
            emitted = t[1:n] + [x]  # t[0] is the previous anchor
            for i, d in enumerate(state.last[b]):
                if d is None or not d.tokens:
                    continue
                state.predicted[b][i] += expected_length(d, len(emitted))
                state.observed[b][i] += walk(d, emitted)
            state.last[b] = [None, None]

    def select_rows(self, state: HybridState, rows: Tensor) -> None:
        for part, s in zip(self.parts, state.parts):
            part.select_rows(s, rows)
        keep = rows.tolist()
        for name in ("predicted", "observed", "last", "chosen"):
            values = getattr(state, name)
            values[:] = [values[i] for i in keep]


def _check_part_options(config: HybridConfig) -> None:
    """Every part is registered and every part option is one it takes: refused before any work."""
    for role, name, options in (("model_free", config.model_free, config.model_free_options),
                                ("learned", config.learned, config.learned_options)):
        try:
            cls = drafter_class(name)
        except ValueError as e:
            raise ValueError(f"hybrid {role}={name!r}: {e}") from None
        known = cls.option_names()
        unknown = sorted(set(options) - set(known)) if known is not None else []
        if unknown:
            raise ValueError(f"hybrid {role}_options: {name} has no option {', '.join(map(repr, unknown))};"
                             f" its options are: {', '.join(known) if known else 'none'}")


def _confidence_on(name: str) -> dict[str, Any]:
    """Ask the learned part for its per-node confidence when it offers the option."""
    return {"confidence": True} if "confidence" in (drafter_class(name).option_names() or ()) else {}


def _best_checkpoint(learned: str, target: Target) -> str:
    """The first committed checkpoint of :data:`BEST_CHECKPOINTS` whose shapes fit ``target``
    (vocabulary, hidden size, feature layers); a clear error naming the options otherwise."""
    from specdec.models import committed_checkpoints

    committed = committed_checkpoints()
    for name in BEST_CHECKPOINTS.get(learned, ()):
        folder = committed.get(name)
        if folder is not None and _fits(json.loads((folder / "config.json").read_text()), target):
            return name
    raise ValueError(f"hybrid: no committed {learned} checkpoint fits this target (vocabulary {target.vocab_size},"
                     f" hidden size {target.hidden_size}); the committed ones are for SmolLM2-135M"
                     f" ({', '.join(BEST_CHECKPOINTS.get(learned, ())) or 'none'}). Pass the learned part's"
                     f" checkpoint: learned_options={{'checkpoint': <folder>}} (or learned=<another drafter>),"
                     f" or use the model-free drafter alone (drafter 'suffix')")


def _fits(config: dict, target: Target) -> bool:
    """Whether an EAGLE-3-style config.json matches the target's vocabulary, width and depth."""
    layer = config.get("transformer_layer_config", config)
    hidden = config.get("target_hidden_size") or layer.get("hidden_size")
    ids = config.get("eagle_aux_hidden_state_layer_ids") or []
    return (layer.get("vocab_size") == target.vocab_size and hidden == target.hidden_size
            and all(0 <= i <= target.num_layers for i in ids))


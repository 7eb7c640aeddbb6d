"""The loop hands each drafter exactly what it declared, and nothing it did not."""

from __future__ import annotations

import pytest

from specdec.loop import Request, run
from specdec.testing import RandomDrafter
from specdec.types import Requirements
from specdec.verifiers import GreedyVerifier


class _Spy(RandomDrafter):
    def __init__(self, req: Requirements):
        super().__init__(siblings="deterministic")
        self.req, self.seen = req, []

    def requirements(self) -> Requirements:
        return self.req

    def start(self, prefill, rows):
        self.seen.append(prefill)
        return super().start(prefill, rows)

    def observe(self, state, committed):
        self.seen.append(committed)


def test_declared_features_and_cache_reach_the_drafter(target):
    L = target.num_layers
    spy = _Spy(Requirements(layer_inputs=(1, L), final_hidden=True, target_cache=True))
    spy.bind(target)
    run(target, spy, GreedyVerifier(), [Request([1, 2, 3], 6), Request([4, 5], 4)], k=2, eos_token_ids=set())
    first, later = spy.seen[0], spy.seen[1]
    assert set(first.hidden) >= {1, L} and first.hidden[1].shape == (2, 3, target.hidden_size)
    assert first.final_hidden is not None and first.final_hidden.shape == (2, 3, target.hidden_size)
    assert first.target_cache is not None and later.target_cache is first.target_cache
    assert later.hidden[L].shape[:2] == later.tokens.shape
    # committed positions continue the prompt: the prefill's next token sits at position len(prompt)
    assert later.positions[0, 0].item() == 3 and later.positions[1, 0].item() == 2


def test_undeclared_cache_is_not_shared(target):
    spy = _Spy(Requirements())
    spy.bind(target)
    run(target, spy, GreedyVerifier(), [Request([1, 2, 3], 3)], k=2, eos_token_ids=set())
    assert all(c.target_cache is None for c in spy.seen)


class _Boom(_Spy):
    def propose(self, state, k, rows):
        raise RuntimeError("boom")


def _captures_during(target, monkeypatch) -> list[tuple[set, bool]]:
    """Records, for every target forward, which hidden states it handed out."""
    seen, forward = [], target.forward

    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append((set(out.hidden), out.final_hidden is not None))
        return out

    monkeypatch.setattr(target, "forward", spy)
    return seen


def test_a_run_captures_only_what_its_drafter_needs(monkeypatch):
    from specdec.drafters.eagle3.drafter import Eagle3Drafter
    from specdec.api import make_drafter
    from specdec.target import Target
    from specdec.testing.tiny import tiny_model

    target = Target(tiny_model("llama", vocab_size=64))  # its own: the session target is shared
    eagle = Eagle3Drafter.tiny(target)
    run(target, eagle, GreedyVerifier(), [Request([1, 2, 3], 4)], k=2, eos_token_ids=set())
    seen = _captures_during(target, monkeypatch)
    run(target, make_drafter("ngram", target), GreedyVerifier(), [Request([1, 2, 3], 4)], k=2, eos_token_ids=set())
    assert seen and all(hidden == set() and not final for hidden, final in seen)  # nothing of EAGLE-3's
    assert target.requirements == Requirements() and not target._hooks


def test_a_run_that_raises_leaves_nothing_on_the_target():
    from specdec.target import Target
    from specdec.testing.tiny import tiny_model

    target = Target(tiny_model("llama", vocab_size=64))
    L = target.num_layers
    boom = _Boom(Requirements(layer_inputs=(1, L), final_hidden=True))
    boom.bind(target)
    with pytest.raises(RuntimeError, match="boom"):
        run(target, boom, GreedyVerifier(), [Request([1, 2, 3], 4)], k=2, eos_token_ids=set())
    assert not target._hooks and not target._captured and target.requirements == Requirements()
    spy = _Spy(Requirements(layer_inputs=(1,)))
    spy.bind(target)
    out = run(target, spy, GreedyVerifier(), [Request([1, 2, 3], 4)], k=2, eos_token_ids=set())
    assert len(out.requests[0].tokens) == 4
    assert set(spy.seen[0].hidden) == {1} and spy.seen[0].final_hidden is None

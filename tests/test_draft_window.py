"""Sliding-window draft attention for EAGLE-3 (``Eagle3Config.window``, as vLLM's
``draft_attention_window``): the cache keeps every slot, a draft reads only the last ``window``
positions of the context; a window as long as the context is full attention, to the bit; any
window keeps the target's output (the verifier decides)."""

from __future__ import annotations

import pytest
import torch

from specdec.drafters.eagle3.drafter import Eagle3Config, Eagle3Drafter
from specdec.loop import Request, run
from specdec.sampling import SamplingParams
from specdec.testing import Recording
from specdec.verifiers import GreedyVerifier, RejectionVerifier

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]


def _run(target, tree="chain", sampled=False, **options):
    d = Recording(Eagle3Drafter.tiny(target, tree=tree, **options))
    sampling = SamplingParams(temperature=1.0, seed=3) if sampled else SamplingParams()
    verifier = RejectionVerifier() if sampled else GreedyVerifier()
    res = run(target, d, verifier, [Request(list(PROMPT), 16, sampling)], k=3, eos_token_ids=set())
    return res.requests[0].tokens, [(p.tokens.tolist(), None if p.q is None else p.q) for p in d.proposals]


@pytest.mark.parametrize("tree", ["chain", "static", "dynamic"])
def test_a_window_as_long_as_the_context_is_full_attention(target, tree):
    full_tokens, full = _run(target, tree)
    tokens, windowed = _run(target, tree, window=len(PROMPT) + 64)
    assert tokens == full_tokens
    assert [t for t, _ in windowed] == [t for t, _ in full]


def test_a_short_window_changes_the_drafts_never_the_greedy_output(target):
    plain, full = _run(target)
    tokens, windowed = _run(target, window=2)
    assert tokens == plain  # the target's argmax, whatever was drafted
    assert [t for t, _ in windowed] != [t for t, _ in full]  # a 2-token window is another draft


def test_a_windowed_sampled_draft_keeps_its_q_a_distribution(target):
    _, windowed = _run(target, sampled=True, window=2)
    for _, q in windowed:
        torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[:-1]))


def test_the_window_bounds_the_context_a_draft_reads(target, monkeypatch):
    import specdec.drafters.eagle3.drafter as mod

    widths = []
    real = mod.attend

    def spy(q, k, v, allowed):
        widths.append(int(allowed.sum(-1).max()))
        return real(q, k, v, allowed)

    monkeypatch.setattr(mod, "attend", spy)
    _run(target, window=4)
    assert widths and max(widths) <= 4 + 3  # the window, and a draft's own nodes (k = 3)
    widths.clear()
    _run(target)
    assert max(widths) >= len(PROMPT)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_bad_windows_are_refused(bad):
    with pytest.raises(ValueError, match="window"):
        Eagle3Config(window=bad)

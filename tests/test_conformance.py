"""The conformance suite (specdec.testing.conformance) on every registered drafter and the
adversarial test drafters: the cases and fixtures are in conftest.py. Outside this repository the
same suite runs through specdec.testing.plugin / specdec.testing.run_conformance."""

from specdec.testing.conformance import *  # noqa: F401,F403  (pytest collects the imported test_* functions)


def test_a_drafter_whose_rows_read_each_other_fails_batch_independence_saying_where_and_why():
    """A deliberately broken drafter (every row reports row 0's q): the suite's check names the
    request, the first new token that differs, and what that means, not a bare AssertionError."""
    import pytest

    from specdec.loop import Request, run
    from specdec.sampling import SamplingParams
    from specdec.target import Target
    from specdec.testing import RandomDrafter, assert_batch_independent
    from specdec.testing.tiny import tiny_model
    from specdec.verifiers import RejectionVerifier

    class RowZeroForAll(RandomDrafter):
        def propose(self, state, k, rows):
            p = super().propose(state, k, rows)
            p.q = p.q[:1].expand_as(p.q).clone()  # every row reports row 0's q: the bug
            return p

    target = Target(tiny_model("llama", vocab_size=32, init_scale=0.3, seed=0))
    broken = RowZeroForAll.create(target)
    mine = Request([3, 1, 4, 1, 5], 10, SamplingParams(temperature=1.0, seed=3))  # a seed the wrong q moves
    others = [Request([9, 2, 6] * (i + 1), 4 + 3 * i, SamplingParams(temperature=1.0, seed=i)) for i in range(3)]
    alone = run(target, broken, RejectionVerifier(), [mine], k=3, eos_token_ids=set()).requests[0].tokens
    batched = run(target, broken, RejectionVerifier(), others[:1] + [mine] + others[1:], k=3, eos_token_ids=set())
    with pytest.raises(AssertionError, match=r"request 1 of a batch of 4 gave other tokens than the same request alone,"
                                             r" from new token \d+ on .* may not depend on the rows beside it"):
        assert_batch_independent(alone, batched.requests[1].tokens, row=1, batch=4)
    assert_batch_independent([1, 2, 3], [1, 2, 3], row=0, batch=2)  # the same tokens pass

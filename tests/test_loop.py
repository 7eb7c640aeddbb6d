"""The loop hands each drafter exactly what it declared, and nothing it did not."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

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


# --- host synchronisation -------------------------------------------------------------------------
_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "equal", "is_nonzero"}


class _HostReads(TorchFunctionMode):
    """Counts every read of a tensor's values into Python: on a GPU each one waits for the
    device (a synchronisation). Tensors are all on the CPU here, so a read of a host tensor
    counts too: the loop keeps its host bookkeeping in Python lists, not tensors. Copies to the
    device (non-blocking from pinned memory on CUDA) are not reads and are not counted."""

    def __init__(self):
        super().__init__()
        self.count, self.paused = 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused and getattr(func, "__name__", "") in _READS:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def opaque(self, fn):
        """``fn`` as one device operation whose reads are its own business (a drafter; the
        verifier's kernel, one Triton launch on a GPU)."""
        def wrapped(*args, **kwargs):
            self.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused -= 1
        return wrapped


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("branching", [None, [2, 2]], ids=["chain", "tree"])
def test_a_step_reads_the_device_once(target, monkeypatch, sampled, branching):
    """Steps of the loop, the target's forward, the KV store and the sampling read one tensor
    back per step (the accepted counts with everything else the host needs), counted as the
    difference between two runs of different lengths (the prefill cancels)."""
    import specdec.verifiers.greedy as greedy_module
    import specdec.verifiers.rejection as rejection_module
    from specdec.sampling import SamplingParams
    from specdec.verifiers import RejectionVerifier

    from specdec.kv import KVStore

    reads = _HostReads()
    for module in (greedy_module, rejection_module):
        monkeypatch.setattr(module, "rejection_sample", reads.opaque(module.rejection_sample))
    # Retiring a row reads only the host tensor of kept rows (no device wait), and how many
    # retirements a run has depends on the draws: it is not part of a step's cost.
    monkeypatch.setattr(KVStore, "select_rows", reads.opaque(KVStore.select_rows))
    params = ([SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.8, top_k=8, seed=4)] if sampled
              else [SamplingParams()] * 2)
    seen = []
    for new_tokens in (6, 14):
        drafter = RandomDrafter.create(target, siblings="iid", **({"branching": branching} if branching else {}))
        for name in ("start", "propose", "observe", "select_rows"):
            setattr(drafter, name, reads.opaque(getattr(drafter, name)))
        verifier = RejectionVerifier() if sampled else GreedyVerifier()
        requests = [Request([1, 2, 3], new_tokens, params[0]), Request([4, 5, 6], new_tokens, params[1])]
        before = reads.count
        with reads:
            res = run(target, drafter, verifier, requests, k=3, eos_token_ids=set())
        seen.append((reads.count - before, res.metrics.batch_steps))
    (short, short_steps), (long, long_steps) = seen
    assert long_steps > short_steps and long - short == long_steps - short_steps


def test_stop_repeat_ends_an_answer_where_its_first_repeated_ngram_ends(target):
    """The answer under ``stop_repeat`` is the plain answer up to the token completing its first
    repeated N-gram, whatever drafter verifies it; a row without it in the same batch is untouched."""
    from specdec.api import make_drafter
    from specdec.data.corpus import repeated_ngrams

    prompts = [[1, 2, 3, 1, 2], [7, 7, 7], [5, 9, 11, 4]]
    plain = run(target, None, GreedyVerifier(), [Request(p, 48) for p in prompts], eos_token_ids=set())
    stopped_any = False
    for n in (2, 4):
        for drafter in (None, make_drafter("ngram", target)):
            reqs = [Request(p, 48, stop_repeat=n) for p in prompts] + [Request(prompts[0], 48)]
            res = run(target, drafter, GreedyVerifier(), reqs, k=3, eos_token_ids=set())
            for full, got in zip(plain.requests, res.requests):
                marks = repeated_ngrams(full.tokens, n)
                end = marks.index(True) + 1 if True in marks else len(full.tokens)
                assert got.tokens == full.tokens[:end]
                assert got.metrics.finish_reason == ("repeat" if True in marks else "length")
                stopped_any |= True in marks
            assert res.requests[-1].tokens == plain.requests[0].tokens  # the row without stop_repeat
    assert stopped_any, "a tiny random target loops within 48 tokens: the rule must have fired"


@pytest.mark.parametrize(("value", "error"), [(-1, ValueError), ("8", TypeError), (2.5, TypeError)])
def test_a_bad_stop_repeat_is_refused_before_any_work(target, value, error):
    with pytest.raises(error, match="stop_repeat"):
        run(target, None, GreedyVerifier(), [Request([1, 2], 4, stop_repeat=value)])


@pytest.mark.parametrize("target", ["llama", "gemma4"], indirect=True)  # gemma4: sliding windows, shared K/V
@pytest.mark.parametrize("max_batch", [1, 3, 8])
def test_continuous_batching_gives_each_request_its_own_answer(target, max_batch):
    """Under ``max_batch`` a finished row takes the next waiting request; every request's tokens are
    the ones it gets decoded alone (greedy and seeded sampled rows, EOS and length limits mixed),
    and the batch never exceeds ``max_batch``."""
    from specdec.api import make_verifier
    from specdec.sampling import SamplingParams

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, target.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 24, (11,), generator=gen)]
    limits = torch.randint(1, 30, (11,), generator=gen).tolist()

    def requests():
        return [Request(p, n, SamplingParams(temperature=0.9, seed=i) if i % 2 else SamplingParams(),
                        stop_repeat=4 if i % 3 == 0 else 0) for i, (p, n) in enumerate(zip(prompts, limits))]

    verifier, eos = make_verifier("rejection"), {5}
    alone = [run(target, None, verifier, [r], eos_token_ids=eos).requests[0] for r in requests()]
    widths: list[int] = []
    forward = target.forward

    def spy(session, tokens, *a, **kw):
        widths.append(tokens.shape[0])
        return forward(session, tokens, *a, **kw)

    target.forward = spy
    try:
        res = run(target, None, verifier, requests(), eos_token_ids=eos, max_batch=max_batch)
    finally:
        del target.forward
    assert [r.tokens for r in res.requests] == [a.tokens for a in alone]
    assert [r.metrics.finish_reason for r in res.requests] == [a.metrics.finish_reason for a in alone]
    assert {a.metrics.finish_reason for a in alone} >= {"eos", "length"}
    assert max(widths) <= max_batch and res.metrics.new_tokens == sum(len(a.tokens) for a in alone)


def test_continuous_batching_keeps_the_batch_full():
    """Refilling takes fewer batch steps than decoding the same requests ``max_batch`` at a time, each
    batch to its longest answer: the count of steps, not a timing."""
    from specdec.testing.tiny import tiny_model
    from specdec.target import Target

    target = Target(tiny_model("llama", vocab_size=32, init_scale=0.3, seed=0))
    limits = [40, 2, 3, 2] * 4  # one long answer in every group of four
    reqs = lambda: [Request([1 + i % 7, 2, 3], n) for i, n in enumerate(limits)]  # noqa: E731
    groups = sum(run(target, None, GreedyVerifier(), reqs()[i: i + 4], eos_token_ids=set()).metrics.batch_steps
                 for i in range(0, len(limits), 4))
    refilled = run(target, None, GreedyVerifier(), reqs(), eos_token_ids=set(), max_batch=4).metrics.batch_steps
    assert refilled < groups / 2, (refilled, groups)


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), ("4", TypeError), (2.0, TypeError)])
def test_a_bad_max_batch_is_refused_before_any_work(target, value, error):
    with pytest.raises(error, match="max_batch"):
        run(target, None, GreedyVerifier(), [Request([1, 2], 4)] * 2, max_batch=value)


def test_continuous_batching_refuses_a_drafter_before_any_work(target):
    drafter = RandomDrafter()
    drafter.bind(target)
    with pytest.raises(ValueError, match="plain decoding"):
        run(target, drafter, GreedyVerifier(), [Request([1, 2], 4) for _ in range(3)], max_batch=2)
    run(target, drafter, GreedyVerifier(), [Request([1, 2], 4) for _ in range(3)], max_batch=3)  # all fit: no refill

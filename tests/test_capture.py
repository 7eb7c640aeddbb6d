"""The captured target step (specdec.capture, Target(capture=...)): the switch is honoured, the static
step is capture-safe (one whole graph, no host read), and every drafter's output on the captured
path is the eager path's, greedy and sampled.

On a CPU "graphs" runs the static form the CUDA graph records, uncaptured; "compile" traces it with
``fullgraph=True`` (torch.compile's "eager" backend here: a graph break still fails, without inductor's
minutes of code generation on this machine). The GPU kit times the recorded graphs themselves.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import specdec
from specdec import capture
from specdec.loop import Request, run
from specdec.sampling import SamplingParams
from specdec.target import Target
from specdec.testing import assert_greedy_equivalent, greedy_reference, sampled_gof
from specdec.testing.tiny import tiny_model
from specdec.verifiers import GreedyVerifier, RejectionVerifier

# the conformance cases of tests/conftest.py (loaded before any test module; importlib mode keeps it
# off sys.path, so it is found among the loaded modules)
_conftest = next(m for n, m in list(sys.modules.items()) if n.endswith("conftest") and hasattr(m, "TARGET_CASES"))
CASES, DRAFTERS, VOCAB = _conftest.CASES, _conftest.DRAFTERS, _conftest.VOCAB

PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 6], [7, 8, 9, 7]]  # ragged: retiring rows, holes, a masked store


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=VOCAB, init_scale=0.3, seed=0)


@pytest.fixture(scope="module")
def eager(model) -> Target:
    return Target(model, capture="eager")


@pytest.fixture(scope="module")
def graphs(model) -> Target:
    return Target(model, capture="graphs")


def _greedy(target: Target, case: str, k: int = 3, n: int = 10) -> list[list[int]]:
    drafter = CASES[case](target)
    res = run(target, drafter, GreedyVerifier(), [Request(p, n) for p in PROMPTS], k=k, eos_token_ids=set())
    return [r.tokens for r in res.requests]


def test_modes_resolve_and_bad_modes_fail_before_work(model):
    assert capture.resolve("auto", "cpu") == "eager"  # measured faster on a CPU (docs/capture.md)
    assert capture.resolve("auto", "cuda") == "graphs"
    assert capture.resolve("compile", "cpu") == "compile"
    with pytest.raises(ValueError, match="capture must be one of"):
        Target(model, capture="cudagraphs")
    with pytest.raises(ValueError, match="choose one"):
        Target(model, compile=True, capture="graphs")
    assert Target(model).capture_mode == "eager"


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_drafter_greedy_on_the_captured_step_equals_eager(eager, graphs, case):
    ours = _greedy(graphs, case)
    assert ours == _greedy(eager, case)
    for p, toks in zip(PROMPTS, ours):
        ref, logits = greedy_reference(graphs.model, p, len(toks))
        assert_greedy_equivalent(toks, ref, logits)


@pytest.fixture(scope="module")
def gemma4():
    return tiny_model("gemma4", vocab_size=VOCAB, init_scale=0.3, seed=0)


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_every_registered_drafter_greedy_on_a_captured_gemma4_equals_eager(gemma4, name):
    """Gemma 4 (sliding-window masks per layer type, KV-shared layers, per-layer inputs), as the
    conformance suite runs every registered drafter on it."""
    outs = []
    for mode in ("graphs", "eager"):
        t = Target(gemma4, capture=mode)
        res = run(t, DRAFTERS[name].tiny(t), GreedyVerifier(), [Request(p, 8) for p in PROMPTS], k=3,
                  eos_token_ids=set())
        outs.append([r.tokens for r in res.requests])
    assert outs[0] == outs[1]


def test_autoregressive_on_the_captured_step_equals_eager_on_gemma4(gemma4):
    """Sliding-window masks (one per layer type) and KV-shared layers over the whole capacity."""
    m = gemma4
    reqs = lambda: [Request(p, 12) for p in PROMPTS]  # noqa: E731
    a = run(Target(m, capture="eager"), None, GreedyVerifier(), reqs(), eos_token_ids=set())
    b = run(Target(m, capture="graphs"), None, GreedyVerifier(), reqs(), eos_token_ids=set())
    assert [r.tokens for r in a.requests] == [r.tokens for r in b.requests]


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_every_drafter_sampled_on_the_captured_step_matches_the_target(graphs, name):
    """The conformance suite's exact goodness-of-fit, at its first setting, through the captured step."""
    drafter = DRAFTERS[name].tiny(graphs)
    r = sampled_gof(graphs, drafter, RejectionVerifier(), [1, 2, 3, 4], SamplingParams(temperature=1.0), n_samples=3000)
    assert len(r.pvalues) >= 3
    worst = min(zip(r.pvalues, r.tests))
    assert worst[0] > 1e-3 / len(r.pvalues), f"not the target's distribution: {worst[1]} p={worst[0]:.2e}"


def test_the_switch_is_honoured_and_recorded(model):
    """The summary names the mode, and the recorded step is what ran every step after the prefill."""
    t = Target(model, capture="graphs")
    res = specdec.generate(t, [[1, 2, 3], [4, 5]], drafter="ngram", max_new_tokens=8, k=2, progress=False)
    assert res.summary.capture == "graphs"
    steps = t._steps
    assert steps is not None and steps.calls == res.run.metrics.batch_steps and steps.captures >= 1
    eager = Target(model, capture="eager")
    res = specdec.generate(eager, [[1, 2, 3]], max_new_tokens=4, progress=False)
    assert res.summary.capture == "eager" and eager._steps is None


def test_a_second_session_of_the_same_shapes_replays_the_first_recordings(model):
    """The arena hands the next session the last one's K/V buffers: no new recording."""
    t = Target(model, capture="graphs")
    reqs = lambda: [Request([1, 2, 3, 4], 6), Request([5, 6, 7, 8], 6)]  # noqa: E731
    first = run(t, None, GreedyVerifier(), reqs(), eos_token_ids=set())
    captures = t._steps.captures
    second = run(t, None, GreedyVerifier(), reqs(), eos_token_ids=set())
    assert t._steps.captures == captures and [r.tokens for r in first.requests] == [r.tokens for r in second.requests]


class _HostReads(TorchDispatchMode):
    """Counts the ops that copy a device value to the host (``.item()``, ``.tolist()``, ``bool(t)``,
    ``nonzero``): none may run inside a captured region."""

    HOST = {"aten::_local_scalar_dense", "aten::nonzero", "aten::item", "aten::equal", "aten::is_nonzero"}

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_the_captured_region_reads_nothing_on_the_host(model, monkeypatch):
    t = Target(model, capture="graphs")
    seen: list[list[str]] = []
    inner = Target._static_step

    def spied(self, *args):
        with _HostReads() as spy:
            out = inner(self, *args)
        seen.append(spy.ops)
        return out

    monkeypatch.setattr(Target, "_static_step", spied)
    run(t, CASES["eagle3[static_tree]"](t), GreedyVerifier(), [Request(p, 6) for p in PROMPTS], k=3, eos_token_ids=set())
    assert seen and all(ops for ops in seen)
    host = sorted({op for ops in seen for op in ops if op in _HostReads.HOST})
    assert not host, f"host reads inside the captured region: {host}"


@pytest.mark.parametrize("family", ["llama", "gemma4", "qwen3"])
def test_the_captured_region_is_one_whole_graph(family, monkeypatch):
    """capture="compile" traces the step with fullgraph=True: a graph break (a host read, a
    data-dependent branch, an untraceable call) raises. The output is the eager path's."""
    monkeypatch.setattr(capture, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    m = tiny_model(family, vocab_size=VOCAB, init_scale=0.3, seed=0)
    reqs = lambda: [Request([1, 2, 3, 4], 5), Request([5, 6], 5)]  # noqa: E731
    t = Target(m, capture="compile")
    drafter = CASES["random[tree,iid]"](t)
    out = run(t, drafter, GreedyVerifier(), reqs(), k=3, eos_token_ids=set())
    assert t._steps.mode == "compile" and t._steps.calls == out.metrics.batch_steps
    ref = run(Target(m, capture="eager"), None, GreedyVerifier(), reqs(), eos_token_ids=set())
    assert [r.tokens for r in out.requests] == [r.tokens for r in ref.requests]


@pytest.mark.parametrize("mode", ["graphs", "compile"])
@pytest.mark.parametrize("name", ["dflash", "dflash2", "dspark"])
def test_the_block_drafters_forward_is_captured_every_step(model, monkeypatch, mode, name):
    """The block drafters' per-step forward runs through their captured block on every propose,
    as one whole graph under "compile"; the output is the eager run's."""
    monkeypatch.setattr(capture, "COMPILE_BACKEND", "eager")
    reqs = lambda: [Request(p, 8) for p in PROMPTS]  # noqa: E731
    t = Target(model, capture=mode)
    drafter = DRAFTERS[name].tiny(t)
    out = run(t, drafter, GreedyVerifier(), reqs(), k=3, eos_token_ids=set())
    assert drafter._steps is not None and drafter._steps.mode == mode
    assert drafter._steps.calls == out.metrics.batch_steps  # one block forward per step, every one captured
    eager = Target(model, capture="eager")
    ref_drafter = DRAFTERS[name].tiny(eager)
    ref = run(eager, ref_drafter, GreedyVerifier(), reqs(), k=3, eos_token_ids=set())
    assert ref_drafter._steps is None
    assert [r.tokens for r in out.requests] == [r.tokens for r in ref.requests]


@pytest.mark.parametrize("mode", ["graphs", "compile"])
@pytest.mark.parametrize("case", ["gemma_mtp[tiny]", "gemma_mtp[ordered_embeddings]"])
def test_the_gemma_assistant_pass_is_captured_every_draft(model, monkeypatch, mode, case):
    """The Gemma-style assistant reads the captured target's cache over its whole capacity: each of
    its k passes a step runs through its captured pass, equal to the eager run."""
    monkeypatch.setattr(capture, "COMPILE_BACKEND", "eager")
    reqs = lambda: [Request(p, 8) for p in PROMPTS]  # noqa: E731
    t = Target(model, capture=mode)
    drafter = CASES[case](t)
    out = run(t, drafter, GreedyVerifier(), reqs(), k=3, eos_token_ids=set())
    assert drafter._steps is not None and drafter._steps.calls == 3 * out.metrics.batch_steps
    eager = Target(model, capture="eager")
    ref = run(eager, CASES[case](eager), GreedyVerifier(), reqs(), k=3, eos_token_ids=set())
    assert [r.tokens for r in out.requests] == [r.tokens for r in ref.requests]


@pytest.mark.parametrize("mode", ["graphs", "compile"])
@pytest.mark.parametrize("case", ["eagle3[tiny]", "eagle3[static_tree]", "eagle3[dynamic_tree]", "eagle3[window]",
                                  "eagle3[bf16_draft]"])
def test_the_eagle3_draft_blocks_are_captured(model, monkeypatch, mode, case):
    """Every block of EAGLE-3 draft nodes runs through its captured block (one whole graph under
    "compile"), equal to the eager run."""
    monkeypatch.setattr(capture, "COMPILE_BACKEND", "eager")
    reqs = lambda: [Request(p, 8) for p in PROMPTS]  # noqa: E731
    t = Target(model, capture=mode)
    drafter = CASES[case](t)
    out = run(t, drafter, GreedyVerifier(), reqs(), k=3, eos_token_ids=set())
    assert drafter._steps is not None and drafter._steps.calls >= 2 * out.metrics.batch_steps  # a block per depth
    eager = Target(model, capture="eager")
    ref = run(eager, CASES[case](eager), GreedyVerifier(), reqs(), k=3, eos_token_ids=set())
    assert [r.tokens for r in out.requests] == [r.tokens for r in ref.requests]


@pytest.mark.parametrize("mode", ["graphs", "compile"])
@pytest.mark.parametrize("case", ["mtp[tiny]", "mtp[bf16_head]", "mtp[draft_vocab]"])
def test_the_mtp_streams_are_captured(model, monkeypatch, mode, case):
    """Every MTP stream's block runs through its captured module (one whole graph under "compile"),
    equal to the eager run."""
    monkeypatch.setattr(capture, "COMPILE_BACKEND", "eager")
    reqs = lambda: [Request(p, 8) for p in PROMPTS]  # noqa: E731
    t = Target(model, capture=mode)
    drafter = CASES[case](t)
    out = run(t, drafter, GreedyVerifier(), reqs(), k=3, eos_token_ids=set())
    # a block per stream and step, each stream's first (which allocates its cache) eager
    assert drafter._steps is not None and drafter._steps.calls == 3 * (out.metrics.batch_steps - 1)
    eager = Target(model, capture="eager")
    ref = run(eager, CASES[case](eager), GreedyVerifier(), reqs(), k=3, eos_token_ids=set())
    assert [r.tokens for r in out.requests] == [r.tokens for r in ref.requests]

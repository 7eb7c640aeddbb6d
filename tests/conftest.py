"""Shared fixtures: tiny random targets (no downloads) and the conformance cases.

Every drafter in the registry is built with its own ``tiny(target)`` factory; a registered
drafter without one fails the suite (it is an abstract method), it is never skipped. Extra cases
cover behaviours random tiny weights cannot reach: a draft model equal to the target (everything
accepted) and adversarial random chains and trees with every sibling-sampling mode.

Two tiers (docs/testing.md): ``-m "not slow"`` runs the unit tests and the conformance suite on
tiny random targets; ``-m slow`` the real SmolLM2-135M, the notebook, kernel compilation and the
committed SmolLM2 checkpoints. A test that asks for the real model must be marked slow (checked at
collection), so the fast tier never loads it.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
# Triton kernels run in Triton's CPU interpreter in the tests (tests/test_kernels.py). The flag
# must be set before triton is first imported (transformers imports it when it is installed):
# the helpers of triton.language are compiled-or-interpreted at import time.
os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)  # tiny models: threads cost more than they give

# tests/interop needs the real speculators package in a side environment (`make interop`): never
# collected by `make test`, only with SPECDEC_INTEROP=1
collect_ignore = [] if os.environ.get("SPECDEC_INTEROP") else ["interop"]

from specdec.drafters import DraftModelDrafter  # noqa: E402
from specdec.policy import StepCosts  # noqa: E402
from specdec.registry import DRAFTERS as REGISTRY  # noqa: E402
from specdec.target import Target  # noqa: E402
from specdec.testing import RandomDrafter, Recording  # noqa: E402
from specdec.testing.tiny import tiny_model  # noqa: E402

VOCAB = 32
TOKEN_MAP = (5, 0, 17, 3, 30, 9, 12, 1, 26, 8, 21, 14, 2, 11)  # ranked ids; the draft_vocab cases keep the first 12


def _registry_case(name):
    return lambda target: REGISTRY.get(name).tiny(target)


# every drafter the registry knows (specdec's own and any installed package's), by its tiny() factory
DRAFTERS = {name: REGISTRY.get(name) for name in REGISTRY.names()}
CASES = {f"{name}[tiny]": _registry_case(name) for name in DRAFTERS}
CASES.update({
    "draft_model[self]": lambda t: DraftModelDrafter.create(t, model=t.model),
    "gemma_mtp[ordered_embeddings]": lambda t: DRAFTERS["gemma_mtp"].tiny(t, use_ordered_embeddings=True),
    "dflash[greedy_draft]": lambda t: DRAFTERS["dflash"].tiny(t, greedy_draft=True),
    "dspark[gated]": lambda t: DRAFTERS["dspark"].tiny(t, markov_head_type="gated"),
    "dspark[rnn]": lambda t: DRAFTERS["dspark"].tiny(t, markov_head_type="rnn"),
    "eagle3[static_tree]": lambda t: DRAFTERS["eagle3"].tiny(t, tree="static"),
    "eagle3[dynamic_tree]": lambda t: DRAFTERS["eagle3"].tiny(t, tree="dynamic", tree_top_k=3, tree_budget=10),
    "eagle3[eagle3.1]": lambda t: DRAFTERS["eagle3"].tiny(t, fc_norm=True, norm_output=True),  # EAGLE-3.1 flags on
    "eagle3[bf16_draft]": lambda t: DRAFTERS["eagle3"].tiny(t, dtype="bfloat16"),  # a bf16 draft for an fp32 target
    "eagle3[window]": lambda t: DRAFTERS["eagle3"].tiny(t, window=2),  # sliding-window draft attention, 2 positions
    "mtp[bf16_head]": lambda t: DRAFTERS["mtp"].tiny(t, head_dtype="bfloat16"),  # drafting through a bf16 copy of the head
    "dflash[bf16_head]": lambda t: DRAFTERS["dflash"].tiny(t, head_dtype="bfloat16"),
    "dspark[bf16_head]": lambda t: DRAFTERS["dspark"].tiny(t, head_dtype="bfloat16"),
    # drafting over a subset of the target's head (a token map, FR-Spec): the rest is never proposed
    "mtp[draft_vocab]": lambda t: DRAFTERS["mtp"].tiny(t, token_map=TOKEN_MAP, draft_vocab=12),
    "dflash[draft_vocab]": lambda t: DRAFTERS["dflash"].tiny(t, token_map=TOKEN_MAP, draft_vocab=12),
    "dspark[draft_vocab]": lambda t: DRAFTERS["dspark"].tiny(t, token_map=TOKEN_MAP, draft_vocab=12,
                                                            head_dtype="bfloat16"),
    "random[chain,iid]": lambda t: RandomDrafter.create(t, siblings="iid"),
    "random[tree,iid]": lambda t: RandomDrafter.create(t, siblings="iid", branching=[2, 2]),
    "random[tree,without_replacement]": lambda t: RandomDrafter.create(t, siblings="without_replacement", branching=[3, 1]),
    "random[tree,deterministic]": lambda t: RandomDrafter.create(t, siblings="deterministic", branching=[2, 2]),
})

# DSpark with its prefix scheduler, under cost tables that make it draft: with the table it profiles
# on this CPU it drafts almost nothing, so the suite would never reach its drafting path. Verifying a
# token costs 1e-4 of a forward's fixed cost (the Θ trade-off: the q-contract's 4000-row batch
# verifies 2 of its 3 drafts, a 3-row batch all of them), or almost nothing with one budget of 1800
# drafts for the batch (which binds at the χ² tests' 1000 rows). The fixture asserts after each
# test that some step verified a draft.
SCHEDULED = {
    "dspark[scheduler,tradeoff]": dict(costs=StepCosts.linear(per_token=1e-4, fixed=1.0, draft=0.05), ragged=True),
    "dspark[scheduler,budget]": dict(costs=StepCosts.linear(per_token=1e-5, fixed=1.0, draft=0.05), budget=1800,
                                     ragged=True),
}
CASES.update({name: (lambda t, o=o: Recording(DRAFTERS["dspark"].tiny(t, scheduler=True, **o)))
              for name, o in SCHEDULED.items()})
# A scheduled case shares one verification budget across the batch, so a row's random stream (not
# its distribution) depends on the other rows by design (docs/architecture.md): it is not generated
# for the batch-independence test.
BATCH_COUPLED = set(SCHEDULED)


# Conformance targets: every case runs on the tiny Llama; every registered drafter's tiny case runs
# on Gemma 4 too (per-layer head sizes, proportional RoPE, KV-shared layers, per-layer inputs), its
# sampled tests at the first setting only (_gemma4_beyond_the_first_setting). The other tests that
# take ``target`` get the Llama.
TARGETS = ("llama", "gemma4")
TARGET_CASES = [("llama", c) for c in sorted(CASES)] + [("gemma4", f"{name}[tiny]") for name in sorted(DRAFTERS)]


# The conformance tests that take ``sampled_verifier`` run ``rejection`` on every case and each other
# lossless verifier (SAMPLED_VERIFIERS) on these chains: a deterministic drafter (q None), learned
# drafters with q (EAGLE-3, DSpark's block), adversarial random q and a draft equal to the target
# (p = q: block verification's threshold denominators are 0). Block verification hands trees to
# rejection sampling unchanged (tests/test_block_verifier.py), so no tree case is repeated for it.
VERIFIER_CASES = ("ngram[tiny]", "eagle3[tiny]", "dspark[tiny]", "random[chain,iid]", "draft_model[self]")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "drafter_case" in metafunc.fixturenames:
        coupled = metafunc.function.__name__ == "test_rows_do_not_depend_on_their_batch"
        pairs = [(t, c) for t, c in TARGET_CASES if not (coupled and c in BATCH_COUPLED)]
        if "sampled_verifier" not in metafunc.fixturenames:
            metafunc.parametrize(("target", "drafter_case"), pairs, indirect=True, ids=[f"{t}-{c}" for t, c in pairs])
            return
        from specdec.testing.conformance import SAMPLED_VERIFIERS

        triples = [(t, c, "rejection") for t, c in pairs] + [
            ("llama", c, v) for v in SAMPLED_VERIFIERS if v != "rejection" for c in VERIFIER_CASES]
        metafunc.parametrize(("target", "drafter_case", "sampled_verifier"), triples, indirect=["target", "drafter_case"],
                             ids=[f"{t}-{c}-{v}" for t, c, v in triples])


@pytest.fixture(scope="session")
def target(request) -> Target:
    """A tiny target (Llama unless a case names another) with peaked distributions (so top-k and
    top-p cut something)."""
    family = getattr(request, "param", "llama")
    assert family in TARGETS, family
    return Target(tiny_model(family, vocab_size=VOCAB, init_scale=0.3, seed=0))


@pytest.fixture
def drafter_case(request, target):
    drafter = CASES[request.param](target)
    yield request.param, drafter
    if request.param in SCHEDULED:
        assert any(bool((p.num_valid > 0).any()) for p in drafter.proposals), "the scheduler never verified a draft"


@pytest.fixture
def quiet_machine(monkeypatch):
    """A quiet machine for the few-row tuner (specdec.few_rows): no other load, whatever else runs on
    the tests' own machine, and a cached plan's spot check finding its products as fast as when they
    were tuned. A test plants other load (``["load"]``) or a slow product (``["spot"]``) by changing
    these."""
    from specdec import few_rows as fr

    machine = {"load": 0.0, "spot": lambda model, plan: {r: (0.5, 1.0) for r in plan if r in fr.ROW_COUNTS}}
    monkeypatch.setattr(fr, "other_load", lambda own_threads=0, running_s=0.0: machine["load"])
    monkeypatch.setattr(fr, "spot_check", lambda model, plan, reps=3: machine["spot"](model, plan))
    return machine


@pytest.fixture(autouse=True)
def _lossy_warnings_as_in_a_fresh_process():
    """A lossy verifier warns once per process (specdec.loop); each test starts as a new process would,
    so a test that expects the warning sees it whatever ran before."""
    import specdec.loop

    specdec.loop._WARNED_LOSSY.clear()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The modules, models and test items alive after collection live as long as the session: moved
    out of the collector's reach (``gc.freeze``), the cyclic collections the tests trigger no longer
    walk them (on the conformance suite's 4,000-row runs that was a fifth of the time)."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Frozen objects back under the collector, so the interpreter tears them down as usual at exit."""
    import gc

    gc.unfreeze()


def _gemma4_beyond_the_first_setting(item: pytest.Item) -> bool:
    """A sampled conformance test on the Gemma 4 target at a setting other than the first (T = 1).
    Gemma 4 is there for what the target does (per-layer head sizes, proportional RoPE, KV-shared
    layers, per-layer inputs), which every setting exercises alike; the settings themselves (top-k,
    top-p, temperature, a support smaller than a tree's siblings) are about the drafter's q and the
    verifier, and every case runs all of them on the Llama target."""
    from specdec.testing.conformance import SETTINGS

    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("target") == "gemma4" and "sampling" in params and params["sampling"] != SETTINGS[0]


def pytest_configure(config: pytest.Config) -> None:
    """A lossy verifier warns (specdec.loop); a test that uses one on purpose asserts the warning
    (pytest.warns), so one anywhere else is an error, not noise in the summary. Added here, not in
    pyproject's ``filterwarnings``: resolving the category there imports the library (and triton)
    before this file sets ``TRITON_INTERPRET``."""
    config.addinivalue_line("filterwarnings", "error::specdec.loop.LossyVerifierWarning")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [i.nodeid for i in items
                if "smollm2" in getattr(i, "fixturenames", ()) and not i.get_closest_marker("slow")]
    if unmarked:
        raise pytest.UsageError(f"tests using the real SmolLM2 must be marked slow: {unmarked}")
    beyond = [_gemma4_beyond_the_first_setting(i) for i in items]
    if any(beyond):  # reported as deselected, with the reason above
        config.hook.pytest_deselected(items=[i for i, b in zip(items, beyond) if b])
        items[:] = [i for i, b in zip(items, beyond) if not b]


@pytest.fixture(scope="session")
def smollm2() -> Target:
    """The real offline SmolLM2-135M-Instruct in fp32 (slow tests only), loaded once per session."""
    import specdec

    return specdec.load_target("smollm2-135m", dtype=torch.float32)

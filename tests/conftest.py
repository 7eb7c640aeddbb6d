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

from specdec.drafters import DraftModelDrafter  # noqa: E402
from specdec.registry import DRAFTERS as REGISTRY  # noqa: E402
from specdec.target import Target  # noqa: E402
from specdec.testing import RandomDrafter  # noqa: E402
from specdec.testing.tiny import tiny_model  # noqa: E402

VOCAB = 32


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
    "random[chain,iid]": lambda t: RandomDrafter.create(t, siblings="iid"),
    "random[tree,iid]": lambda t: RandomDrafter.create(t, siblings="iid", branching=[2, 2]),
    "random[tree,without_replacement]": lambda t: RandomDrafter.create(t, siblings="without_replacement", branching=[3, 1]),
    "random[tree,deterministic]": lambda t: RandomDrafter.create(t, siblings="deterministic", branching=[2, 2]),
})


@pytest.fixture(scope="session")
def target() -> Target:
    """A tiny Llama with peaked distributions (so top-k and top-p cut something)."""
    return Target(tiny_model("llama", vocab_size=VOCAB, init_scale=0.3, seed=0))


@pytest.fixture(params=sorted(CASES))
def drafter_case(request, target):
    return request.param, CASES[request.param](target)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unmarked = [i.nodeid for i in items
                if "smollm2" in getattr(i, "fixturenames", ()) and not i.get_closest_marker("slow")]
    if unmarked:
        raise pytest.UsageError(f"tests using the real SmolLM2 must be marked slow: {unmarked}")


@pytest.fixture(scope="session")
def smollm2() -> Target:
    """The real offline SmolLM2-135M-Instruct in fp32 (slow tests only), loaded once per session."""
    import specdec

    return specdec.load_target("smollm2-135m", dtype=torch.float32)

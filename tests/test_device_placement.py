"""Device placement: every training recipe's step and every drafter's generation make their
tensors where the tensors they meet live, so they run on a GPU unchanged.

On a GPU, a factory call (``torch.arange``, ``zeros``, ``full``, ``tensor``, ``randperm`` ...) that
names no device makes a CPU tensor, and it fails only when it meets the model's CUDA tensors: no
CPU-only run can see it. Here the model and the data stay on the CPU while torch's *default* device
is ``meta`` (``with torch.device("meta")``): every factory call that names no device makes a meta
tensor, which raises when it meets a CPU tensor, is read on the host (``.tolist()``, ``.item()``)
or is moved (``.to(dev)``: a meta tensor holds no data). Code that passes names its device: the
device of the tensor its result meets (``device=x.device``), or ``"cpu"`` for what is made on the
host on purpose (a batch being collated, the policy's statistics, random draws from the trainer's
CPU generator), moved once. Each step must also compute exactly what it computes outside the
``with`` block: nothing was read from a meta tensor (a CPU tensor indexed by a meta one reads
garbage instead of raising).

The ``with`` block wraps the step only, never the building of the models (a module built under it
would get meta parameters). transformers itself runs under it unchanged.

What it cannot see: a tensor made on the host on purpose and never moved to the model's device
(state a recipe computes from its host data at build time, a held-out batch fed to the model
unmoved), since host and model share the CPU here; those were checked by reading.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from specdec.drafter import Drafter
from specdec.loop import Request, run
from specdec.policy import AdaptivePolicy, StepCosts
from specdec.registry import DRAFTERS as REGISTRY
from specdec.sampling import SamplingParams
from specdec.target import Target
from specdec.testing import RandomDrafter
from specdec.testing.planted import PlantedDrafter
from specdec.testing.tiny import tiny_model
from specdec.training.config import DataConfig
from specdec.training.data import Batch, load_data
from specdec.training.recipe import Recipe, StepOutput, as_figures, load_recipe
from specdec.verifiers import GreedyVerifier, RejectionVerifier


def _test_training():
    """tests/test_training.py as a module: its table of recipes at test sizes and its data builder
    (one table for both files)."""
    spec = importlib.util.spec_from_file_location("specdec_test_training", Path(__file__).with_name("test_training.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TT = _test_training()


def test_the_meta_default_device_catches_a_forgotten_device():
    """The check itself: a mask built with a forgotten ``device=`` (what a GPU rejects) fails under
    it; the same mask built on the tensor's device passes and is the same mask."""
    lengths = torch.tensor([3, 5])

    def forgot(lengths: torch.Tensor) -> torch.Tensor:
        return torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)

    def placed(lengths: torch.Tensor) -> torch.Tensor:
        return torch.arange(6, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)

    with torch.device("meta"), pytest.raises(RuntimeError, match="device"):
        forgot(lengths)
    with torch.device("meta"):
        mask = placed(lengths)
    assert mask.device.type == "cpu" and torch.equal(mask, forgot(lengths))
    with torch.device("meta"), pytest.raises(NotImplementedError, match="meta"):  # made on the host, moved
        torch.tensor([1, 2]).to(lengths.device)


# --- training: one step of every recipe ----------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_target() -> Target:
    return Target(tiny_model("llama", vocab_size=TT.V, init_scale=0.3, seed=0))


def _step(recipe: Recipe, model: torch.nn.Module, batch: Batch) -> tuple[StepOutput, list[torch.Tensor]]:
    """One training step's loss and gradients (anchors drawn from a fresh seeded generator)."""
    model.zero_grad(set_to_none=True)
    out = recipe.loss(model, batch, torch.Generator().manual_seed(0))
    out.loss.backward()
    return out, [p.grad for p in model.parameters() if p.requires_grad]


def _steps_on_its_own_device(recipe: Recipe, model: torch.nn.Module, data) -> None:
    """A training step (loss and backward), a held-out evaluation and the recipe's finish, each
    under the meta default device; the step's loss, figures and gradients equal the ones
    computed outside it."""
    batch = data.batch(data.train[:2])
    model.train()
    ref, ref_grads = _step(recipe, model, batch)
    with torch.device("meta"):
        out, grads = _step(recipe, model, batch)
    assert out.loss.device.type == "cpu" and torch.equal(out.loss, ref.loss)
    assert as_figures(out.metrics) == as_figures(ref.metrics)
    assert all(g is not None and g.device.type == "cpu" for g in grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert data.held
    model.eval()
    with torch.device("meta"), torch.no_grad():
        held = recipe.loss(model, data.batch(data.held[:2]), torch.Generator().manual_seed(1))
    model.train()
    assert torch.isfinite(held.loss)
    with torch.device("meta"):
        recipe.finish(model, data, torch.Generator().manual_seed(2))


@pytest.mark.parametrize("name", sorted(TT.RECIPES))
def test_every_recipe_steps_with_tensors_only_where_it_places_them(name, tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    path, options = TT.RECIPES[name]
    recipe = load_recipe(path, options)
    featurize = lambda tokens: recipe.featurize(tiny_target, tokens)  # noqa: E731
    data = load_data(DataConfig(path=str(TT.random_data(tmp_path / "d.safetensors")), held_out_every=4,
                                feature_dtype="float32"), tiny_target, featurize, recipe.feature_key(tiny_target))
    torch.manual_seed(0)
    _steps_on_its_own_device(recipe, recipe.build(tiny_target, data), data)


def test_the_mtp_recipe_from_scratch_steps_with_tensors_only_where_it_places_them(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    recipe = load_recipe("specdec.drafters.mtp.train.JointMTPRecipe", dict(depth=2, model=TT.TINY_DEEPSEEK))
    data = load_data(DataConfig(source="stdlib", window=33, vocab_size=300, max_files=1, use=16), None)
    torch.manual_seed(0)
    _steps_on_its_own_device(recipe, recipe.build(None, data), data)


# --- generation: every registered drafter ----------------------------------------------------------

def _adaptive() -> AdaptivePolicy:
    """The adaptive policy with a cost table under which drafting pays (so it verifies drafts)."""
    tokens = [2 ** i for i in range(10)]
    return AdaptivePolicy(costs=StepCosts(tokens, [t ** 0.5 for t in tokens], [1], [0.0]), probe_every=2)


# the tree, scheduler and test drafters beside every registered drafter's tiny() (on both targets)
EXTRA = {
    "eagle3[static_tree]": lambda t: REGISTRY.get("eagle3").tiny(t, tree="static"),
    "eagle3[dynamic_tree]": lambda t: REGISTRY.get("eagle3").tiny(t, tree="dynamic", tree_top_k=3, tree_budget=10),
    "dspark[scheduler]": lambda t: REGISTRY.get("dspark").tiny(
        t, scheduler=True, costs=StepCosts.linear(per_token=1e-4, fixed=1.0, draft=0.05), ragged=True),
    "random[tree]": lambda t: RandomDrafter.create(t, siblings="without_replacement", branching=[3, 1]),
    "planted": lambda t: PlantedDrafter.tiny(t),
}
CASES = ([("llama", n) for n in REGISTRY.names()] + [("gemma4", n) for n in REGISTRY.names()]
         + [("llama", n) for n in EXTRA] + [("llama", "autoregressive")])


def _generate(target: Target, drafter: Drafter | None, sampled: bool) -> list[list[int]]:
    """Two requests of different lengths (the shorter row retires mid-run): greedy with every
    proposed node verified, or sampled (seeded rows, one with top-k and top-p) with the adaptive policy."""
    if sampled:
        reqs = [Request([1, 2, 3, 4], 5, SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3)),
                Request([5, 6], 9, SamplingParams(temperature=1.0, seed=7))]
        verifier, policy = RejectionVerifier(), _adaptive()
    else:
        reqs, verifier, policy = [Request([1, 2, 3, 4], 5), Request([5, 6], 9)], GreedyVerifier(), None
    res = run(target, drafter, verifier, reqs, k=3, eos_token_ids=set(), policy=policy)
    return [r.tokens for r in res.requests]


@pytest.mark.parametrize(("target", "case"), CASES, indirect=["target"], ids=[f"{t}-{c}" for t, c in CASES])
def test_every_drafter_generates_with_tensors_only_where_it_places_them(target, case):
    """Greedy and sampled generation under the meta default device give the tokens they give
    outside it. Each generation gets a drafter built outside it, fresh (drafters keep state)."""
    def drafter() -> Drafter | None:
        if case == "autoregressive":
            return None
        return EXTRA[case](target) if case in EXTRA else REGISTRY.get(case).tiny(target)

    for sampled in (False, True):
        expected = _generate(target, drafter(), sampled)
        fresh = drafter()
        with torch.device("meta"):
            assert _generate(target, fresh, sampled) == expected

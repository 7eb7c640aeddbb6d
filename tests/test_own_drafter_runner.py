"""A drafter of one's own through the Hydra runner (docs/experiments.md, "Benchmark your own
drafter"): ``drafter.name=mine`` over the default drafter group does not inherit ngram's options,
options given on the command line stay, and the run goes through."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from specdec.drafters.ngram import NgramDrafter
from specdec.eval.runner import run_experiment
from specdec.paths import REPO_ROOT
from specdec.registry import DRAFTERS

CONF = REPO_ROOT / "experiments" / "conf"
TINY = ["target=tiny", "dataset=random", "dataset.num_prompts=2", "dataset.input_len=8", "dataset.output_len=4",
        "progress=false", "warmup=false"]


class Mine(NgramDrafter):
    """A drafter of one's own that takes one option of its own and none of ngram's."""

    name = "mine"

    @classmethod
    def create(cls, target, width: int = 2) -> "Mine":
        drafter = cls()
        drafter.width = width
        drafter.bind(target)
        return drafter

    @classmethod
    def tiny(cls, target, **overrides: Any) -> "Mine":
        return cls.create(target, **overrides)


@pytest.fixture
def mine():
    DRAFTERS.register(Mine)
    yield
    DRAFTERS.unregister("mine")


@pytest.fixture
def entry():
    spec = importlib.util.spec_from_file_location("specdec_experiments_run_mine", REPO_ROOT / "experiments" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield module
    GlobalHydra.instance().clear()


def test_drafter_name_mine_does_not_inherit_ngrams_options(mine, entry, tmp_path):
    run = entry.to_run_config(compose(config_name="config", overrides=["drafter.name=mine", *TINY],
                                      return_hydra_config=True))
    assert run.drafter.name == "mine" and run.drafter.options == {}
    res = run_experiment(run, out_dir=tmp_path / "mine")
    assert set(res.summary) == {"ar", "spec"} and res.summary["spec"]["drafter"] == "mine"
    assert res.tokens("spec") == res.tokens("ar")  # greedy: the same tokens

    given = entry.to_run_config(compose(config_name="config", return_hydra_config=True,
                                        overrides=["drafter.name=mine", "+drafter.options.width=3", *TINY]))
    assert given.drafter.options == {"width": 3}
    kept = entry.to_run_config(compose(config_name="config", return_hydra_config=True,
                                       overrides=["drafter.name=mine", "drafter.options.max_ngram=2", *TINY]))
    assert kept.drafter.options == {"max_ngram": 2}  # set on the command line: kept, and refused by name below
    with pytest.raises((TypeError, ValueError), match="max_ngram"):
        run_experiment(kept)
    ngram = entry.to_run_config(compose(config_name="config", return_hydra_config=True, overrides=TINY))
    assert ngram.drafter.name == "ngram" and ngram.drafter.options == {"max_ngram": 3, "min_ngram": 1}

"""The supported transformers range: its floor said alike in pyproject.toml, the Makefile and
specdec.transformers_versions; the cache argument named as the installed release's models take it;
a cache argument a model swallows fails loudly instead of giving wrong logits. `make test-floor` runs
this file at the floor too."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel

from specdec import transformers_versions as tv
from specdec.target import Target
from specdec.testing import greedy_reference
from specdec.testing.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_the_range_is_the_same_in_pyproject_the_makefile_and_the_code():
    pyproject = (ROOT / "pyproject.toml").read_text()
    makefile = (ROOT / "Makefile").read_text()
    spec = re.search(r'"transformers(>=[^"]+)"', pyproject).group(1).split(",")
    assert spec == [f">={tv.FLOOR}"] + [f"!={v}" for v in sorted(tv.EXCLUDED)]
    assert re.search(r"^TF_FLOOR := ([\d.]+)$", makefile, re.M).group(1) == str(tv.FLOOR)


def test_the_cache_argument_is_the_one_the_installed_models_take():
    for forward in (LlamaModel.forward, LlamaDecoderLayer.forward):
        params = inspect.signature(forward).parameters  # through deprecate_kwarg's wrapper
        assert tv.CACHE_ARG in params, (transformers.__version__, tv.CACHE_ARG, list(params))
    assert tv.cache_kwargs("c") == {tv.CACHE_ARG: "c"}


def test_an_older_transformers_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(tv.transformers, "__version__", "5.7.0")
    with pytest.raises(ImportError, match=rf"transformers >= {tv.FLOOR}; found 5\.7\.0"):
        tv.check_supported()
    monkeypatch.setattr(tv.transformers, "__version__", f"{tv.FLOOR}.dev0")
    tv.check_supported()  # a dev build of the floor release counts as that release
    monkeypatch.setattr(tv.transformers, "__version__", "5.23.0")
    with pytest.warns(UserWarning, match="outside specdec's range: its Gemma 4 config"):
        tv.check_supported()


def test_a_swallowed_cache_argument_fails_instead_of_attending_to_the_block_alone(monkeypatch):
    """A release whose models take the cache by another name swallow ours in **kwargs and run with
    a fresh cache: the target and the conformance reference both say so."""
    model = tiny_model("llama", vocab_size=32)
    target = Target(model)
    session = target.new_session(1)
    target.prefill(session, [[1, 2, 3]])
    monkeypatch.setattr(tv, "CACHE_ARG", "not_a_cache_argument")
    with pytest.raises(RuntimeError, match="wrote no K/V into the store"):
        target.forward(session, torch.tensor([[4]]))
    with pytest.raises(RuntimeError, match="did not fill the DynamicCache"):
        greedy_reference(model, [1, 2, 3], 2)


def test_a_peer_feature_older_than_the_installed_release_is_refused_by_name(monkeypatch):
    for feature, first in tv.FEATURES.items():
        assert tv.FLOOR < first
        monkeypatch.setattr(tv.transformers, "__version__", str(first))
        tv.require(feature)
        monkeypatch.setattr(tv.transformers, "__version__", str(tv.FLOOR))
        with pytest.raises(RuntimeError, match=rf"needs transformers >= {first}; found {tv.FLOOR}"):
            tv.require(feature)

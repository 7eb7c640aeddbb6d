"""The ceiling study's plan (experiments/benchmarks/ceiling.py): which store rows and steps each arm
trains on, the features-zeroed copy of a head, and the options refused before any work."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file


def _ceiling():
    experiments = str(Path(__file__).resolve().parents[1] / "experiments")
    if experiments not in sys.path:
        sys.path.insert(0, experiments)
    return importlib.import_module("benchmarks.ceiling")


# 12 rows of 10 tokens; row 1 is held out; sources alternate corpus / sharegpt
ROWS = ([10] * 12, [i == 1 for i in range(12)], ["corpus" if i % 2 == 0 else "sharegpt" for i in range(12)])


def test_fresh_and_epochs_train_equal_steps_on_one_and_a_third_of_the_data():
    c = _ceiling()
    assert c.arm_plan(ROWS, c.ARMS["fresh"], 60, 2) == (7, 3, 60)  # 7 rows, one held out: 6 trained, 3 steps
    use, steps, got = c.arm_plan(ROWS, c.ARMS["epochs"], 60, 2)
    assert (use, steps, got) == (3, 3, 20)  # 2 training rows (20 tokens) over fresh's 3 steps
    assert c.arm_plan(ROWS, c.ARMS["anchors"], 60, 2) == (7, 3, 60)


def test_a_source_arm_reads_its_own_rows_alone_at_equal_tokens():
    c = _ceiling()
    assert c.arm_plan(ROWS, c.ARMS["on_policy"], 40, 2) == (4, 2, 40)  # rows 0, 2, 4, 6
    assert c.arm_plan(ROWS, c.ARMS["text"], 40, 2) == (5, 2, 40)  # rows 1 (held out), 3, 5, 7, 9
    with pytest.raises(ValueError, match="sources corpus"):
        c.arm_plan(ROWS, c.ARMS["on_policy"], 70, 2)


def test_the_tokens_only_copy_zeroes_the_feature_projection_alone(tmp_path):
    c = _ceiling()
    src = tmp_path / "fresh"
    src.mkdir()
    weights = {"fc.weight": torch.randn(4, 12), "layers.0.x": torch.randn(3)}
    save_file(weights, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    (src / "decoded.json").write_text("{}")
    dest = c._zero_features(src, tmp_path / "tokens_only")
    copied = load_file(str(dest / "model.safetensors"))
    assert torch.count_nonzero(copied["fc.weight"]) == 0 and torch.equal(copied["layers.0.x"], weights["layers.0.x"])
    assert (dest / "config.json").is_file() and not (dest / "decoded.json").exists()
    save_file({"w": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        c._zero_features(tmp_path, tmp_path / "other")


def test_bad_options_fail_before_any_work(tmp_path):
    c = _ceiling()
    with pytest.raises(SystemExit, match="unknown arms"):
        c.ceiling(str(tmp_path), store="s", arms=["fresh", "bigger"])
    with pytest.raises(SystemExit, match="fresh"):
        c.ceiling(str(tmp_path), store="s", arms=["tokens_only"])
    with pytest.raises(SystemExit, match="store"):
        c.ceiling(str(tmp_path), arms=["fresh"])

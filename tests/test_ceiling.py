"""The ceiling study's plan (experiments/benchmarks/ceiling.py): which store rows and steps each arm
trains on, the features-zeroed copy of a head, and the options refused before any work."""

from __future__ import annotations

import importlib
import json
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


def test_the_runner_trains_each_arm_into_its_own_folder_decodes_it_and_resumes(tmp_path, monkeypatch):
    """Every arm's command: the recipe's, its overrides and sources last, one out= and work= (its own
    folder); the over-fit arm reads its data set with whole prompts; tokens_only trains nothing and
    decodes fresh's head zeroed; a finished arm is skipped and an interrupted one resumed."""
    import specdec.api

    c = _ceiling()
    ran, decoded = [], []

    def fake_train(cmd, check):  # the arm's command writes its checkpoint's record
        ran.append(cmd)
        out = Path(next(a.split("=", 1)[1] for a in cmd if a.startswith("out=")))
        out.mkdir(parents=True, exist_ok=True)
        (out / "training.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    def fake_decode(target, family, checkpoint, prompts, k, n):
        decoded.append((family, Path(checkpoint).name))
        return {name: {"mean_accepted_length": 1.0} for name in prompts}

    monkeypatch.setattr(c.subprocess, "run", fake_train)
    monkeypatch.setattr(specdec.api, "load_target", lambda name: "target")
    monkeypatch.setattr(c, "held_out_prompts", lambda target, n: {"mtbench": [[1, 2]]})
    monkeypatch.setattr(c, "store_rows", lambda store: ROWS)
    monkeypatch.setattr(c, "_overfit_data", lambda target, folder, asked, n: folder / "overfit-data.safetensors")
    monkeypatch.setattr(c, "_zero_features", lambda src, dest: dest.mkdir(parents=True, exist_ok=True) or dest)
    monkeypatch.setattr(c, "decode", fake_decode)
    runs = tmp_path / "runs"
    (runs / "anchors-work").mkdir(parents=True)  # interrupted: resumed from its state
    (runs / "anchors-work" / "state.safetensors").write_bytes(b"")
    args = dict(store="st", runs=str(runs), tokens=40, batch=2, eval_sequences=4, prompts=1, k=4, max_new_tokens=8,
                threads=1, bf16=True, overfit_steps=5)
    c.run(arms=["fresh", "tokens_only", "anchors", "text", "overfit_mtp"], **args)
    outs = [[a for a in cmd if a.startswith(("out=", "work="))] for cmd in ran]
    assert outs == [[f"out={runs}/{a}", f"work={runs}/{a}-work"] for a in ("fresh", "anchors", "text", "overfit_mtp")]
    fresh, anchors, text, overfit = ran
    assert "data.use=5" in fresh and "optim.steps=2" in fresh and "resume=true" not in fresh  # 4 training rows
    assert anchors[-1] == "resume=true" and "options.anchors=64" in anchors
    assert "data.store_sources=[sharegpt]" in text
    assert overfit[3] == "train/smollm2_mtp" and "data.max_prompt=null" in overfit and "optim.steps=5" in overfit
    assert overfit.index("data.store=null") > overfit.index("data.store=st")  # the last value wins
    assert decoded == [("eagle3", "fresh"), ("eagle3", "tokens_only"), ("eagle3", "anchors"), ("eagle3", "text"),
                       ("mtp", "overfit_mtp")]
    meta = json.loads((runs / "tokens_only" / "decoded.json").read_text())
    assert meta["from_arm"] == "fresh" and meta["family"] == "eagle3"
    ran.clear()
    decoded.clear()
    c.run(arms=["fresh", "tokens_only"], **args)  # finished and decoded: nothing again
    assert ran == [] and decoded == []

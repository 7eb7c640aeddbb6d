"""Packaging: drafters/ and verifiers/ are importable only as specdec.*, and a Python started in the
repository root works like one started anywhere else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("bare", ["drafters", "verifiers"])
def test_bare_names_never_import_from_this_project(bare):
    code = f"import {bare}; print({bare}.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    # From the repository root the folder is on sys.path, so it must refuse; elsewhere it is
    # absent (or another PyPI package of that name, which is not ours).
    assert out.returncode != 0 or not out.stdout.strip().startswith(str(ROOT)), out.stdout


def test_python_started_in_the_repository_root_works():
    """`python -c` puts the working directory first on sys.path: specdec, transformers (which
    probes the PyPI name `kernels`) and the drafters must all import from there."""
    code = ("import specdec; from specdec.testing.tiny import tiny_model;"
            "t = specdec.Target(tiny_model('llama', vocab_size=32));"
            "print(specdec.generate(t, [[1, 2, 3, 1, 2]], drafter='ngram', max_new_tokens=4).tokens)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith("[[")


def test_namespaced_packages_import():
    import specdec.drafters
    import specdec.kernels
    import specdec.verifiers

    assert set(specdec.drafters.DRAFTERS) >= {"ngram", "draft_model"}
    assert set(specdec.verifiers.VERIFIERS) >= {"greedy", "rejection"}
    assert Path(specdec.kernels.__file__).parent.name == "kernels"


def test_demo_finds_every_committed_smollm2_drafter():
    from specdec.eval.demo import SMOLLM2_DRAFTERS, default_k, drafter_options
    from specdec.models import resolve_checkpoint
    from specdec.registry import DRAFTERS

    assert set(SMOLLM2_DRAFTERS) <= set(DRAFTERS.names())
    from specdec.models import committed_checkpoints

    committed = committed_checkpoints()
    assert {"eagle3", "dspark"} <= {n for n in SMOLLM2_DRAFTERS if SMOLLM2_DRAFTERS[n] in committed}
    for name in SMOLLM2_DRAFTERS:
        if SMOLLM2_DRAFTERS[name] not in committed:  # recorded only (size budget): a clear error with its recipe
            with pytest.raises(FileNotFoundError, match="is not committed.*train.py"):
                resolve_checkpoint(drafter_options(name)["checkpoint"])
            continue
        folder = resolve_checkpoint(drafter_options(name)["checkpoint"])
        assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file(), name
        assert default_k(name)[0] >= 1
    assert drafter_options("ngram") == {} and default_k("ngram")[0] == 8


def test_demo_default_k_is_the_best_k_recorded_with_the_checkpoint(tmp_path, monkeypatch):
    import json

    import specdec.models
    from specdec.eval.demo import TRAINED_K, default_k
    from specdec.training.trainer import TrainingRecord

    monkeypatch.setattr(specdec.models, "resolve_checkpoint", lambda name: tmp_path)
    record = TrainingRecord(revision=None, command="train", config={}, steps=1, tokens=1, wall_seconds=1.0, held_out={})
    record.write(tmp_path)
    k, why = default_k("eagle3")
    assert k == TRAINED_K and "no best k recorded" in why  # the trainer writes none

    measured = "make sweep-drafters: k=3 fastest, 1.21x (docs/results.md)"
    record.best_k = {"k": 3, "measured": measured}
    record.write(tmp_path)
    assert TrainingRecord.read(tmp_path).best_k == {"k": 3, "measured": measured}
    assert default_k("eagle3") == (3, f"best measured, recorded with the checkpoint: {measured}")

    for bad in ({"k": 0, "measured": measured}, {"k": 3}, 3):
        (tmp_path / "training.json").write_text(json.dumps({"best_k": bad}))
        with pytest.raises(ValueError, match="best_k must be"):
            default_k("eagle3")


def test_demo_help_documents_every_option():
    from specdec.eval.demo import parser

    options = {a.option_strings[-1]: a.help for a in parser()._actions}
    assert {"--drafter", "--k", "--prompt", "--max-new-tokens", "--temperature", "--seed", "--threads",
            "--json"} <= set(options)
    assert all(h and len(h) > 10 for h in options.values()), options
    out = subprocess.run([sys.executable, "-m", "specdec.eval.demo", "--help"], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0 and "draft and verify costs" in out.stdout, out.stderr


def test_the_demo_names_the_recipe_of_an_uncommitted_drafter_without_a_traceback():
    from specdec.eval.demo import main

    with pytest.raises(SystemExit, match="specdec-demo: checkpoint 'smollm2-135m-dflash' is not committed.*train.py"):
        main(["--drafter", "dflash", "--k", "4"])

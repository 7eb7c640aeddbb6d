"""The folders drafters/, verifiers/ and kernels/ are importable only as specdec.*."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("bare", ["drafters", "verifiers", "kernels"])
def test_bare_names_never_import_from_this_project(bare):
    code = f"import {bare}; print({bare}.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    # From the repository root the folder is on sys.path, so it must refuse; elsewhere it is
    # absent (or another PyPI package of that name, which is not ours).
    assert out.returncode != 0 or not out.stdout.strip().startswith(str(ROOT)), out.stdout


def test_namespaced_packages_import():
    import specdec.drafters
    import specdec.kernels
    import specdec.verifiers

    assert set(specdec.drafters.DRAFTERS) >= {"ngram", "draft_model"}
    assert set(specdec.verifiers.VERIFIERS) >= {"greedy", "rejection"}
    assert Path(specdec.kernels.__file__).parent.name == "kernels"


def test_demo_finds_every_committed_smollm2_drafter():
    from specdec.eval.demo import SMOLLM2_DRAFTERS, drafter_options
    from specdec.drafters import DRAFTERS

    assert set(SMOLLM2_DRAFTERS) <= set(DRAFTERS)
    for name in SMOLLM2_DRAFTERS:
        folder = Path(drafter_options(name)["checkpoint"])
        assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file(), name
    assert drafter_options("ngram") == {}

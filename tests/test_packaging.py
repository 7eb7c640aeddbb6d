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


# the demo's own tests: tests/test_demo.py

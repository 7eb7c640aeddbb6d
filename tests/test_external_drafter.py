"""Bring your own drafter: a package outside this repository declares a drafter by entry point,
specdec finds it by name, and the conformance suite runs on it through specdec.testing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# the whole drafter a user writes: a deterministic chain that repeats the anchor token
DRAFTER = '''
from typing import Any

import torch

from specdec import Committed, DraftProposal, Drafter, Target


class EchoDrafter(Drafter):
    """Proposes the next token (the anchor) k times: deterministic, so q is None."""

    name = "echo"

    def start(self, prefill: Committed, rows) -> dict:
        return {"anchor": prefill.next_tokens.clone()}

    def propose(self, state: dict, k: int, rows) -> DraftProposal:
        return DraftProposal.chain(state["anchor"].unsqueeze(1).expand(-1, k).clone())

    def observe(self, state: dict, committed: Committed) -> None:
        state["anchor"] = committed.next_tokens.clone()

    def select_rows(self, state: dict, rows: torch.Tensor) -> None:
        state["anchor"] = state["anchor"][rows]

    @classmethod
    def create(cls, target: Target, **options: Any) -> "EchoDrafter":
        d = cls()
        d.bind(target)
        return d

    @classmethod
    def tiny(cls, target: Target, **overrides: Any) -> "EchoDrafter":
        return cls.create(target, **overrides)
'''


def _package(tmp: Path) -> dict[str, str]:
    """my_ext with its drafter and an installed-package record declaring the entry point."""
    (tmp / "my_ext").mkdir()
    (tmp / "my_ext" / "__init__.py").write_text("")
    (tmp / "my_ext" / "drafter.py").write_text(DRAFTER)
    info = tmp / "my_ext-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my_ext\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[specdec.drafters]\necho = my_ext.drafter:EchoDrafter\n")
    return {**os.environ, "PYTHONPATH": str(tmp), "OMP_NUM_THREADS": "1"}


def test_an_external_drafter_is_found_by_name(tmp_path):
    env = _package(tmp_path)
    code = textwrap.dedent("""
        import specdec
        from specdec.testing.tiny import tiny_model
        t = specdec.Target(tiny_model("llama", vocab_size=32))
        assert "echo" in specdec.registry.DRAFTERS.names()
        out = specdec.generate(t, [[1, 2, 3]], drafter="echo", k=3, max_new_tokens=8)
        ref = specdec.generate(t, [[1, 2, 3]], drafter=None, max_new_tokens=8)
        assert out.tokens == ref.tokens, (out.tokens, ref.tokens)
        print("ok", out.summary.drafter)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok echo"


def test_the_conformance_suite_runs_on_an_external_drafter(tmp_path):
    env = _package(tmp_path)
    code = "import sys; from specdec.testing import run_conformance; sys.exit(run_conformance('my_ext.drafter:EchoDrafter'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "echo[tiny]" in out.stdout or "passed" in out.stdout
    passed = int(out.stdout.strip().splitlines()[-1].split(" passed")[0].split()[-1])
    assert passed >= 20, out.stdout[-500:]  # every suite test ran for it (plus the suite's self-checks)
    # and the same through pytest's own command line
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "specdec.testing.plugin",
                          "--specdec-drafter", "my_ext.drafter:EchoDrafter", "--pyargs", "specdec.testing.conformance",
                          "-k", "greedy_equals_target"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and " passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]


@pytest.mark.parametrize("spec, says", [
    ("my_pkg.mod:MyDrafter", "no module named 'my_pkg' in this environment"),
    ("specdec.drafters:NoSuchDrafter", "module 'specdec.drafters' has no 'NoSuchDrafter'"),
    ("ngarm", "unknown drafter 'ngarm'"),
])
def test_a_drafter_the_plugin_cannot_find_is_one_line_with_the_fix(tmp_path, spec, says):
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "specdec.testing.plugin",
                          "--specdec-drafter", spec, "--pyargs", "specdec.testing.conformance"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    text = (out.stdout + out.stderr).strip()
    assert out.returncode == 4 and "INTERNALERROR" not in text and "Traceback" not in text, text[-2000:]
    assert len(text.splitlines()) == 1 and text.startswith(f"ERROR: --specdec-drafter") and says in text, text
    if spec.startswith("my_pkg"):
        assert "pip install -e ." in text

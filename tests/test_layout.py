"""The layout is the architecture: the core at the bottom, arrows only inward.

Read statically from the source (every ``import`` and ``from ... import``, function-level ones
included), so an import hidden inside a function cannot slip past.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"specdec": ROOT / "specdec", "specdec.drafters": ROOT / "drafters", "specdec.verifiers": ROOT / "verifiers"}


def _modules() -> dict[str, Path]:
    found = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            parts = f.relative_to(folder).with_suffix("").parts
            name = ".".join((pkg, *parts)).removesuffix(".__init__")
            found[name] = f
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in out if m.startswith("specdec")}


def _layer(module: str) -> str:
    for prefix in ("specdec.drafters", "specdec.verifiers", "specdec.kernels", "specdec.training",
                   "specdec.eval", "specdec.testing"):
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    return "core"


# Which layer may import which (besides itself): the core only itself.
ALLOWED = {
    "core": {"specdec.kernels"},
    "specdec.kernels": {"core"},
    "specdec.verifiers": {"core", "specdec.kernels"},
    # tiny() factories build random tiny models with the test tools; train.py files use the trainer
    "specdec.drafters": {"core", "specdec.kernels", "specdec.training", "specdec.testing"},
    "specdec.training": {"core", "specdec.eval", "specdec.verifiers"},
    "specdec.eval": {"core", "specdec.testing"},
    "specdec.testing": {"core", "specdec.verifiers"},  # the suite verifies with every verifier
}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_inward(module):
    layer = _layer(module)
    bad = sorted(m for m in _imports(MODULES[module]) if _layer(m) not in ALLOWED[layer] | {layer})
    assert not bad, f"{module} ({layer}) imports {bad}"


def test_drafter_modules_import_training_only_from_their_training_code():
    bad = {m: sorted(i for i in _imports(p) if _layer(i) == "specdec.training")
           for m, p in MODULES.items() if _layer(m) == "specdec.drafters" and p.name != "train.py"}
    assert not {m: i for m, i in bad.items() if i}


def test_dflash_imports_nothing_of_dspark():
    bad = {m: sorted(i for i in _imports(p) if i.startswith("specdec.drafters.dspark"))
           for m, p in MODULES.items() if m.startswith("specdec.drafters.dflash")}
    assert not {m: i for m, i in bad.items() if i}


# What only the target adapter may touch: the wrapped model's modules, transformers' cache
# internals and private functions.
INTERNALS = re.compile(r"\.decoder\b|get_decoder\(|\b_init_weights\b|\.kv\.layers|(decoder|target)\.rotary_emb|"
                       r"target\.layers\b|target\.final_norm\b")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) == "specdec.drafters"))
def test_drafters_use_only_the_target_seam(module):
    hits = [f"{i}: {line.strip()}" for i, line in enumerate(MODULES[module].read_text().splitlines(), 1)
            if INTERNALS.search(line) and not line.lstrip().startswith("#")]
    assert not hits, "\n".join(hits)

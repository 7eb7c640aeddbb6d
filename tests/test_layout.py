"""The layout is the architecture: the core at the bottom, arrows only inward.

Read statically from the source (every ``import`` and ``from ... import``, function-level ones
included), so an import hidden inside a function cannot slip past.
"""

from __future__ import annotations

import ast
import functools
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
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
                   "specdec.eval", "specdec.testing", "specdec.data"):
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    return "core"


# Which layer may import which (besides itself): the core only itself and its kernels.
ALLOWED = {
    "core": {"specdec.kernels"},
    "specdec.kernels": {"core"},
    "specdec.verifiers": {"core", "specdec.kernels"},
    "specdec.drafters": {"core", "specdec.kernels", "specdec.training", "specdec.testing", "specdec.data"},
    "specdec.data": {"core", "specdec.kernels", "specdec.verifiers", "specdec.testing"},
    "specdec.training": {"core", "specdec.kernels", "specdec.verifiers", "specdec.data"},
    "specdec.eval": {"core", "specdec.testing", "specdec.data"},
    "specdec.testing": {"core", "specdec.verifiers"},
}
# why a layer imports what it does (rendered into the drawing of docs/architecture.md)
WHY = {
    "core": "never names a drafter: drafters and verifiers are found by name (specdec.registry)",
    "specdec.drafters": "tiny() builds random tiny models with the test tools; only train.py imports the trainer"
                        " and the data layer",
    "specdec.data": "below training and evaluation: generates sequences with the loop (a verifier), builds the"
                    " test tools' tiny target",
    "specdec.training": "never evaluation; the kernels' dispatch only, to train on torch code (no kernel"
                        " compiled inside training)",
    "specdec.testing": "the conformance suite verifies with every verifier",
}
FOLDERS = {"core": "specdec/*.py", "specdec.kernels": "specdec/kernels/", "specdec.verifiers": "verifiers/",
           "specdec.drafters": "drafters/", "specdec.data": "specdec/data/", "specdec.training": "specdec/training/",
           "specdec.eval": "specdec/eval/", "specdec.testing": "specdec/testing/"}
LAYOUT_MARK = "<!-- the layout: rendered from tests/test_layout.py's rules by `python tests/test_layout.py` -->"


def _reach(layer: str) -> set[str]:
    seen, todo = set(), [layer]
    while todo:
        for nxt in ALLOWED[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen - {layer}


def render_layout() -> str:
    """The drawing of docs/architecture.md: every layer, highest first (the most layers below it),
    with its folder, what it holds (read from the tree) and what it may import (:data:`ALLOWED`)."""
    def members(layer: str) -> list[str]:
        prefix = "specdec" if layer == "core" else layer
        rests = [(m[len(prefix) + 1:], MODULES[m].name == "__init__.py") for m in MODULES
                 if _layer(m) == layer and m != prefix]
        return sorted({rest.split(".")[0] + ("/" if package or "." in rest else "") for rest, package in rests})

    def block(folder: str, holds: list[str], imports: str, why: str | None) -> list[str]:
        lines = textwrap.wrap(" ".join(holds), 100, initial_indent=f"{folder:<18}", subsequent_indent=" " * 18)
        lines += textwrap.wrap(f"imports {imports}", 100, initial_indent=" " * 4, subsequent_indent=" " * 12)
        return lines + (textwrap.wrap(f"why: {why}", 100, initial_indent=" " * 4, subsequent_indent=" " * 9) if why else [])

    lab = sorted(f.name for f in EXPERIMENTS.glob("*.py")) + sorted(f"{d.name}/" for d in EXPERIMENTS.iterdir()
                                                                   if d.is_dir() and not d.name.startswith(("_", ".")))
    lines = block("experiments/", lab, "any layer: the lab (runner, trainer, reports, benchmarks); no layer imports it", None)
    for layer in sorted(ALLOWED, key=lambda x: (-len(_reach(x)), FOLDERS[x])):
        lines += block(FOLDERS[layer], members(layer), ", ".join(sorted(FOLDERS[x] for x in ALLOWED[layer])),
                       WHY.get(layer))
    return "\n".join(lines) + "\n"


def _drawing(text: str) -> str:
    return text.partition(LAYOUT_MARK)[2].partition("```text\n")[2].partition("```")[0]


def test_the_architecture_drawing_is_rendered_from_these_rules():
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert LAYOUT_MARK in page, "docs/architecture.md lost its rendered layout"
    assert _drawing(page) == render_layout(), "docs/architecture.md's layout is stale: run python tests/test_layout.py"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_inward(module):
    layer = _layer(module)
    bad = sorted(m for m in _imports(MODULES[module]) if _layer(m) not in ALLOWED[layer] | {layer})
    assert not bad, f"{module} ({layer}) imports {bad}"


def _edges(module: str, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``module`` imports: ``from P import x`` names ``P.x`` when that
    is a module, else ``P``; ``import P.x`` the longest prefix that is one; relative imports are
    resolved against ``module``'s package."""
    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(known(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base) for a in node.names)
    return out - {None, module}


def import_cycles(modules: dict[str, Path] = MODULES) -> list[list[str]]:
    """Every circle of imports among ``modules`` (the strongly connected components of more than one
    module, by Tarjan's algorithm), each sorted."""
    graph = {m: sorted(_edges(m, modules)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    """No module imports, however indirectly, one that imports it back (function-level imports
    count: a circle hidden in a function is still a circle)."""
    assert not import_cycles(), f"import circles: {import_cycles()}"


def test_the_cycle_finder_sees_a_circle_through_a_function_and_a_relative_import(tmp_path):
    (tmp_path / "p").mkdir()
    files = {"specdec.p": tmp_path / "p" / "__init__.py", "specdec.p.a": tmp_path / "p" / "a.py",
             "specdec.p.b": tmp_path / "p" / "b.py", "specdec.c": tmp_path / "c.py"}
    files["specdec.p"].write_text("")
    files["specdec.p.a"].write_text("from .b import x\n")
    files["specdec.p.b"].write_text("import specdec.c\n")
    files["specdec.c"].write_text("def f():\n    from specdec.p import a\n")
    assert import_cycles(files) == [["specdec.c", "specdec.p.a", "specdec.p.b"]]
    files["specdec.c"].write_text("def f():\n    from specdec import p\n")  # the package, not a

    assert import_cycles(files) == []


def test_drafter_modules_import_training_only_from_their_training_code():
    bad = {m: sorted(i for i in _imports(p) if _layer(i) in ("specdec.training", "specdec.data"))
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


# --- the house rules of experiments/ -----------------------------------------------------------------
# what may stay at the top of experiments/, each with a docstring: the one runner, the one renderer, and
# the corpus job (a mode of the runner, kept beside it for its data folder)
COMMANDS = {
    "run.py": "the one runner (Hydra): every job is a preset of it, its mode a decoding question, the roofline, "
              "training or one of the lab's modes",
    "report.py": "the one renderer: every table and figure of a run, a sweep or a question, from its records",
    "generate_corpus.py": "grows the training corpus (the runner's mode corpus)",
}


def test_experiments_holds_the_runner_the_renderer_and_the_corpus_job():
    scripts = {f.name for f in EXPERIMENTS.glob("*.py")}
    assert scripts <= set(COMMANDS), f"new scripts in experiments/: {sorted(scripts - set(COMMANDS))}; add a runner" \
        " mode, a preset or a module of experiments/benchmarks/ instead"
    for name in scripts:
        assert ast.get_docstring(ast.parse((EXPERIMENTS / name).read_text())), f"experiments/{name} needs a docstring"


@functools.lru_cache(maxsize=None)
def _tracked() -> frozenset[str]:
    import subprocess

    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout: which paths are committed is unknown")  # a source tarball
    files = set(out.stdout.splitlines())
    return frozenset(files | {str(p) for f in files for p in Path(f).parents})


# a value that names a file or folder of this repository (inputs and outputs alike)
REPO_PATH = re.compile(r"^(outputs|multirun|experiments|docs|tests|specdec|drafters)/\S+$")


def _values(node, key=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _values(v, (*key, str(k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _values(v, (*key, str(i)))
    else:
        yield key, node


# the runner's presets and config groups (the trainer's recipes, conf/train/, name where they write)
PRESET_FILES = sorted(str(f.relative_to(EXPERIMENTS / "conf")) for f in (EXPERIMENTS / "conf").rglob("*.yaml")
                      if f.parent.name != "train")


@pytest.mark.parametrize("preset", PRESET_FILES)
def test_no_preset_refers_to_an_uncommitted_path(preset):
    """Every path a preset reads is committed (a checkpoint that is not is named by its recorded
    folder, and a run names the command that makes it); what a run writes goes under ``hydra``."""
    import yaml

    path = EXPERIMENTS / "conf" / preset
    tracked = _tracked()
    bad = [f"{'.'.join(k)}: {v}" for k, v in _values(yaml.safe_load(path.read_text()) or {})
           if isinstance(v, str) and REPO_PATH.match(v) and k[:1] != ("hydra",) and v.rstrip("/") not in tracked]
    assert not bad, f"{path.relative_to(ROOT)} refers to uncommitted paths: {bad}"
    # ... nor in its comments' commands: a stage of past work is not a question
    assert not re.search(r"outputs/(s\d+|more|before|curves)\b", path.read_text()), path


def test_training_imports_nothing_from_eval():
    bad = {m: sorted(i for i in _imports(p) if _layer(i) == "specdec.eval")
           for m, p in MODULES.items() if _layer(m) == "specdec.training"}
    assert not {m: i for m, i in bad.items() if i}


# One timing helper (specdec/timing.py): no other module reads a benchmark clock (perf_counter and
# kin) or synchronises the device. The GPU kit's budget clock is read once before the source tree is
# importable on a bare GPU machine (its STARTED line), and on a GPU it times kernels with Triton's
# do_bench (CUDA events, cache flushed). Wall-clock dates and progress (time.time) are not timings.
CLOCK = re.compile(r"\bperf_counter\(|\bperf_counter_ns\(|\bprocess_time\(|\bmonotonic\(|\.synchronize\(|do_bench\(")
CLOCK_ALLOWED = {("experiments/benchmarks/gpu.py", "STARTED = time.perf_counter()"),
                 ("experiments/benchmarks/gpu.py", "return do_bench(fn, warmup=5, rep=20, return_mode=\"median\") / 1e3")}


def test_no_timing_helper_outside_the_one():
    files = [f for folder in ("specdec", "drafters", "verifiers", "experiments") for f in (ROOT / folder).rglob("*.py")]
    hits = []
    for f in files:
        rel = str(f.relative_to(ROOT))
        if rel == "specdec/timing.py":
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if CLOCK.search(code) and (rel, code.strip()) not in CLOCK_ALLOWED:
                hits.append(f"{rel}:{i}: {line.strip()}")
    assert not hits, "time it with specdec.timing (measure, repeat, Stopwatch, now):\n" + "\n".join(hits)


# The runner's package names no drafter module, wherever a table of them would live (peers are entry
# points declared in pyproject.toml; drafters are found by name through the registry).
DRAFTER_MODULE = re.compile(r"specdec\.drafters\.[a-z_]|from specdec\.drafters import [a-z_]")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) == "specdec.eval"))
def test_the_runners_package_names_no_drafter_module(module):
    hits = [f"{i}: {line.strip()}" for i, line in enumerate(MODULES[module].read_text().splitlines(), 1)
            if DRAFTER_MODULE.search(line)]
    assert not hits, "\n".join(hits)


# The machine is read in one place (specdec/provenance.py: cpu(), once per process), so every record
# names the CPU the same way.
CPUINFO = re.compile(r"""(["'])/proc/cpuinfo\1|(["'])lscpu\2""")


def test_only_provenance_reads_the_cpu():
    files = [f for folder in ("specdec", "drafters", "verifiers", "experiments", "tests") for f in (ROOT / folder).rglob("*.py")]
    hits = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in files
            if f.relative_to(ROOT).as_posix() not in ("specdec/provenance.py", "tests/test_layout.py")
            for i, line in enumerate(f.read_text().splitlines(), 1) if CPUINFO.search(line.split("#")[0])]
    assert not hits, "read the CPU with specdec.provenance.cpu():\n" + "\n".join(hits)


if __name__ == "__main__":  # render the layout into docs/architecture.md
    architecture = ROOT / "docs" / "architecture.md"
    text = architecture.read_text()
    architecture.write_text(text.replace(_drawing(text), render_layout(), 1) if _drawing(text) else text)


# --- the line between library and lab ------------------------------------------------------------------
# specdec/, drafters/ and verifiers/ are the library: they parse no command line (the console scripts of
# pyproject.toml excepted), start no process, name no folder of the lab (experiments/ but its shipped
# checkpoints, docs/, outputs/, multirun/, tests/) and write no Markdown or figures. The lab
# (experiments/) does those. Read from the source: imports, string constants (docstrings aside) and calls.
LAB_PATH = re.compile(r"^(experiments(/(?!checkpoints\b)|$)|docs/|outputs/|multirun/|tests/)")
MARKDOWN = re.compile(r"\|-{3}|-{3}:?\||\.md$")


def _console_scripts() -> set[str]:
    scripts = (ROOT / "pyproject.toml").read_text().partition("[project.scripts]")[2].partition("\n[")[0]
    return set(re.findall(r'^[\w-]+ = "([\w.]+):', scripts, flags=re.M))


def library_crossings(path: Path, module: str) -> set[str]:
    """Which lab work ``module`` does: ``argparse``, ``subprocess``, ``lab path`` (a string naming a
    folder of the lab), ``markdown`` (a table rule or a ``.md`` name), ``figures`` (matplotlib)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and n.body and isinstance(n.body[0], ast.Expr)}
    found = set()
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        for name in names:
            top = name.split(".")[0]
            if top in ("argparse", "subprocess"):
                found.add(top)
            elif top == "matplotlib":
                found.add("figures")
        if isinstance(node, ast.Attribute) and node.attr == "savefig":
            found.add("figures")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if LAB_PATH.match(node.value):
                found.add("lab path")
            if MARKDOWN.search(node.value):
                found.add("markdown")
    if module in _console_scripts():
        found.discard("argparse")
    return found


# Kept on purpose: the commit and dirty flag of every record come from git; a source checkout maps
# experiments/checkpoints/ into the package (specdec.checkpoints).
LIBRARY_EXCEPTIONS = {
    ("specdec.provenance", "subprocess"),
    ("specdec", "lab path"),
}
# Lab work still inside the library, to move to experiments/ (each fixed entry leaves this list): none
LIBRARY_OFFENDERS: set[tuple[str, str]] = set()


def test_the_library_does_no_lab_work():
    found = {(m, what) for m, p in MODULES.items() for what in library_crossings(p, m)}
    new = sorted(found - LIBRARY_EXCEPTIONS - LIBRARY_OFFENDERS)
    assert not new, f"lab work in the library (move it to experiments/): {new}"
    moved = sorted(LIBRARY_OFFENDERS - found)
    assert not moved, f"moved out: remove from LIBRARY_OFFENDERS: {moved}"


@pytest.mark.parametrize("source, found", [
    ("import argparse\n", {"argparse"}), ("from subprocess import run\n", {"subprocess"}),
    ("import matplotlib.pyplot as plt\n", {"figures"}), ("fig.savefig(p)\n", {"figures"}),
    ("OUT = 'docs/results/x'\n", {"lab path"}), ("p = 'page.md'\n", {"markdown"}),
    ("rows = ['|---|---:|']\n", {"markdown"}), ("c = 'experiments/checkpoints/x'\n", set()),
    ('"""Writes docs/x.md."""\n', set()), ("x = 'a | b'\n", set()),
])
def test_the_library_line_finder(source, found, tmp_path):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert library_crossings(path, "specdec.m") == found

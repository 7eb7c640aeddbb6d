"""The layout is the architecture: the core at the bottom, arrows only inward.

Read statically from the source (every ``import`` and ``from ... import``, function-level ones
included), so an import hidden inside a function cannot slip past.
"""

from __future__ import annotations

import ast
import functools
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
                   "specdec.eval", "specdec.testing", "specdec.data"):
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    return "core"


# Which layer may import which (besides itself): the core only itself.
ALLOWED = {
    "core": {"specdec.kernels"},
    "specdec.kernels": {"core"},
    "specdec.verifiers": {"core", "specdec.kernels"},
    # tiny() factories build random tiny models with the test tools; train.py files use the trainer
    "specdec.drafters": {"core", "specdec.kernels", "specdec.training", "specdec.testing", "specdec.data"},
    # the data layer sits below training and evaluation: it generates sequences with the loop (a
    # verifier) and builds the tiny target of the test tools; it never imports training or eval
    "specdec.data": {"core", "specdec.kernels", "specdec.verifiers", "specdec.testing"},
    # never eval; the kernels' dispatch only, to train on torch code (no kernel compiled in the loop)
    "specdec.training": {"core", "specdec.kernels", "specdec.verifiers", "specdec.data"},
    "specdec.eval": {"core", "specdec.testing", "specdec.data"},
    "specdec.testing": {"core", "specdec.verifiers"},  # the suite verifies with every verifier
}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_inward(module):
    layer = _layer(module)
    bad = sorted(m for m in _imports(MODULES[module]) if _layer(m) not in ALLOWED[layer] | {layer})
    assert not bad, f"{module} ({layer}) imports {bad}"


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


# --- the house rules of issue 31 ---------------------------------------------------------------------
EXPERIMENTS = ROOT / "experiments"
# what may stay a script in experiments/: the runner, the trainer, and thin commands, each with a docstring
COMMANDS = {
    "run.py": "the one runner (Hydra): every decoding question is a preset of it",
    "train.py": "the one trainer (Hydra)",
    "report.py": "renders each question's current tables from its runs",
    "bench.py": "runs one module of experiments/benchmarks/",
    "generate_corpus.py": "grows the training corpus (the data layer's command)",
}


def test_experiments_holds_the_runner_the_trainer_and_a_few_thin_commands():
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

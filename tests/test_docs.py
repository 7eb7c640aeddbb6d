"""Docs that cannot drift: every repository path the prose names exists.

Read from README.md, docs/**/*.md (text and relative links, resolved against the page), the
comments and docstrings of the library, the lab and the tests, and the Makefile's comments. A path
is one under a top folder of this repository (``specdec/``, ``drafters/``, ``verifiers/``,
``docs/``, ``experiments/``, ``tests/``; ``conf/`` is the runner's, ``experiments/conf/``).
Placeholders (``<name>``, ``{x}``) are not paths; a glob (``docs/results/*.md``) must match
something; a stem (``--out docs/results/learning_curves``) names the files beside it; a folder a
command writes into (after ``--out`` or ``OUT=``) need not exist yet.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(r"(?<![\w./~@:-])(?:specdec|drafters|verifiers|docs|experiments|tests|conf)/[\w./*<>{}-]*[\w*>}/]")
LINK = re.compile(r"\]\(([^)\s]+)\)")
OUTPUT = re.compile(r"(?:--out[= ]|OUT=)\S*$")
# pages kept as written, whose paths are those of their commits (none: the diary lives in git history)
HISTORY: set[str] = set()


def _exists(path: str, page: Path) -> bool:
    path = path.rstrip("./") or path
    if re.search(r"[<>{}]", path):
        return True
    path = "experiments/" + path if path.startswith("conf/") else path
    if "*" in path:
        return any(ROOT.glob(path))
    return any((base / path).exists() or any(base.glob(path + ".*")) for base in (ROOT, page.parent))


def _python_prose(path: Path) -> list[tuple[int, str]]:
    """The comments and docstrings of a Python file, with their first line numbers."""
    src = path.read_text()
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                out.append((node.body[0].lineno, doc))
    return out


def _prose() -> dict[Path, list[tuple[int, str]]]:
    """Every text this test reads, by file: (line number, text)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = {p: list(enumerate(p.read_text().splitlines(), 1)) for p in pages
             if p.relative_to(ROOT).as_posix() not in HISTORY}
    for folder in ("specdec", "drafters", "verifiers", "experiments", "tests"):
        found.update({f: _python_prose(f) for f in sorted((ROOT / folder).rglob("*.py"))})
    found[ROOT / "Makefile"] = [(i, line) for i, line in enumerate((ROOT / "Makefile").read_text().splitlines(), 1)
                                if line.lstrip().startswith("#")]
    return found


def missing_paths(prose: dict[Path, list[tuple[int, str]]] | None = None) -> list[str]:
    """``file:line: path`` for every path named in ``prose`` (default: :func:`_prose`) that is not here."""
    bad = []
    for page, lines in (prose if prose is not None else _prose()).items():
        rel = page.relative_to(ROOT)
        for number, text in lines:
            if page.suffix == ".md":
                for link in LINK.findall(text):
                    target = link.split("#")[0]
                    if target and not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
                        bad.append(f"{rel}:{number}: link {target}")
                text = LINK.sub("]", text)  # the links are checked above, against their page
            for m in PATH.finditer(text):
                if not OUTPUT.search(text[:m.start()]) and not _exists(m.group(0), page):
                    bad.append(f"{rel}:{number}: {m.group(0)}")
    return bad


def test_every_path_the_docs_name_exists():
    bad = missing_paths()
    assert not bad, "paths named in prose that are not in the repository:\n" + "\n".join(bad)


@pytest.mark.parametrize("text, ok", [
    ("see `specdec/loop.py`", True), ("see `specdec/gone.py`", False), ("[x](../README.md)", True),
    ("[x](missing.md#a)", False), ("`conf/ngram_sweep.yaml`", True), ("`conf/bench_*.yaml`", False),
    ("`experiments/conf/<question>.yaml`", True), ("--out docs/new/folder", True),
    ("~/.cache/specdec/few_rows/", True), ("z-lab/dflash's `tests/fixtures/x.json`", False),
])
def test_the_path_finder(text, ok):
    assert (missing_paths({ROOT / "docs" / "page.md": [(1, text)]}) == []) == ok


def test_the_results_index_lists_each_question_once():
    """docs/results.md lists each rendered page under "Current tables" and every other question in
    the table of those not rendered yet, never one in both or a rendered page in neither."""
    index = (ROOT / "docs" / "results.md").read_text()
    current, _, rest = index.partition("## Current tables")[2].partition("\n## ")
    pending = index.partition("## Questions whose current table has not been rendered yet")[2]
    assert current and pending, "docs/results.md lost one of its two lists"
    rendered = set(re.findall(r"\]\(results/(\w+)\.md\)", current))
    not_rendered = {q for row in pending.splitlines() if row.startswith("| `")
                    for q in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert not rendered & not_rendered, f"listed as rendered and as not rendered: {sorted(rendered & not_rendered)}"
    pages = {p.stem for p in (ROOT / "docs" / "results").glob("*.md")} - {Path(h).stem for h in HISTORY}
    assert pages == rendered, f"rendered pages not listed: {sorted(pages - rendered)}; listed, missing: {sorted(rendered - pages)}"


def test_the_architecture_table_has_a_row_for_every_registered_drafter():
    group = (ROOT / "pyproject.toml").read_text().partition('[project.entry-points."specdec.drafters"]')[2].partition("\n[")[0]
    drafters = re.findall(r"^(\w+) = ", group, flags=re.M)
    assert len(drafters) >= 9, "pyproject.toml's drafter entry points were not found"
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert not [name for name in drafters if f"| `{name}` |" not in page]


# Comments and docs say what and why; when, and in answer to what, is git log's. Refused: issue
# numbers, and the phrases that date a text to the work that wrote it.
NARRATION = re.compile(r"\bissues? #?\d+|\bthe issue'?s\b|\bthis session\b|\bother engineers\b", re.I)


def _texts() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    for folder in ("specdec", "drafters", "verifiers", "experiments", "tests", "docs"):
        files += [f for f in (ROOT / folder).rglob("*") if f.suffix in (".py", ".md", ".yaml", ".toml")]
    return [f for f in files if f.relative_to(ROOT).as_posix() not in HISTORY]


def test_no_text_narrates_its_history():
    hits = [f"{f.relative_to(ROOT)}:{i}: {line.strip()[:120]}" for f in _texts()
            for i, line in enumerate(f.read_text().splitlines(), 1) if NARRATION.search(line)]
    assert not hits, "say what and why, not when or for which issue:\n" + "\n".join(hits)


@pytest.mark.parametrize("line, refused", [
    ("# the house rules of issue " + "31", True), ("(Issue #" + "12)", True), ("the issue" + "'s aim", True),
    ("all the CPU allowed in this " + "session", True), ("@pytest.fixture(scope='session')", False),
    ("vLLM PR #46781", False), ("an issue with ties", False),
])
def test_the_narration_finder(line, refused):
    assert bool(NARRATION.search(line)) == refused


# Dotted names of the library (``specdec.few_rows.autotune``, ``specdec.drafters.mtp.checkpoint``) in
# the same prose: the longest prefix that is a module must exist, and the name after it must be
# defined at its top level (read statically: no import). Entry-point groups are names too.
DOTTED = re.compile(r"(?<![\w.])specdec(?:\.\w+)+")
PACKAGES = {"specdec": ROOT / "specdec", "specdec.drafters": ROOT / "drafters", "specdec.verifiers": ROOT / "verifiers"}


def _modules() -> dict[str, Path]:
    return {".".join((pkg, *f.relative_to(folder).with_suffix("").parts)).removesuffix(".__init__"): f
            for pkg, folder in PACKAGES.items() for f in folder.rglob("*.py")}


def _top_level_names(path: Path) -> set[str]:
    """What a module defines or imports at its top level (inside ``if`` blocks too), and the names
    a package exports lazily (a ``_EXPORTS`` dict's keys)."""
    names = set()
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets) and isinstance(node.value, ast.Dict):
                names.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):
            body += node.body + getattr(node, "orelse", []) + [s for h in getattr(node, "handlers", []) for s in h.body]
    return names


def missing_names(prose: dict[Path, list[tuple[int, str]]] | None = None) -> list[str]:
    """``file:line: name`` for every dotted library name in ``prose`` that names nothing here."""
    modules = _modules()
    groups = set(re.findall(r'^\[project\.entry-points\."([\w.]+)"\]', (ROOT / "pyproject.toml").read_text(), re.M))
    packaged = {"specdec.checkpoints"}  # experiments/checkpoints/, data only
    defined: dict[str, set[str]] = {}
    bad = []
    for page, lines in (prose if prose is not None else _prose()).items():
        for number, text in lines:
            for name in DOTTED.findall(text):
                parts = name.split(".")
                if name in groups or ".".join(parts[:2]) in packaged:
                    continue
                i = max(i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules)
                module, rest = ".".join(parts[:i]), parts[i:]
                if rest and rest[0] not in defined.setdefault(module, _top_level_names(modules[module])):
                    bad.append(f"{page.relative_to(ROOT)}:{number}: {name}")
    return bad


def test_every_library_name_the_docs_use_exists():
    bad = missing_names()
    assert not bad, "names of the library in prose that it does not define:\n" + "\n".join(bad)


@pytest.mark.parametrize("text, ok", [
    ("`specdec.few_rows.autotune`", True), ("`specdec.few_rows.tune`", False), ("(specdec.drafters.mtp.modules)", True),
    ("`specdec.load_target`", True), ("`specdec.verifiers.walk`", False), ("the specdec.transformers_peers group", True),
    ("`specdec.checkpoints`", True),
])
def test_the_name_finder(text, ok):
    assert (missing_names({ROOT / "docs" / "page.md": [(1, text)]}) == []) == ok

"""Where a result or a checkpoint came from: the git revision, the command line, the library versions.

Training (:mod:`specdec.training.trainer`) and evaluation (:mod:`specdec.eval.runner`) record the
same fields through these helpers, so a number in a results file and the weights it was measured
on can be traced to the same kind of record.
"""

from __future__ import annotations

import platform
import shlex
import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "NOTES", "git_sha", "git_dirty", "command_line", "versions", "with_kept_notes"]

ROOT = Path(__file__).resolve().parents[1]  # the repository root of a source checkout
# A generated results page keeps what follows this line (the prose on what its tables mean) when it is rendered again
NOTES = "<!-- notes: kept when the page is regenerated -->"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_sha() -> str | None:
    """The commit this library runs from (recorded with every result and checkpoint), or None."""
    return _git("rev-parse", "HEAD") or None


def git_dirty() -> bool | None:
    """Whether tracked files differ from that commit (None outside a git checkout): a dirty
    revision does not reproduce the run by itself."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed from the repository root: ``python <script relative to the root> args…``."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else None
    if script is not None and script.is_relative_to(ROOT):
        argv[0] = str(script.relative_to(ROOT))
    return shlex.join(["python", *argv])


def versions() -> dict[str, str]:
    """Versions that change numbers: Python, torch, transformers."""
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def with_kept_notes(page: Path, generated: str) -> str:
    """``generated`` followed by the notes of ``page`` as it is on disk (everything after :data:`NOTES`),
    so rendering a results page again replaces its tables and keeps its prose."""
    old = page.read_text() if page.is_file() else ""
    notes = old.split(NOTES, 1)[1] if NOTES in old else "\n"
    return generated.rstrip("\n") + "\n\n" + NOTES + notes

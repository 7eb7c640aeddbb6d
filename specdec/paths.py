"""Committed files named by their repository path, found from any working directory.

Presets and docs name committed files the way the repository holds them
(``experiments/checkpoints/tiny-deepseek-v3-mtp``, ``experiments/data/smollm2-135m/token_map.safetensors``);
a run started in another folder must find them all the same. Committed checkpoints ship inside the
package too and are found by their folder name (:func:`specdec.models.resolve_checkpoint`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["REPO_ROOT", "cache_root", "repo_path", "write_json_whole"]

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The folder above the package: the repository root of a checkout (an editable install)."""


def repo_path(path: str | Path) -> Path:
    """``path`` itself when it exists from the working directory (or is absolute); a relative path that
    does not, but does from the repository root, from there; else ``path`` unchanged (the caller's
    error then names what was asked for)."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    rooted = REPO_ROOT / p
    return rooted if rooted.exists() else p


def cache_root() -> Path:
    """Where this machine's measured choices are cached (the few-row plan, the kernel choices):
    ``$SPECDEC_CACHE``, else ``~/.cache/specdec``."""
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")


def write_json_whole(path: Path, record: Any) -> bool:
    """Write ``record`` as JSON to ``path`` whole: to a file of this process first, then moved into
    place, so a reader (another process tuning the same machine) never sees half a file. False when
    the folder cannot be written (a read-only home): a cached choice then holds in this process only."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        return False
    return True

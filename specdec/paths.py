"""Committed files named by their repository path, found from any working directory.

Presets and docs name committed files the way the repository holds them
(``experiments/checkpoints/tiny-deepseek-v3-mtp``, ``experiments/data/smollm2-135m/token_map.safetensors``);
a run started in another folder must find them all the same. Committed checkpoints ship inside the
package too and are found by their folder name (:func:`specdec.models.resolve_checkpoint`).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["REPO_ROOT", "repo_path"]

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

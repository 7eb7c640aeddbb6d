"""The packaged GGUF's one-time conversion when several processes convert at once (torchrun,
xdist on a fresh machine): each writes its own temporary folder, the first rename wins, the others
discard theirs and load the winner's."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest

from specdec import models


class _Saved:
    """Stands in for the converted model and tokenizer: save_pretrained writes a file of its own."""

    def __init__(self, name: str, on_save=None):
        self.name, self.on_save, self.config = name, on_save, types.SimpleNamespace()
        self.hf_quantizer = None

    def save_pretrained(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / self.name).write_text("{}")
        if self.on_save is not None:
            self.on_save()


@pytest.fixture()
def fake_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name: types.SimpleNamespace(origin=str(tmp_path / "pkg" / "__init__.py")))
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: _Saved("tokenizer.json"))
    return monkeypatch


def _other_process_finishes(out: Path) -> None:
    """What a faster process leaves: a complete folder at the final name."""
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"by": "the other process"}))
    (out / "model.safetensors").write_text("")


def test_a_conversion_that_loses_the_race_keeps_the_winners_folder_and_removes_its_own(fake_gguf):
    out = models.cache_dir() / "smollm2-135m"
    fake_gguf.setattr(models.AutoModelForCausalLM, "from_pretrained",
                      lambda *a, **k: _Saved("config.json", on_save=lambda: _other_process_finishes(out)))
    assert models._from_gguf("smollm2-135m") == out
    assert json.loads((out / "config.json").read_text()) == {"by": "the other process"}
    assert sorted(p.name for p in out.parent.iterdir()) == ["smollm2-135m"]  # no partial folder left behind


def test_a_conversion_alone_renames_its_own_per_process_folder(fake_gguf):
    seen: list[Path] = []
    out = models.cache_dir() / "smollm2-135m"

    def note_partial() -> None:
        seen.extend(p for p in out.parent.iterdir())

    fake_gguf.setattr(models.AutoModelForCausalLM, "from_pretrained",
                      lambda *a, **k: _Saved("config.json", on_save=note_partial))
    assert models._from_gguf("smollm2-135m") == out
    assert [p.name for p in seen] == [f"smollm2-135m.partial-{os.getpid()}"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "tokenizer.json"]

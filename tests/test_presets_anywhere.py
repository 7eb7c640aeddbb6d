"""Presets run from any working directory: the committed targets, checkpoints and token maps they
name by repository path (``experiments/checkpoints/...``) or by name resolve from another folder,
relative to the package, and the tiny DeepSeek-V3 target of the native-MTP preset loads from there."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from specdec.models import ALIASES, committed_checkpoints, load_model, resolve_checkpoint, uncommitted_checkpoints
from specdec.paths import REPO_ROOT, repo_path

CONF = REPO_ROOT / "experiments" / "conf"
PRESETS = sorted(p.stem for p in CONF.glob("*.yaml") if p.stem != "config")


def _entry():
    spec = importlib.util.spec_from_file_location("specdec_experiments_run_anywhere", REPO_ROOT / "experiments" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """Run from an empty folder outside the repository."""
    monkeypatch.chdir(tmp_path)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield tmp_path
    GlobalHydra.instance().clear()


def _files(run) -> tuple[str, list[str], list[str]]:
    """(target model, drafter checkpoints, token maps) a run config names."""
    drafters = [run.drafter, *(d for d, _, _ in run.speculative_methods().values())]
    checkpoints = [d.options["checkpoint"] for d in drafters if d.options.get("checkpoint")]
    maps = [d.options["token_map"] for d in drafters if isinstance(d.options.get("token_map"), str)]
    return run.target.model, checkpoints, maps


def test_every_presets_committed_files_resolve_from_another_folder(elsewhere):
    entry = _entry()
    uncommitted = set(uncommitted_checkpoints())
    seen = set()
    for preset in PRESETS:
        run = entry.to_run_config(compose(config_name=preset))
        model, checkpoints, maps = _files(run)
        if model not in ("tiny", *ALIASES):
            from specdec.models import _local_folder

            folder = _local_folder(model)
            assert folder is not None and (folder / "config.json").is_file(), (preset, model)
            seen.add(model)
        committed = committed_checkpoints()
        for ckpt in checkpoints:
            if Path(ckpt).name in committed:
                assert resolve_checkpoint(ckpt) == committed[Path(ckpt).name], (preset, ckpt)
                seen.add(ckpt)
                continue
            # recorded without weights (its recipe, by name, from here too), or made by a command first
            with pytest.raises(FileNotFoundError, match="is not committed" if Path(ckpt).name in uncommitted else ""):
                resolve_checkpoint(ckpt)
        for path in maps:
            assert repo_path(path).is_file(), (preset, path)
            seen.add(path)
    assert "experiments/checkpoints/tiny-deepseek-v3-mtp" in seen  # native_mtp reads the tiny committed MTP checkpoint
    assert any(s.startswith("experiments/checkpoints/smollm2-135m-") for s in seen)
    assert not Path("experiments").exists()  # really elsewhere


def test_a_committed_target_loads_by_name_or_repository_path_from_another_folder(elsewhere):
    for name in ("experiments/checkpoints/tiny-deepseek-v3-mtp", "tiny-deepseek-v3-mtp"):
        model, tok = load_model(name)
        assert type(model).__name__.startswith("DeepseekV3") and tok is not None
    assert resolve_checkpoint("experiments/checkpoints/smollm2-135m-eagle3") == committed_checkpoints()["smollm2-135m-eagle3"]
    with pytest.raises(FileNotFoundError, match="is not committed"):
        resolve_checkpoint("experiments/checkpoints/smollm2-135m-dflash")
    with pytest.raises(FileNotFoundError, match="not a local folder"):
        load_model("experiments/checkpoints/no-such-model")

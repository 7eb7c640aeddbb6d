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


def _tracked_checkpoint_configs() -> set[str] | None:
    import subprocess

    out = subprocess.run(["git", "ls-files", "experiments/checkpoints"], cwd=REPO_ROOT, capture_output=True, text=True)
    return set(out.stdout.splitlines()) if out.returncode == 0 else None


def test_presets_mark_the_checkpoints_a_fresh_clone_lacks(elsewhere):
    """A preset that reads a checkpoint whose weights are not committed says so (``needs_remake``),
    and only then: computed from what a fresh clone holds (git's tracked files), not this folder."""
    tracked = _tracked_checkpoint_configs()
    if tracked is None:
        pytest.skip("not a git checkout: which checkpoints are committed is unknown")
    entry = _entry()
    wrong = {}
    for preset in PRESETS:
        run = entry.to_run_config(compose(config_name=preset))
        lacks = sorted({Path(c).name for c in entry.checkpoints_read(run)
                        if f"experiments/checkpoints/{Path(c).name}/config.json" not in tracked})
        if sorted(run.needs_remake) != lacks:
            wrong[preset] = {"marked": sorted(run.needs_remake), "lacks": lacks}
    assert not wrong, f"set needs_remake to what each preset lacks: {wrong}"


def test_a_run_of_an_unmade_checkpoint_stops_first_naming_its_command(elsewhere):
    entry = _entry()
    run = entry.to_run_config(compose(config_name="posthoc_mtp"))
    unmade = uncommitted_checkpoints()
    if "smollm2-135m-mtp" not in unmade:
        pytest.skip("smollm2-135m-mtp was made in this checkout")
    with pytest.raises(SystemExit, match=r"checkpoint 'smollm2-135m-mtp', recorded but not committed; make it first, from"
                                         r" the repository root, with: \S*python experiments/run.py --config-name train/smollm2_mtp"):
        entry.check_made(run)
    entry.check_made(entry.to_run_config(compose(config_name="ngram_sweep")))  # nothing to make: no stop


def test_a_preset_naming_an_uncommitted_checkpoint_stops_in_one_line_with_a_runnable_command_and_its_time(tmp_path):
    """Before the target loads: one line (no Hydra traceback) whose command runs as printed (this
    interpreter, not a bare ``python``) and says how long it took when it was recorded."""
    import subprocess
    import sys

    from specdec.models import python_command, remake_time

    out = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "run.py"), "--config-name", "posthoc_mtp",
                          f"hydra.run.dir={tmp_path}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode == 1 and "Traceback" not in out.stderr and "HYDRA_FULL_ERROR" not in out.stderr, lines
    assert len(lines) == 1 and lines[0].startswith("this run reads checkpoint 'smollm2-135m-mtp', recorded but not"
                                                   " committed; make it first, from the repository root, with: ")
    command = uncommitted_checkpoints()["smollm2-135m-mtp"][0]
    assert command in lines[0] and remake_time("smollm2-135m-mtp") in lines[0]
    assert "recorded: 71.8 minutes on 1 CPU thread" in lines[0]  # its training.json's wall_seconds, 4306.6 s
    for part in command.split(" && "):
        exe = part.split()[0]
        assert exe == python_command() and exe != "python" and ((REPO_ROOT / exe).exists() or Path(exe).exists()), part
    assert "Loading weights" not in out.stderr  # refused before the target loaded


def test_a_runs_header_names_the_k_its_methods_draft_at_not_the_default_they_override(elsewhere):
    spec = importlib.util.spec_from_file_location("specdec_report_ks", REPO_ROOT / "experiments" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    _describe = report.describe
    entry = _entry()
    native = entry.to_run_config(compose(config_name="native_mtp"))
    assert native.num_speculative_tokens == 4 and "k = 1..6," in _describe(native)  # its jobs: k = 1..6
    assert "k = 1, 2, 4, 8," in _describe(entry.to_run_config(compose(config_name="adaptive_k")))
    assert "k = 8," in _describe(entry.to_run_config(compose(config_name="ngram_vs_prompt_lookup")))


def test_preset_steps_counts_each_sweeps_jobs_and_the_steps_its_methods_decode(elsewhere):
    """The basis of docs/experiments.md's run times: ngram_sweep's 3 k x 4 concurrencies are 12 jobs,
    each the ngram method and the baseline over 8 MT-bench first turns, 64 new tokens, c rows a step."""
    spec = importlib.util.spec_from_file_location("specdec_preset_steps", REPO_ROOT / "experiments" / "benchmarks" / "preset_steps.py")
    steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(steps)
    to_run_config = _entry().to_run_config
    run = to_run_config(compose(config_name="ngram_sweep"))
    per_c = {c: 2 * -(-run.dataset.num_prompts // c) * run.dataset.output_len for c in (1, 2, 4, 8)}
    assert steps.preset_steps("ngram_sweep", to_run_config) == (12, 3 * sum(per_c.values()))
    assert steps.preset_steps("roofline", to_run_config) == (1, None)

"""The Hydra experiments: every YAML composes onto the typed RunConfig, the entry point runs end to
end on the tiny target and writes its files, a re-run gives the same tokens, the report draws.

The entry point runs in a subprocess from the repository root, by path, as a user runs it.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from specdec.eval.runner import divergences, peer_kwargs, predicted_speedup, run_experiment
from specdec.eval.config import (DatasetConfig, DrafterConfig, MethodConfig, RunConfig, TargetConfig,
                                 VerifierConfig, check_keys, hf_methods)
from specdec.data.datasets import load_dataset
from specdec.drafters import DRAFTERS
from specdec.loop import LossyVerifierWarning
from specdec.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments"
CONF = EXP / "conf"
GROUPS = ("target", "drafter", "verifier", "dataset", "sampling")
TINY_RUN = ["target=tiny", "dataset=random", "dataset.num_prompts=3", "dataset.input_len=10", "dataset.output_len=12",
            "progress=false"]
# A preset on the tiny target: random prompts, greedy, a few tokens (target.model: native_mtp names a folder)
TINY_PRESET = ["target=tiny", "target.model=tiny", "dataset=random", "dataset.num_prompts=2", "dataset.input_len=8",
               "dataset.output_len=5", "sampling=greedy", "progress=false", "warmup=false"]
PRESETS = sorted(p.stem for p in CONF.glob("*.yaml") if p.stem != "config")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


entry = _load("specdec_experiments_run", EXP / "run.py")  # registers run_schema
report = _load("specdec_experiments_report", EXP / "report.py")
summary_markdown = report.summary_markdown


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture()
def hydra_conf():
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


# --- configs -----------------------------------------------------------------------------------

def test_every_registered_drafter_has_a_yaml():
    missing = set(DRAFTERS) - set(_options("drafter"))
    assert not missing, f"every drafter that lands gets experiments/conf/drafter/<name>.yaml; missing {missing}"


def test_every_group_option_composes_through_hydra(hydra_conf):
    for group in GROUPS:
        for option in _options(group):
            overrides = [f"{group}={option}"] + (["dataset.path=/q.jsonl"] if option == "specbench" else [])
            run = entry.to_run_config(compose(config_name="config", overrides=overrides))
            assert isinstance(run, RunConfig) and isinstance(run.sampling, SamplingParams)


def test_every_combination_of_groups_converts_to_a_run_config():
    """Every product of group YAMLs on the schema, merged as Hydra merges them (compose is ~60 ms a
    call, too slow for hundreds of combinations; the test above covers the defaults-list path)."""
    yamls = {g: {o: OmegaConf.load(CONF / g / f"{o}.yaml") for o in _options(g)} for g in GROUPS}
    combos = list(itertools.product(*(yamls[g] for g in GROUPS)))
    assert len(combos) >= 2 * 3 * 3 * 5 * 3
    schema = ConfigStore.instance().load("run_schema.yaml").node
    for combo in combos:
        cfg = OmegaConf.merge(schema, {g: yamls[g][o] for g, o in zip(GROUPS, combo)})
        if cfg.dataset.name == "specbench":
            cfg.dataset.path = "/q.jsonl"
        run = entry.to_run_config(cfg)
        assert isinstance(run.target, TargetConfig) and isinstance(run.dataset, DatasetConfig)
        assert isinstance(run.drafter, DrafterConfig) and run.drafter.name in (None, *DRAFTERS)
        assert isinstance(run.sampling, SamplingParams)


def _preset_runs(preset: str) -> list[RunConfig]:
    """The preset as it composes, and with every value of every parameter its ``-m`` sweep runs,
    one override at a time (the sweep's jobs combine them)."""
    cfg = compose(config_name=preset, return_hydra_config=True)
    values = [f"{k}={v}" for k, vs in (cfg.hydra.sweeper.params or {}).items() for v in str(vs).split(",")]
    return [entry.to_run_config(cfg)] + [entry.to_run_config(compose(config_name=preset, overrides=[v]))
                                         for v in values]


def test_every_preset_and_every_value_of_its_sweep_converts_to_a_run_config(hydra_conf):
    assert {"ngram_vs_prompt_lookup", "native_mtp", "posthoc_mtp", "eagle3_trees", "block_drafters", "dspark_scheduler_batch",
            "assistant_k", "adaptive_k", "suffix_repeat", "ngram_sweep", "drafters_mtbench"} <= set(PRESETS)
    runs = {preset: _preset_runs(preset) for preset in PRESETS}
    assert len(runs["block_drafters"]) == 1 + 4 and len(runs["drafters_mtbench"]) == 1 + 2
    assert len(runs["ngram_vs_prompt_lookup"]) == 1
    for preset, configs in runs.items():
        for run in configs:
            assert isinstance(run, RunConfig) and run.speculative_methods(), preset
    assert {d.name for r in runs["drafters_mtbench"] for d, *_ in r.speculative_methods().values()} == {
        "ngram", "suffix", "mtp", "gemma_mtp", "eagle3", "dflash", "dspark"}
    run = entry.to_run_config(compose(config_name="dspark_scheduler_batch", overrides=["concurrency=16"]))
    assert run.dataset.num_prompts == 16  # one batch per job
    adaptive = runs["adaptive_k"]
    assert [r.dataset.name for r in adaptive[1:]] == ["copy", "mtbench"]
    assert {n: (m.drafter.name, m.k, m.policy) for n, m in adaptive[0].speculative_methods().items()} == {
        **{f"{d} k={k}": (d, k, "fixed") for d in ("ngram",) for k in (1, 2, 4, 8)},
        "ngram_adaptive": ("ngram", 8, "adaptive"),
        **{f"{d} k={k}": (d, k, "fixed") for d in ("suffix",) for k in (1, 2, 4, 8)},
        "suffix_adaptive": ("suffix", 8, "adaptive")}
    suffix = runs["suffix_repeat"]
    assert [r.dataset.name for r in suffix[1:]] == ["humaneval", "mtbench"] and suffix[0].dataset.repeats == 2
    assert list(suffix[0].speculative_methods()) == ["ngram", "suffix"] and suffix[0].hf_compare == [
        "generate", "prompt_lookup"]
    run = entry.to_run_config(compose(config_name="eagle3_trees", overrides=["sampling.temperature=0.7"]))
    assert run.sampling.temperature == 0.7 and run.dataset.turns == 1 and list(run.speculative_methods()) == [
        "chain k=3", "chain k=5", "chain k=7", "static_tree", "dynamic_tree16", "dynamic_tree32"]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_runs_on_the_tiny_target(preset, hydra_conf, target, tmp_path, monkeypatch):
    """The preset's methods, peers and settings, each drafter built by its tiny() on random prompts."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # DSpark's scheduler profiles its step costs there
    cfg = entry.to_run_config(compose(config_name=preset, overrides=TINY_PRESET))
    res = run_experiment(cfg, target=target)
    methods = list(cfg.speculative_methods())
    assert list(res.summary) == ["ar", *methods, *(f"hf_{kind}" for kind in cfg.hf_compare)]
    for m in methods:  # greedy: every method is lossless
        assert res.tokens(m) == res.tokens("ar") and res.summary[m]["k"] == cfg.speculative_methods()[m][1]
    assert "| ar |" in summary_markdown(res.summary, cfg)


def test_the_dspark_scheduler_profiles_its_costs_at_the_methods_gamma(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    widths = {g: DRAFTERS["dspark"].tiny(target, scheduler=True, profile_gamma=g).costs.verify_tokens for g in (2, 4)}
    assert widths[2][:3] == [1, 2, 3] and widths[4][:3] == [1, 3, 4]  # one row: 1, 1 + γ/2, 1 + γ tokens


def test_docs_list_every_preset_and_drafter_config_with_its_command():
    doc = (ROOT / "docs" / "experiments.md").read_text()
    for preset in PRESETS:
        assert f"--config-name {preset}" in doc, preset
    for drafter in _options("drafter"):
        assert f"`drafter={drafter}`" in doc, drafter


def test_overrides_are_typed_and_unknown_keys_fail(hydra_conf):
    run = entry.to_run_config(compose(config_name="config", overrides=[
        "sampling=nucleus", "num_speculative_tokens=8", "concurrency=16", "drafter.options.max_ngram=2",
        "+drafter.options.extra=1", "hf_compare=[generate,prompt_lookup]"]))
    assert run.sampling == SamplingParams(temperature=0.7, top_p=0.9) and run.num_speculative_tokens == 8
    assert run.drafter.options == {"max_ngram": 2, "min_ngram": 1, "extra": 1} and run.concurrency == 16
    with pytest.raises(Exception, match="bogus"):
        compose(config_name="config", overrides=["sampling.bogus=1"])
    with pytest.raises(Exception, match="concurrency"):
        compose(config_name="config", overrides=["concurrency=many"])
    with pytest.raises(ValueError, match="top_p"):  # SamplingParams' own validation runs in to_object
        entry.to_run_config(compose(config_name="config", overrides=["sampling.top_p=3"]))
    with pytest.raises(ValueError, match="hf_compare"):
        entry.to_run_config(compose(config_name="config", overrides=["hf_compare=[vllm]"]))


@pytest.mark.parametrize("override, key, valid", [
    ("+sampling.temprature=0.5", "sampling.temprature", "temperature, top_k, top_p, seed"),
    ("+target.bogus=1", "target.bogus", "model, dtype, device_map, tiny"),
    ("+bogus=1", "bogus", "target, drafter, verifier"),
])
def test_a_misspelt_key_added_with_plus_fails_by_name(hydra_conf, override, key, valid):
    cfg = compose(config_name="config", overrides=[override])
    with pytest.raises(ValueError, match=f"unknown config key '{key}'; the valid keys.* are: {valid}"):
        entry.to_run_config(cfg)


def test_method_keys_are_free_but_their_fields_are_checked():
    check_keys({"methods": {"any name": {"drafter": "ngram", "k": [2]}}, "drafter": {"options": {"anything": 1}}})
    with pytest.raises(ValueError, match="'methods.a.kk'; the valid keys of methods.a are: drafter, options, k"):
        check_keys({"methods": {"a": {"kk": [2]}}})


# --- the entry point ---------------------------------------------------------------------------

def _run_entry(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(EXP / "run.py"), *args], cwd=ROOT, capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _tokens(folder: Path) -> dict[tuple[str, int], list[int]]:
    recs = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    return {(r["method"], r["request"]): r["tokens"] for r in recs}


def test_entry_point_writes_its_files_and_a_rerun_gives_the_same_tokens(tmp_path):
    args = [*TINY_RUN, "drafter=draft_model", "sampling=nucleus", "concurrency=2", "seed=7",
            "hf_compare=[generate,prompt_lookup]", "threads=2"]
    _run_entry(*args, f"hydra.run.dir={tmp_path / 'a'}")
    a = tmp_path / "a"
    for f in ("config.yaml", "config.json", "requests.jsonl", "summary.json", "summary.md"):
        assert (a / f).is_file(), f
    recorded = json.loads((a / "config.json").read_text())
    cfg = recorded["config"]
    assert cfg["concurrency"] == 2 and cfg["sampling"]["temperature"] == 0.7 and cfg["drafter"]["name"] == "draft_model"
    assert cfg["threads"] == 2 and recorded["torch_threads"] == 2  # the run used what it was given
    summary = json.loads((a / "summary.json").read_text())
    assert set(summary) == {"ar", "spec", "hf_generate", "hf_prompt_lookup"}
    spec = summary["spec"]
    for key in ("mean_accepted_length", "acceptance_at", "tokens_per_s", "ttft_mean_s", "tpot_mean_s",
                "latency_mean_s", "speedup", "decode_speedup", "predicted_speedup", "overhead_frac"):
        assert key in spec, key
    assert len(spec["acceptance_at"]) == 4 and spec["mean_accepted_length"] >= 1
    tokens = _tokens(a)
    assert len(tokens) == 4 * 3 and all(len(t) == 12 for t in tokens.values())  # random ignores EOS
    assert "| spec |" in (a / "summary.md").read_text()

    _run_entry(*args, f"hydra.run.dir={tmp_path / 'b'}")
    assert _tokens(tmp_path / "b") == tokens  # same config and seed: same tokens, every method


def test_sweep_and_report(tmp_path):
    _run_entry("-m", *TINY_RUN, "num_speculative_tokens=2,4", "concurrency=1,3", f"hydra.sweep.dir={tmp_path}")
    assert len(list(tmp_path.rglob("summary.json"))) == 4
    md = report.write_report(tmp_path)
    overview, *sections = md.read_text().split("\n## Run `")
    assert overview.count(" | spec |") == 4 and overview.count(" | ar |") == 4 and len(sections) == 4
    assert all("| spec | ngram |" in s and "Drafting" in s for s in sections)  # each run's own tables
    text = overview
    for png in ("throughput_latency.png", "acceptance.png", "speedup_k.png"):
        assert (tmp_path / png).stat().st_size > 5000 and f"]({png})" in text


def test_report_of_runs_with_several_methods_and_temperatures(tmp_path, target):
    for i, temperature in enumerate((0.0, 0.7)):
        run_experiment(_tiny_cfg(sampling=SamplingParams(temperature=temperature), methods={
            "ngram": MethodConfig(k=[2, 4]), "draft": MethodConfig(drafter="draft_model")}),
            out_dir=tmp_path / f"{i}_T{temperature}", target=target)
    runs = report.load_runs(tmp_path)
    assert set(report._series(runs)) == {f"{m}{t}" for m in ("autoregressive", "ngram k=2", "ngram k=4", "draft k=4")
                                         for t in (" (T=0)", " (T=0.7)")}
    text = report.write_report(tmp_path, per_request=True).read_text()
    assert text.count("## Run `") == 2 and text.count("| ngram k=4 | ngram | 4 |") == 2  # each run's summary.md
    assert text.count("| request | id | prompt tokens | ar tok/s | ngram k=2 tok/s") == 2
    assert text.count("| random-3 |") == 2 and (tmp_path / "speedup_k.png").stat().st_size > 5000


# --- measurements, in process ------------------------------------------------------------------

def _tiny_cfg(**kw) -> RunConfig:
    base = dict(target=TargetConfig(model="tiny", tiny={"vocab_size": 64, "init_scale": 0.3}),
                drafter=DrafterConfig("ngram"),
                dataset=DatasetConfig(name="random", num_prompts=4, input_len=12, output_len=10, ignore_eos=True),
                progress=False, warmup=False)
    return RunConfig(**{**base, **kw})


def test_a_lossy_verifier_is_marked_in_summaries_tables_and_legends(tmp_path, target):
    sampled = SamplingParams(temperature=0.8)
    with pytest.warns(LossyVerifierWarning):
        run_experiment(_tiny_cfg(verifier=VerifierConfig("typical"), sampling=sampled), out_dir=tmp_path / "0_typical",
                       target=target)
    run_experiment(_tiny_cfg(verifier=VerifierConfig("rejection"), sampling=sampled), out_dir=tmp_path / "1_rejection",
                   target=target)
    lossy, exact = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("0_typical", "1_rejection"))
    assert [s["lossless"] for s in lossy.values()] == [False, False]  # ar and spec ran through `typical`
    assert [s["lossless"] for s in exact.values()] == [True, True]
    assert "| spec (lossy) | ngram |" in summary_markdown(lossy)
    assert "(lossy)" not in summary_markdown(exact)
    figures = [build(report.load_runs(tmp_path), "t") for build in report.FIGURES.values()]
    legends = [t for fig in figures if fig is not None for t in fig.axes[0].get_legend_handles_labels()[1]]
    assert sum(fig is None for fig in figures) == 1  # one prompt length: no context figure
    report.plt.close("all")
    overview = report.write_report(tmp_path).read_text().split("\n## Run `")[0]
    assert overview.count(" | spec (lossy) |") == 1 and overview.count(" | ar (lossy) |") == 1
    assert overview.count(" | spec |") == 1 and overview.count(" | ar |") == 1
    for prefix in ("autoregressive (lossy)", "ngram (lossy) k=4", "ngram (lossy), concurrency 1"):
        assert any(t.startswith(prefix) for t in legends), (prefix, legends)
    assert any(t.startswith("ngram k=4") for t in legends)


def test_greedy_speculation_reproduces_autoregressive_and_transformers(target):
    cfg = _tiny_cfg(concurrency=3, hf_compare=["generate", "prompt_lookup"])
    res = run_experiment(cfg, target=target)
    s = res.summary
    assert res.tokens("spec") == res.tokens("ar") == res.tokens("hf_generate") == res.tokens("hf_prompt_lookup")
    assert s["spec"]["identical_to_baseline"] == 4 and s["hf_prompt_lookup"]["identical_to_hf_generate"] == 4
    assert s["spec"]["baseline"] == "ar" and s["hf_prompt_lookup"]["baseline"] == "hf_generate"
    assert s["ar"]["mean_accepted_length"] == 1.0 and s["ar"]["concurrency"] == 3
    assert s["spec"]["predicted_speedup"] > 0 and s["spec"]["row_steps"] == sum(
        r["steps"] for r in res.records if r["method"] == "spec")


def test_assistant_model_runs_the_draft_model_weights(target):
    res = run_experiment(_tiny_cfg(drafter=DrafterConfig("draft_model"), hf_compare=["generate", "assistant"]),
                         target=target)
    assert res.tokens("hf_assistant") == res.tokens("hf_generate") == res.tokens("spec")
    drafter = DRAFTERS["draft_model"].tiny(target)
    assistant = peer_kwargs("assistant", target, drafter, 3)["assistant_model"]
    # transformers reads the draft count from the assistant's own generation config, not generate()'s arguments
    assert assistant.generation_config.num_assistant_tokens == 3 and assistant.lm_head is drafter.draft.model.lm_head
    assert drafter.draft.model.generation_config.num_assistant_tokens != 3  # the drafter's model is left alone


def test_transformers_columns_that_need_a_drafter_say_so(target):
    with pytest.raises(ValueError, match="drafter=dflash"):  # it runs the dflash drafter's weights
        run_experiment(_tiny_cfg(hf_compare=["dflash"]), target=target)
    with pytest.raises(ValueError, match="draft_model"):
        run_experiment(_tiny_cfg(hf_compare=["assistant"]), target=target)


def test_transformers_dflash_runs_the_same_dflash_weights(target):
    res = run_experiment(_tiny_cfg(drafter=DrafterConfig("dflash"), num_speculative_tokens=3,
                                   hf_compare=["generate", "dflash"]), target=target)
    assert res.tokens("hf_dflash") == res.tokens("hf_generate") == res.tokens("spec") == res.tokens("ar")
    assert res.summary["hf_dflash"]["baseline"] == "hf_generate"


def test_transformers_use_mtp_runs_the_same_mtp_checkpoint(hydra_conf, monkeypatch):
    """Side by side with generate(use_mtp=True) on the committed tiny DeepSeek-V3 with 2 MTP modules:
    the native_mtp preset on its own target and held-out code, cut down."""
    monkeypatch.chdir(ROOT)  # the preset names the checkpoint relative to the repository root
    cfg = entry.to_run_config(compose(config_name="native_mtp", overrides=[
        "dataset.num_prompts=2", "dataset.output_len=12", "hf_compare=[generate,mtp]", "~methods.last",
        "~methods.tree_top3", "methods.cycle.k=[2]", "progress=false"]))
    res = run_experiment(cfg)
    assert list(res.summary) == ["ar", "cycle", "hf_generate", "hf_mtp"] and res.config.dataset.name == "stdlib"
    assert res.tokens("cycle") == res.tokens("ar") == res.tokens("hf_generate") == res.tokens("hf_mtp")
    assert all(len(t) == 12 for t in res.tokens("cycle")) and res.summary["cycle"]["mean_accepted_length"] > 1


def test_transformers_gemma4_assistant_runs_the_same_gemma_mtp_assistant():
    """Side by side with generate(assistant_model=<Gemma4Assistant>) on a tiny Gemma 4 target."""
    gemma4 = TargetConfig(model="tiny", tiny={"family": "gemma4", "vocab_size": 48, "init_scale": 0.3, "seed": 5})
    res = run_experiment(_tiny_cfg(target=gemma4, drafter=DrafterConfig("gemma_mtp"), num_speculative_tokens=3,
                                   hf_compare=["generate", "gemma_mtp"]))
    assert res.tokens("hf_gemma_mtp") == res.tokens("hf_generate") == res.tokens("spec") == res.tokens("ar")
    with pytest.raises(ValueError, match="Gemma 4"):  # transformers reads K/V only Gemma targets share
        run_experiment(_tiny_cfg(drafter=DrafterConfig("gemma_mtp"), hf_compare=["gemma_mtp"]))


def test_every_peer_hook_lives_in_a_drafter_room_and_the_runner_names_no_drafter():
    """The peers are entry points (tests/test_layout.py checks that the runner's package names no
    drafter module anywhere)."""
    from importlib.metadata import entry_points

    from specdec.registry import transformers_peer

    peers = {ep.name: ep.value for ep in entry_points(group="specdec.transformers_peers")}
    assert set(hf_methods()) == {"generate", *peers} and {"prompt_lookup", "assistant", "mtp"} <= set(peers)
    for kind, hook in peers.items():
        assert hook.startswith("specdec.drafters.") and callable(transformers_peer(kind))
    source = (ROOT / "specdec" / "eval" / "runner.py").read_text()
    assert "specdec.drafters" not in source.replace("from specdec.drafters import DRAFTERS", "")
    for name in DRAFTERS:
        assert f'"{name}"' not in source and f"'{name}'" not in source, name


def test_autoregressive_only_run(target):
    res = run_experiment(_tiny_cfg(drafter=DrafterConfig(None)), target=target)
    assert set(res.summary) == {"ar"}


def test_methods_run_several_drafters_and_ks_interleaved(target):
    cfg = _tiny_cfg(drafter=DrafterConfig("ngram", {"max_ngram": 2}), hf_compare=["generate"], methods={
        "ngram": MethodConfig(k=[1, 3]), "ngram1": MethodConfig(options={"max_ngram": 1}),
        "draft": MethodConfig(drafter="draft_model", k=[2])})
    assert {n: (d.name, d.options, k) for n, (d, k, _) in cfg.speculative_methods().items()} == {
        "ngram k=1": ("ngram", {"max_ngram": 2}, 1), "ngram k=3": ("ngram", {"max_ngram": 2}, 3),
        "ngram1": ("ngram", {"max_ngram": 1}, 4), "draft": ("draft_model", {}, 2)}  # another drafter: its own options
    res = run_experiment(cfg, target=target)
    s = res.summary
    assert list(s) == ["ar", "ngram k=1", "ngram k=3", "ngram1", "draft", "hf_generate"]
    assert [(s[m]["drafter"], s[m]["k"]) for m in s] == [(None, 0), ("ngram", 1), ("ngram", 3), ("ngram", 4),
                                                         ("draft_model", 2), (None, 0)]
    for m in ("ngram k=1", "ngram k=3", "ngram1", "draft"):
        assert res.tokens(m) == res.tokens("ar") == res.tokens("hf_generate")  # greedy: lossless
        assert s[m]["baseline"] == "ar" and len(s[m]["acceptance_at"]) <= s[m]["k"]
        assert 0 < s[m]["drafted_per_step"] <= s[m]["k"] and s[m]["draft_cost_vs_target_step"] > 0
        assert s[m]["divergences"] == [] and s[m]["speedup_vs_hf_generate"] > 0
    assert s["draft"]["drafted_per_step"] == 2  # a draft model always drafts k
    order = [r["method"] for r in res.records if r["batch"] == 0]  # interleaved: batch 0 of every method first
    assert order == list(s)
    md = summary_markdown(s, cfg)
    assert "| ngram k=3 | ngram | 3 |" in md and "| draft | draft_model | 2 |" in md and "Drafting" in md
    with pytest.raises(ValueError, match="methods.x.k"):
        _tiny_cfg(methods={"x": MethodConfig(k=[0])})
    with pytest.raises(ValueError, match="names no drafter"):
        _tiny_cfg(drafter=DrafterConfig(None), methods={"x": MethodConfig()})


def test_the_adaptive_policy_is_a_key_of_the_run_and_of_every_method(hydra_conf, target):
    run = entry.to_run_config(compose(config_name="config", overrides=["policy=adaptive"]))
    assert run.policy == "adaptive" and run.speculative_methods()["spec"].policy == "adaptive"
    with pytest.raises(ValueError, match="policy must be one of fixed, adaptive, prefix, got 'adaptve'"):
        _tiny_cfg(policy="adaptve")
    with pytest.raises(ValueError, match="methods.x.policy must be one of"):
        _tiny_cfg(methods={"x": MethodConfig(policy="k")})
    cfg = _tiny_cfg(policy="adaptive", num_speculative_tokens=6, methods={
        "fixed": MethodConfig(k=[2], policy="fixed"), "auto": MethodConfig()})
    assert {n: m.policy for n, m in cfg.speculative_methods().items()} == {"fixed": "fixed", "auto": "adaptive"}
    res = run_experiment(cfg, target=target)
    assert res.tokens("auto") == res.tokens("fixed") == res.tokens("ar")  # greedy: lossless
    assert res.summary["auto"]["policy"] == "adaptive" and res.summary["fixed"]["policy"] == "fixed"
    md = summary_markdown(res.summary, cfg)
    assert "| auto | ngram | ≤6 (adaptive) |" in md and "| fixed | ngram | 2 |" in md and "(adaptive policy)" in md


def test_repeated_prompts_are_asked_again_and_reported_per_pass(target):
    cfg = _tiny_cfg(drafter=DrafterConfig("suffix", {"max_cached_requests": 100}), dataset=DatasetConfig(
        name="random", num_prompts=3, input_len=12, output_len=10, ignore_eos=True, repeats=2))
    samples = load_dataset(cfg.dataset, None, 64)
    assert [s.id for s in samples] == ["random-0", "random-1", "random-2", "random-0#2", "random-1#2", "random-2#2"]
    assert [s.prompt_ids for s in samples[3:]] == [s.prompt_ids for s in samples[:3]]
    res = run_experiment(cfg, target=target)
    groups = res.summary["spec"]["by_group"]
    assert list(groups) == ["-", "-, pass 2"] and groups["-"]["requests"] == 3
    assert groups["-, pass 2"]["mean_accepted_length"] > groups["-"]["mean_accepted_length"]  # the global tree
    assert "latency_speedup" in groups["-"] and "| -, pass 2 |" in summary_markdown(res.summary, cfg)
    with pytest.raises(ValueError, match="repeats"):
        DatasetConfig(repeats=0)


def test_divergences_name_the_first_differing_token_and_the_targets_top2(target):
    res = run_experiment(_tiny_cfg(drafter=DrafterConfig(None)), target=target)
    want = res.tokens("ar")
    records = [dict(r) for r in res.records] + [
        {**r, "method": "x", "tokens": r["tokens"][:3] + [(r["tokens"][3] + 1) % 64] + r["tokens"][4:]}
        for r in res.records if r["request"] == 1]
    prompts = {("ar", i): list(s.prompt_ids) for i, s in enumerate(
        load_dataset(res.config.dataset, None, target.vocab_size, res.config.seed))}
    (d,) = divergences(target, records, prompts, "x", "ar")
    assert (d["request"], d["position"], d["want"]) == (1, 3, want[1][3]) and d["got"] == (want[1][3] + 1) % 64
    assert d["top2_ids"][0] == want[1][3] and d["top2_logits"][0] >= d["top2_logits"][1]  # greedy: the argmax
    md = summary_markdown({"ar": res.summary["ar"], "x": {**res.summary["ar"], "method": "x", "baseline": "ar",
                                                          "identical_to_baseline": 3, "divergences": [d]}})
    assert f"- x, request 1, position 3: got {d['got']}, ar {d['want']}" in md


def test_predicted_speedup_formula():
    # 3 tokens per step; a step costs 1 ms drafting + 2 ms verifying; a plain token costs 1.5 ms
    assert predicted_speedup(3.0, 1e-3, 2e-3, 1.5e-3) == pytest.approx(1.5)


def test_second_turns_follow_the_methods_own_answer():
    from specdec.eval.runner import encode_turn
    from specdec.data.datasets import Sample

    class Tok:  # a chat-template tokenizer stub: one id per message character count
        chat_template = "stub"

        def apply_chat_template(self, messages, **kw):
            return [len(m["content"]) for m in messages]

        def encode(self, text):
            return [len(text)]

    class T:
        tokenizer = Tok()

    s = Sample(id="q", output_len=4, turns=["hello", "and more"])
    assert encode_turn(T(), s, 0, [], chat=True) == [5]
    assert encode_turn(T(), s, 1, ["an answer"], chat=True) == [5, 9, 8]  # user, assistant, user
    assert encode_turn(T(), s, 1, ["an answer"], chat=False) == [len("hello\n\nan answer\n\nand more")]


def test_acceptance_script_measures_a_presets_methods_on_held_out_prompts_only(target):
    """experiments/benchmarks/acceptance.py: a row per method and k with its acceptance per depth, outputs equal
    to autoregressive decoding's; only the held-out MT-bench questions are accepted as prompts."""
    acc = _load("specdec_experiments_acceptance", EXP / "benchmarks" / "acceptance.py")
    methods = acc.preset_methods("drafters_mtbench")
    assert {d for d, _ in methods.values()} == {"ngram", "suffix", "eagle3", "mtp", "gemma_mtp", "dflash", "dspark"}
    assert methods["mtp"][1] == {"checkpoint": "smollm2-135m-mtp", "chain_hidden": "normed"}
    prompts = [[3, 5, 7, 3, 5, 7, 3, 5], [9, 9, 2, 9, 9, 2, 9, 9, 2]]
    rows = acc.acceptance(target, {"ngram": ("ngram", {}), "suffix": ("suffix", {})}, prompts, [1, 3], 10)
    assert [(r["method"], r["k"]) for r in rows] == [("ngram", 1), ("ngram", 3), ("suffix", 1), ("suffix", 3)]
    for r in rows:
        assert r["identical"] == 2 and 1 <= len(r["acceptance_at"]) <= r["k"] and r["mean_accepted_length"] >= 1.0
        assert r["steps"] >= r["new_tokens"] / (r["k"] + 1)
    assert "| ngram | ngram | 3 |" in acc.markdown(rows, "header")
    with pytest.raises(ValueError, match="held out"):
        acc.held_out_prompts(target, 41)
    with pytest.raises(ValueError, match="no methods"):
        acc.preset_methods("config")
    by_context = [dict(r, context=n) for n, r in zip((128, 7500), rows)]  # --dataset stdlib --context ...
    assert "| 7,500 | ngram | ngram | 3 |" in acc.markdown(by_context, "header")


@pytest.mark.parametrize("options, error", [
    ({"context": [128]}, "context goes with dataset=stdlib"),
    ({"dataset": "stdlib"}, "dataset=stdlib needs context"),
    ({"dataset": "stdlib", "context": [0]}, "positive token counts"),
    ({"methods": ["nope"]}, r"methods \['nope'\] are not in preset"),
])
def test_the_acceptance_bench_refuses_a_context_question_it_cannot_ask_before_loading_a_model(options, error, monkeypatch):
    acc = _load("specdec_experiments_acceptance", EXP / "benchmarks" / "acceptance.py")
    monkeypatch.setattr(acc, "load_target", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit, match=error):
        acc.measure(preset="context_length", out="unused", **options)


def test_a_lab_preset_is_checked_against_its_function_before_any_work():
    """Every conf/lab/<mode>.yaml names a mode of LAB_MODES and holds exactly its function's parameters
    (and a misspelt or missing key fails by name)."""
    from omegaconf import OmegaConf

    modes = sorted(p.stem for p in (EXP / "conf" / "lab").glob("*.yaml"))
    assert modes == sorted(entry.LAB_MODES)
    for mode in modes:
        cfg = OmegaConf.load(EXP / "conf" / "lab" / f"{mode}.yaml")
        del cfg["hydra"]
        cfg = OmegaConf.merge(cfg, {k: "x" for k in cfg if OmegaConf.is_missing(cfg, k)})
        fn, params = entry.lab_job(cfg)
        assert fn.__name__ == entry.LAB_MODES[mode].split(":")[1] and "mode" not in params
    cfg = OmegaConf.create({"mode": "eagle3_serving", "checkpoint": "x", "treee": "chain"})
    with pytest.raises(SystemExit, match=r"unknown keys \['treee'\], missing keys \[\]"):
        entry.lab_job(cfg)
    with pytest.raises(SystemExit, match=r"missing keys \['checkpoint'\]"):
        entry.lab_job(OmegaConf.create({"mode": "eagle3_serving"}))
    with pytest.raises(SystemExit, match="unknown mode 'nope'"):
        entry.lab_job(OmegaConf.create({"mode": "nope"}))

"""specdec-demo (specdec.eval.demo): it offers exactly the drafters that run from a fresh clone, takes
each one's k from its checkpoint's record, refuses bad arguments before loading anything, runs
autoregressive and speculative decoding interleaved after a warm-up, and gives a verdict only when
every round agrees (the real model runs it: `make demo`)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest

import specdec
from specdec.eval import demo
from specdec.eval.demo import MODEL_FREE_K, TRAINED_K, default_k, drafter_options, main, offered, verdict


def test_the_demo_offers_the_model_free_drafters_and_every_committed_smollm2_checkpoint():
    from specdec.models import committed_checkpoints, resolve_checkpoint
    from specdec.registry import DRAFTERS

    names = offered()
    assert names[:2] == ["ngram", "suffix"] and set(names) <= set(DRAFTERS.names())
    committed = committed_checkpoints()
    for name in names[2:]:
        folder = resolve_checkpoint(drafter_options(name)["checkpoint"])
        assert folder.name in committed and (folder / "model.safetensors").is_file(), name
        assert default_k(name)[0] >= 1
    with_weights = demo.smollm2_checkpoints()
    for name in demo.smollm2_checkpoints(committed=False):  # recorded without weights only: never offered
        assert (name in names) == (name in with_weights), name
    assert {"eagle3", "dspark"} <= set(names)  # the two committed today
    assert drafter_options("ngram") == {} and default_k("ngram")[0] == default_k("suffix")[0] == MODEL_FREE_K["ngram"]


def test_the_offer_follows_the_checkpoints_present(monkeypatch):
    """A checkpoint committed later is offered without editing the demo; one without weights is not."""
    eagle = {"config": {"recipe": "specdec.drafters.eagle3.train.Eagle3Recipe", "target": {"model": "smollm2-135m"}}}
    mtp = {"config": {"recipe": "specdec.drafters.mtp.train.MTPRecipe", "target": {"model": "smollm2-135m"}}}
    monkeypatch.setattr(demo, "_checkpoint_records", lambda: [
        ("smollm2-135m-eagle3", eagle, False), ("smollm2-135m-mtp", mtp, True), ("smollm2-135m-mtp-v2", mtp, True)])
    assert offered() == ["ngram", "suffix", "mtp"]
    assert drafter_options("mtp") == {"checkpoint": "smollm2-135m-mtp"}  # the canonical name of several
    assert demo.smollm2_checkpoints(committed=False) == {"eagle3": "smollm2-135m-eagle3"}


def test_the_default_k_is_the_best_k_recorded_with_the_checkpoint(tmp_path, monkeypatch):
    import specdec.models
    from specdec.training.trainer import TrainingRecord

    monkeypatch.setattr(specdec.models, "resolve_checkpoint", lambda name: tmp_path)
    monkeypatch.setattr(demo, "drafter_options", lambda name: {"checkpoint": "x"})
    record = TrainingRecord(revision=None, command="train", config={}, steps=1, tokens=1, wall_seconds=1.0, held_out={})
    record.write(tmp_path)
    k, why = default_k("eagle3")
    assert k == TRAINED_K and "no best k recorded" in why  # the trainer writes none

    measured = "make sweep-drafters: k=3 fastest, 1.21x (docs/results.md)"
    record.best_k = {"k": 3, "measured": measured}
    record.write(tmp_path)
    assert TrainingRecord.read(tmp_path).best_k == {"k": 3, "measured": measured}
    assert default_k("eagle3") == (3, f"best measured, recorded with the checkpoint: {measured}")

    for bad in ({"k": 0, "measured": measured}, {"k": 3}, {"k": True, "measured": measured}, 3):
        (tmp_path / "training.json").write_text(json.dumps({"best_k": bad}))
        with pytest.raises(ValueError, match="best_k must be"):
            default_k("eagle3")


def test_demo_help_documents_every_option():
    options = {a.option_strings[-1]: a.help for a in demo.parser()._actions}
    assert {"--drafter", "--k", "--prompt", "--max-new-tokens", "--repeats", "--temperature", "--seed", "--threads",
            "--json"} <= set(options)
    assert all(h and len(h) > 10 for h in options.values()), options
    out = subprocess.run([sys.executable, "-m", "specdec.eval.demo", "--help"], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0 and "draft and verify costs" in out.stdout and "interleaved" in out.stdout, out.stderr


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(specdec, "load_target", refuse)


@pytest.mark.parametrize("argv, message", [
    (["--k", "0"], "--k must be at least 1, got 0"),
    (["--k", "-2"], "--k must be at least 1"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--prompt", "  "], "--prompt is empty"),
    (["--k", "two"], "invalid int value"),
    (["--drafter", "ngarm"], "'ngarm' is not offered; the demo offers: ngram, suffix"),
    (["--drafter", "dflash"], "checkpoint 'smollm2-135m-dflash' is not committed.*make it, from the repository root,"
                              " with: .*python experiments/run.py --config-name train/.*recorded: 15.7 minutes on 1 CPU thread"),
    (["--k", "100000"], "--k 100000 with --max-new-tokens 96 cannot fit SmolLM2-135M's context window of 8192"),
    (["--max-new-tokens", "8192"], "--max-new-tokens 8192 cannot fit"),
])
def test_bad_arguments_are_refused_before_the_model_loads(argv, message, no_model, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "usage: specdec-demo" in err
    import re

    assert re.search(message, err), err


def test_verdict_needs_every_round_to_agree():
    assert verdict([1.2, 1.3, 1.1])[0] == "faster"
    assert verdict([0.8, 0.9, 0.95])[0] == "slower"
    outcome, why = verdict([0.9, 1.3, 1.1])
    assert outcome == "undecided" and "spread (0.90x-1.30x) is larger than the difference" in why
    assert verdict([1.0, 1.2])[0] == "undecided"


@pytest.fixture
def fake_run(monkeypatch):
    """The demo's calls recorded, on a stand-in model: each speculative run 1.5x the last autoregressive
    one, every round slower than the one before (a machine getting busier)."""
    from specdec.target import Target
    from specdec.testing.tiny import tiny_model

    real = specdec.generate(Target(tiny_model("llama", vocab_size=32)), [[1, 2, 3]], None, max_new_tokens=2).summary
    calls: list[tuple] = []

    def generate(target, prompt, drafter=None, k=4, max_new_tokens=64, **kw):
        calls.append(("ar" if drafter is None else "spec", max_new_tokens))
        timed = [c for c in calls if c[1] == 96]
        speed = 10.0 / (1 + 0.1 * len(timed)) * (1.5 if drafter is not None else 1.0)
        summary = replace(real, drafter=None if drafter is None else "ngram", k=k if drafter is not None else 0,
                          tokens_per_s=speed, few_rows={"source": "cached", "threads": 2, "packed": True,
                                                        "plan": {"2": "mm"}})
        return SimpleNamespace(summary=summary, tokens=[[5, 6]], texts=["text"])

    monkeypatch.setattr(specdec, "load_target", lambda *a, **kw: SimpleNamespace(takes_row_plan=lambda: False,
                                                                                 tune=lambda: None))
    monkeypatch.setattr(specdec, "make_drafter", lambda *a, **kw: SimpleNamespace(name="ngram"))
    monkeypatch.setattr(specdec, "generate", generate)
    return calls


def test_the_demo_warms_up_then_interleaves_and_reports_median_and_spread(fake_run, quiet_machine, capsys):
    main(["--repeats", "4"])
    warm = [c for c in fake_run if c[1] != 96]
    timed = [c[0] for c in fake_run if c[1] == 96]
    assert fake_run[:len(warm)] == warm and {c[0] for c in warm} == {"ar", "spec"}  # warm-up first, both
    assert timed == ["ar", "spec", "spec", "ar", "ar", "spec", "spec", "ar"]  # interleaved, order alternating
    out = capsys.readouterr().out
    assert "4 rounds, interleaved" in out and "verdict        : faster" in out and "per round" in out
    assert "few-row plan: 2: mm\n  (cached; measuring conditions not recorded; re-tune: specdec-autotune --force)" in out
    assert "identical to autoregressive output: True" in out and "load: other load 0.0 before the rounds" in out


def test_the_json_baseline_has_no_k(fake_run, quiet_machine, capsys):
    main(["--json", "--repeats", "2", "--k", "3"])
    out = json.loads(capsys.readouterr().out)
    assert out["k"] == 3 and out["rounds"] == 2 and len(out["speedups"]) == 2 and out["verdict"] == "faster"
    assert "k" not in out["autoregressive"]["median_round"] and out["speculative"]["median_round"]["k"] == 3
    assert out["load"]["before"] == 0.0 and out["load"]["threads"] >= 1
    assert out["few_rows"]["source"] == "cached" and len(out["autoregressive"]["tokens_per_s"]) == 2


def test_no_verdict_while_the_machine_is_busier_than_the_threads_the_demo_uses(fake_run, quiet_machine, capsys):
    from specdec.few_rows import cores_available

    quiet_machine["load"] = cores_available() + 1.0  # a busy loop per core and one more
    main(["--repeats", "3"])
    out = capsys.readouterr().out
    assert "verdict        : busy: no verdict: the machine is busy" in out and "faster" not in out
    assert "(on a busy machine: not a verdict)" in out and "rerun when the machine is quieter" in out
    assert demo.load_verdict(0.0, 0.0, threads=1, cores=2) is None
    assert demo.load_verdict(0.2, 1.8, threads=1, cores=2)[0] == "busy"  # busy by the end is busy
    assert demo.load_verdict(0.0, 0.6, threads=2, cores=2)[0] == "busy"  # every core ours: any other load is too much
    assert demo.load_verdict(float("nan"), float("nan"), threads=2, cores=2) is None  # no load average: not known busy


def _summary(base, tps, draft_ms=0.0, verify_ms=10.0, tau=1.0):
    return replace(base, tokens_per_s=tps, draft_ms_per_step=draft_ms, verify_ms_per_step=verify_ms,
                   mean_accepted_length=tau)


def test_the_verdict_and_the_cost_breakdown_come_from_the_same_round_and_never_disagree():
    """Many random sets of rounds: the verdict's median is the median round's speedup, and the cost
    lines from that round say "pays" exactly when it is above 1, never against a verdict."""
    import random

    from specdec.target import Target
    from specdec.testing.tiny import tiny_model

    real = specdec.generate(Target(tiny_model("llama", vocab_size=32)), [[1, 2, 3]], None, max_new_tokens=2).summary
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 6)
        base = [_summary(real, rng.uniform(10, 30), verify_ms=rng.uniform(20, 60)) for _ in range(n)]
        spec = [_summary(real, rng.uniform(8, 45), draft_ms=rng.uniform(1, 20), verify_ms=rng.uniform(25, 80),
                         tau=rng.uniform(1, 3)) for _ in range(n)]
        speedups = [s.tokens_per_s / b.tokens_per_s for b, s in zip(base, spec)]
        outcome, why = verdict(speedups)
        mid = demo.median_round(speedups)
        assert f"median {speedups[mid]:.2f}x" in why
        lines = demo.costs(spec[mid], base[mid], outcome)
        need = float(lines[0].rsplit("= ", 1)[1].split()[0])
        assert need == pytest.approx(spec[mid].mean_accepted_length / speedups[mid], rel=1e-2, abs=1e-2)
        pays = "speculation pays" in lines[1]
        assert pays == (speedups[mid] > 1)
        assert not (outcome == "faster" and not pays) and not (outcome == "slower" and pays)
        if outcome == "undecided":
            assert "the rounds disagree" in lines[1]


def test_the_demo_says_it_tunes_only_when_it_does(monkeypatch, capsys, quiet_machine):
    from specdec import few_rows as fr

    tuned = []
    target = SimpleNamespace(takes_row_plan=lambda: True, model=object(), pack=True, tune=lambda: tuned.append(1))
    monkeypatch.setattr(specdec, "load_target", lambda *a, **kw: target)
    say = lambda *a: print(*a)  # noqa: E731
    for cached, load, said in ((None, 0.0, True), ({2: "mm"}, 0.0, False), (None, fr.cores_available() + 1.0, False)):
        monkeypatch.setattr(fr, "cached_plan", lambda model, packed=True: cached)
        quiet_machine["load"] = load  # busy: autotune will not tune, so the demo does not say it does
        assert demo._load(specdec, None, say) is target
        assert ("tuning the few-row plan" in capsys.readouterr().out) is said
    assert tuned == [1, 1, 1]  # a cached plan is still spot-checked, a busy machine told why (Target.tune)

"""The few-row plan is tuned outside timed runs and cached per machine (specdec.few_rows.autotune):
measured once per key (CPU model, threads, dtype, torch version, packing, the row counts and
products measured, layer shapes), read from the cache afterwards, never measured by a forward or a
generation; a deterministic heuristic serves where nothing was tuned; every result records which
plan ran."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import specdec
from specdec import few_rows as fr
from specdec.eval.config import DatasetConfig, DrafterConfig, RunConfig, TargetConfig
from specdec.eval.runner import run_experiment
from specdec.testing.tiny import tiny_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty plan cache of this test's own."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    return tmp_path / "few_rows"


@pytest.fixture(autouse=True)
def quiet(quiet_machine):
    """Every test here starts on a quiet machine (tests/conftest.py)."""
    return quiet_machine


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def measured(monkeypatch):
    """Every call of ``few_rows.measure``, with fixed times: ``W @ xᵀ`` wins at 2 rows."""
    calls: list[int] = []

    def fake(model, row_counts=fr.ROW_COUNTS, reps=2, packed=True):
        calls.append(torch.get_num_threads())
        return {1: {"linear": 1.0, "mm": 1.5}, 2: {"linear": 1.0, "mm": 0.5}}

    monkeypatch.setattr(fr, "measure", fake)
    return calls


def _model(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 16))


def test_a_plan_is_measured_once_per_machine_key_then_read_from_the_cache(cache, measured, threads):
    torch.set_num_threads(1)
    first = _model()
    assert fr.autotune(first) == {2: "mm"} and measured == [1]
    assert fr.plan_record(first)["source"] == "measured"
    files = list(cache.glob("*.json"))
    assert len(files) == 1
    record = json.loads(files[0].read_text())
    assert record["key"] == fr.plan_key(first) and record["plan"] == {"2": "mm"}
    assert set(record["key"]) == {"cpu", "threads", "dtype", "torch", "packed", "pack_budget", "measured", "layers"}
    assert set(record["conditions"]) == {"load", "cores", "threads", "repeats", "spread", "measured"}
    assert record["conditions"]["load"] == 0.0 and record["conditions"]["threads"] == 1
    assert record["key"]["cpu"] == fr.cpu_model() and record["key"]["torch"] == torch.__version__

    again = _model(seed=1)  # another process's model of the same shapes: read, not measured
    assert fr.autotune(again) == {2: "mm"} and measured == [1]
    rec = fr.plan_record(again)
    assert {k: v for k, v in rec.items() if k not in ("conditions", "age", "note")} == {
        "source": "cached", "threads": 1, "packed": True, "pack_budget": 1.0, "packed_mib": 0.0,
        "linear_mib": round(fr.linear_bytes(again) / 2**20, 1), "plan": {"2": "mm"}, "retune": fr.RETUNE}
    assert rec["conditions"] == record["conditions"] and rec["age"] is not None and "spot-checked" in rec["note"]
    fresh = _model(seed=2)
    assert fr.plan_for(fresh) == {2: "mm"} and fr.plan_record(fresh)["source"] == "cached" and measured == [1]

    torch.set_num_threads(2)  # another key: measured once more, its own file
    assert fr.autotune(again) == {2: "mm"} and measured == [1, 2] and len(list(cache.glob("*.json"))) == 2
    other = nn.Sequential(nn.Linear(24, 48))  # other shapes: another key
    fr.autotune(other)
    assert measured == [1, 2, 2]
    fr.autotune(again, force=True)
    assert measured == [1, 2, 2, 2]


def test_a_plan_tuned_over_other_row_counts_or_products_is_measured_again(cache, measured, monkeypatch):
    """A tuner that measures more row counts (or considers ``W @ xᵀ`` up to more rows) does not read
    the plan an older one cached: the counts it never measured would keep the heuristic."""
    fr.autotune(_model())
    assert measured == [torch.get_num_threads()] and fr.plan_record(_model())["source"] == "cached"
    monkeypatch.setattr(fr, "ROW_COUNTS", (*fr.ROW_COUNTS, 64))
    assert fr.cached_plan(_model()) is None
    fr.autotune(_model())
    assert len(measured) == 2 and len(list(cache.glob("*.json"))) == 2
    monkeypatch.setattr(fr, "MM_ROWS", fr.MM_ROWS + 1)
    assert fr.cached_plan(_model()) is None


def test_a_corrupt_or_foreign_cache_file_is_measured_again(cache, measured):
    model = _model()
    fr.autotune(model)
    (path,) = cache.glob("*.json")
    path.write_text("{not json")
    assert fr.cached_plan(_model()) is None
    fr.autotune(_model())
    assert len(measured) == 2
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "key": {**record["key"], "cpu": "another CPU"}}))
    assert fr.cached_plan(_model()) is None
    path.write_text(json.dumps({**record, "plan": {"2": "fast"}}))
    assert fr.cached_plan(_model()) is None


def test_plan_for_never_measures_and_falls_back_to_the_deterministic_heuristic(cache, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("plan_for measured")

    monkeypatch.setattr(fr, "measure", refuse)
    model = _model()
    assert fr.plan_for(model) == fr.HEURISTIC == {} and fr.plan_for(model, packed=False) == {}
    assert fr.plan_record(model)["source"] == "heuristic"
    fr.pin(model, {3: "mm"})
    assert fr.plan_record(model)["source"] == "pinned" and fr.plan_record(model)["plan"] == {"3": "mm"}


def test_the_first_generate_after_load_target_spends_no_time_measuring(cache, monkeypatch, threads):
    """``load_target`` tunes; ``generate`` never calls ``measure`` (counted, not timed) and its summary
    names the plan that ran; a second load of the same shapes reads the cache."""
    calls: list[str] = []
    real = fr.measure
    phase = ["load"]

    def counting(*args, **kwargs):
        calls.append(phase[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(fr, "measure", counting)
    monkeypatch.setattr(fr, "SPREAD_LIMIT", math.inf)  # a tiny model's passes take microseconds: all noise
    target = specdec.load_target(tiny_model("llama", vocab_size=48, seed=3), threads=1)
    assert calls == ["load"]
    phase[0] = "generate"
    out = specdec.generate(target, [[1, 2, 3, 4]], "ngram", k=3, max_new_tokens=6)
    out_ar = specdec.generate(target, [[1, 2, 3, 4]], None, max_new_tokens=6)
    assert calls == ["load"]
    plan = {str(r): h for r, h in fr.plan_for(target.model).items()}
    assert out.summary.few_rows == {"source": "measured", "threads": 1, "packed": True, "plan": plan,
                                    "retune": fr.RETUNE, "note": "", **{k: out.summary.few_rows[k] for k in (
                                        "pack_budget", "packed_mib", "linear_mib", "conditions", "age")}}
    assert out.summary.few_rows["conditions"]["repeats"] == fr.REPEATS
    assert out.summary.few_rows["pack_budget"] == fr.PACK_BUDGET
    assert out.summary["few_rows"] == out_ar.summary.few_rows and "few-row plan (1 threads, measured; measured under a minute ago" in str(out.summary)
    assert f"re-tune: {fr.RETUNE}" in str(out.summary) and f"{fr.REPEATS} repeats" in str(out.summary)
    assert out_ar.summary.k == 0 and out.summary.k == 3  # the baseline asks no drafts

    phase[0] = "load"
    again = specdec.load_target(tiny_model("llama", vocab_size=48, seed=4), threads=1)
    assert calls == ["load"]
    assert specdec.generate(again, [[1, 2, 3]], None, max_new_tokens=2).summary.few_rows["source"] == "cached"
    untuned = specdec.load_target(tiny_model("llama", vocab_size=48, seed=5, hidden_size=48), threads=1,
                                  autotune=False)
    assert calls == ["load"]
    assert specdec.generate(untuned, [[1, 2]], None, max_new_tokens=2).summary.few_rows == {
        "source": "heuristic", "threads": 1, "packed": True, "plan": {}, "pack_budget": fr.PACK_BUDGET,
        "packed_mib": 0.0, "linear_mib": round(fr.linear_bytes(untuned.model) / 2**20, 1), "conditions": None,
        "age": None, "note": "nothing tuned or cached", "retune": fr.RETUNE}
    with pytest.raises(TypeError, match="autotune"):
        specdec.load_target(again.model, autotune="yes")


def test_the_runner_records_the_plan_of_every_loop_method(cache, tmp_path):
    cfg = RunConfig(target=TargetConfig(model="tiny", tiny={"vocab_size": 64}), drafter=DrafterConfig("ngram"),
                    dataset=DatasetConfig(name="random", num_prompts=2, input_len=8, output_len=4, ignore_eos=True),
                    progress=False, warmup=False)
    res = run_experiment(cfg, out_dir=tmp_path / "run")
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    for summary in (res.summary, written):
        assert set(summary) == {"ar", "spec"}
        assert all(s["few_rows"]["source"] == "heuristic" and s["few_rows"]["plan"] == {} for s in summary.values())


def test_the_command_tunes_a_target_once_and_prints_its_plan_and_file(cache, measured, threads, monkeypatch, capsys):
    from specdec import autotune as command

    asked = []

    def load(name, **options):  # the named target, as the command asks for it, is a tiny model
        asked.append((name, options))
        return specdec.load_target(tiny_model("llama", vocab_size=48, seed=0), **options)

    monkeypatch.setattr(command, "load_target", load)
    command.main(["--model", "tiny", "--threads", "1"])
    out = json.loads(capsys.readouterr().out)
    assert asked == [("tiny", {"threads": 1, "pack": True, "autotune": False})]
    assert out["source"] == "measured" and out["plan"] == {"2": "mm"} and measured == [1]
    assert json.loads(open(out["file"]).read())["plan"] == {"2": "mm"} and out["file"].startswith(str(cache))
    command.main(["--model", "tiny", "--threads", "1"])  # the second run reads the cache
    assert json.loads(capsys.readouterr().out)["source"] == "cached" and measured == [1]
    with pytest.raises(SystemExit):
        command.main(["--threads", "0"])


def _times(plan_row2: str, spread: float = 0.02) -> fr.Times:
    """Times of two row counts where ``plan_row2`` wins at 2 rows (``"linear"``: nothing does)."""
    two = {"linear": 1.0, "mm": 0.5 if plan_row2 == "mm" else 1.5}
    return fr.Times({1: {"linear": 1.0, "mm": 1.5}, 2: two},
                    {1: {"linear": spread, "mm": spread}, 2: {"linear": spread, "mm": spread}}, fr.REPEATS)


def test_a_plan_tuned_under_load_is_spot_checked_by_a_quiet_load_target_and_tuned_again(cache, quiet, monkeypatch,
                                                                                          threads):
    """A plan whose product lost its edge (measured under load: the busy loops are gone now) is found by
    the spot check at the next ``load_target`` and measured again; the summary says so."""
    wins = ["mm"]
    calls = []

    def fake(model, row_counts=fr.ROW_COUNTS, reps=fr.REPEATS, packed=True):
        calls.append(wins[0])
        return _times(wins[0])

    monkeypatch.setattr(fr, "measure", fake)
    model = tiny_model("llama", vocab_size=48, seed=3)
    assert specdec.load_target(model, threads=1).row_plan_record()["plan"] == {"2": "mm"} and calls == ["mm"]
    quiet["spot"] = lambda model, plan: {r: (2.0, 1.0) for r in plan}  # "mm" at 2 rows: twice F.linear's time now
    wins[0] = "linear"
    again = specdec.load_target(tiny_model("llama", vocab_size=48, seed=4), threads=1)
    assert calls == ["mm", "linear"]
    record = again.row_plan_record()
    assert record["source"] == "measured" and record["plan"] == {}
    assert record["note"] == "measured again: its 'mm' product at 2 rows now takes 2.00x F.linear's time (spot check)"
    out = specdec.generate(again, [[1, 2, 3]], None, max_new_tokens=2)
    assert "measured again" in str(out.summary) and f"re-tune: {fr.RETUNE}" in str(out.summary)
    (path,) = cache.glob("*.json")
    assert json.loads(path.read_text())["plan"] == {}  # the cache holds the new plan

    quiet["spot"] = lambda model, plan: {r: (0.95, 1.0) for r in plan}  # within the margin: it holds
    wins[0] = "mm"
    fr.autotune(_model(), force=True)
    fr.autotune(_model())
    assert calls == ["mm", "linear", "mm"]


def test_a_cached_plan_measured_under_more_load_or_recording_no_conditions_is_measured_again(cache, quiet,
                                                                                             monkeypatch):
    calls = []
    monkeypatch.setattr(fr, "measure", lambda model, packed=True: calls.append(1) or _times("mm"))
    fr.autotune(_model())
    (path,) = cache.glob("*.json")
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "conditions": {**record["conditions"], "load": 1.4}}))
    fr.autotune(_model())
    assert len(calls) == 2 and fr.plan_record(_model())["source"] == "cached"
    legacy = {k: v for k, v in record.items() if k not in ("conditions", "spreads")}  # an older specdec's file
    path.write_text(json.dumps(legacy))
    model = _model()
    fr.autotune(model)
    assert len(calls) == 3 and "records no measuring conditions" in fr.plan_record(model)["note"]


def test_a_busy_machine_or_a_wide_spread_is_never_tuned_on(cache, quiet, monkeypatch, threads):
    """Other load that leaves fewer free cores than the threads wanted, before or after measuring, or
    repeats that disagree: the heuristic (or the cached plan) stays, says why and how to re-tune, and
    nothing is cached."""
    torch.set_num_threads(1)
    cores = fr.cores_available()
    calls = []
    after = {"load": 0.0}

    def fake(model, row_counts=fr.ROW_COUNTS, reps=fr.REPEATS, packed=True):
        calls.append(1)
        quiet["load"] = after["load"]  # what the load average says once measuring is over
        return _times("mm", spread=after.get("spread", 0.02))

    monkeypatch.setattr(fr, "measure", fake)
    quiet["load"] = cores + 0.6  # a busy loop per core and then some
    model = _model()
    assert fr.autotune(model) == fr.HEURISTIC and calls == [] and not cache.exists()
    rec = fr.plan_record(model)
    assert rec["source"] == "heuristic" and rec["note"].startswith("not tuned: the machine is busy")
    assert fr.RETUNE in rec["note"] and "F.linear at every row count" in rec["note"]

    quiet["load"], after["load"] = 0.0, cores + 0.6  # busy by the end of the measurement
    assert fr.autotune(_model()) == fr.HEURISTIC and calls == [1] and not cache.exists()
    quiet["load"], after["load"], after["spread"] = 0.0, 0.0, 0.4
    model = _model()
    assert fr.autotune(model) == fr.HEURISTIC and calls == [1, 1] and not cache.exists()
    assert "the repeats spread 40% (over 25%)" in fr.plan_record(model)["note"]

    after["spread"] = 0.02
    assert fr.autotune(_model()) == {2: "mm"} and cache.exists()  # quiet and agreeing: tuned and cached
    quiet["spot"] = lambda model, plan: pytest.fail("a spot check on a busy machine")
    quiet["load"] = after["load"] = cores + 0.6
    model = _model()
    assert fr.autotune(model) == {2: "mm"} and len(calls) == 3  # a cached plan is kept, not spot-checked
    assert fr.plan_record(model)["note"].startswith("not spot-checked: the machine is busy")
    assert fr.autotune(model, force=True) == {2: "mm"} and len(calls) == 3  # forced, but busy: kept, says so
    assert "not tuned: the machine is busy" in fr.plan_record(model)["note"]


def test_a_plan_says_how_old_it_is_and_how_it_was_measured():
    from datetime import datetime, timezone

    now = datetime(2026, 12, 4, 12, 0, tzinfo=timezone.utc)
    assert fr.age("2026-12-01T11:00:00Z", now) == "3 days" and fr.age("2026-12-04T11:59:30Z", now) == "under a minute"
    assert fr.age("2026-12-04T10:00:00Z", now) == "2 hours" and fr.age(None) is None and fr.age("yesterday") is None
    record = {"source": "cached", "note": "spot-checked at other load 0.1: it holds", "age": "3 days",
              "conditions": {"load": 0.2, "cores": 2, "threads": 1, "repeats": 5, "spread": 0.04,
                             "measured": "2026-12-01T11:00:00Z"}}
    assert fr.describe(record) == ("cached; measured 3 days ago (2026-12-01T11:00:00Z), 5 repeats at other load 0.2"
                                   " on 2 cores, spread 4%; spot-checked at other load 0.1: it holds;"
                                   " re-tune: specdec-autotune --force")


def test_a_cached_plan_that_no_longer_holds_is_not_kept_when_it_cannot_be_measured_again(cache, quiet, monkeypatch):
    """The spot check finds the cached product slower than F.linear, but the new measurement spreads
    too wide to trust: F.linear everywhere (not the stale plan), saying both."""
    spreads = [0.02]
    monkeypatch.setattr(fr, "measure", lambda model, packed=True: _times("mm", spread=spreads[0]))
    fr.autotune(_model())
    quiet["spot"] = lambda model, plan: {r: (3.0, 1.0) for r in plan}
    spreads[0] = 0.6
    model = _model()
    assert fr.autotune(model) == fr.HEURISTIC
    note = fr.plan_record(model)["note"]
    assert note.startswith("not tuned: the repeats spread 60%") and "the cached plan no longer holds" in note
    assert "3.00x F.linear's time" in note and fr.RETUNE in note


def test_specdec_autotune_says_why_it_refused_and_exits_1(cache, quiet, monkeypatch, capsys, threads):
    from specdec import autotune as command

    target = specdec.Target(tiny_model("llama", vocab_size=48, seed=3))
    monkeypatch.setattr(command, "load_target", lambda *a, **kw: target)
    monkeypatch.setattr(fr, "measure", lambda model, packed=True: pytest.fail("measured on a busy machine"))
    quiet["load"] = fr.cores_available() + 1.0
    with pytest.raises(SystemExit) as e:
        command.main(["--force"])
    assert e.value.code == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["source"] == "heuristic"
    assert err.startswith("few-row plan: heuristic; not tuned: the machine is busy") and fr.RETUNE in err

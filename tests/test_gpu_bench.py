"""The GPU kit: the planted-acceptance drafter, and the CPU dry run of experiments/bench.py gpu."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.loop import Request, run
from specdec.target import Target
from specdec.testing.planted import PlantedDrafter, greedy_continuations
from specdec.testing.tiny import tiny_model
from specdec.verifiers import GreedyVerifier

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]


def _target() -> Target:
    return Target(tiny_model("llama", vocab_size=64, init_scale=0.3, seed=0))


def test_planted_greedy_output_is_autoregressive():
    target = _target()
    reqs = lambda: [Request(p, 24) for p in PROMPTS]  # noqa: E731
    ar = run(target, None, GreedyVerifier(), reqs(), eos_token_ids=set())
    spec = run(target, PlantedDrafter.create(target, p=0.6, seed=1), GreedyVerifier(), reqs(), k=4,
               eos_token_ids=set())
    assert [r.tokens for r in spec.requests] == [r.tokens for r in ar.requests]
    # the plain decoding the drafter plants is the loop's own greedy output
    assert greedy_continuations(target, PROMPTS, 24) == [r.tokens for r in ar.requests]


def test_planted_acceptance_per_position_is_p():
    target = _target()
    p, k = 0.7, 4
    drafter = PlantedDrafter.create(target, p=p, horizon=400, seed=0)
    res = run(target, drafter, GreedyVerifier(), [Request(q, 360) for q in PROMPTS], k=k, eos_token_ids=set())
    drafted = [sum(r.metrics.drafted_at[d] for r in res.requests) for d in range(k)]
    accepted = [sum(r.metrics.accepted_at[d] for r in res.requests) for d in range(k)]
    reached = [drafted[0]] + accepted[:-1]  # depth d+1 is tested only after depth d was accepted
    rates = [a / n for a, n in zip(accepted, reached)]
    assert drafted[0] > 300
    for rate in rates:  # binomial s.d. at ≥ 150 trials is ≤ 0.04
        assert abs(rate - p) < 0.1, rates


def test_planted_all_or_nothing():
    target = _target()
    for p, expect in ((1.0, 5.0), (0.0, 1.0)):
        res = run(target, PlantedDrafter.create(target, p=p), GreedyVerifier(), [Request([1, 2, 3], 21)], k=4,
                  eos_token_ids=set())
        m = res.requests[0].metrics
        assert m.mean_accepted_length == expect


@pytest.mark.slow  # ~45 s on one CPU core
def test_dry_run_writes_every_file(tmp_path):
    """`make gpu-bench DRY_RUN=1`'s command: every section runs on CPU and says what it measured."""
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench.py"), "gpu", "--dry-run", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["gpu"] == "cpu dry run" and env["torch"] and env["transformers"]
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["dry_run"] and res["skipped"] == [] and res["errors"] == {}
    assert set(res["section_s"]) == {"kernels", "target", "forward", "planted", "mtp", "train"}
    kr = res["kernels"]
    assert kr["path"] == "cpu interpreter (TRITON_INTERPRET=1)" and kr["copy_bandwidth_GBps"] > 0
    assert kr["errors"] == []  # a failing case would be listed here, the other rows kept
    kernels = {r["kernel"] for r in kr["rows"]}
    assert kernels == {"rejection chain", "rejection tree", "rejection chain greedy", "draft input", "markov sampler",
                       "kv gather"}
    assert all(r["exact"] and r["speedup"] > 0 for r in kr["rows"])
    fw = res["forward"]["rows"]
    assert {r["batch"] for r in fw} == {1, 4} and all(r["t_over_t1"] == 1.0 for r in fw if r["m"] == 1)
    assert all(r["ms_captured"] > 0 and r["t_over_t1_captured"] > 0 for r in fw)  # eager and captured side by side
    assert res["forward"]["captured"]["mode"] == "graphs" and res["forward"]["captured"]["recordings"] >= 2
    planted = res["planted"]
    assert planted["label"] == "systems benchmark: acceptance is planted, not learned"
    assert [(r["concurrency"], r["scheduler"]) for r in planted["rows"]] == [(c, s) for c in (1, 4) for s in (False, True)]
    assert {c: v["source"] for c, v in planted["scheduler_costs"].items()} == {
        "1": "forward section, batch 1", "4": "forward section, batch 4"}  # the scheduler priced by measured forwards
    captured = planted["captured_rows"]  # the planted section on the captured path too
    assert [r["concurrency"] for r in captured] == [1, 4]
    assert all(r["capture"] == "graphs" and r["identical"] and r["identical_to_eager"] for r in captured)
    mtp = res["mtp"]["rows"]
    assert [(r["dtype"], r["k"]) for r in mtp] == [(d, k) for d in ("float32", "bfloat16") for k in (1, 2, 3, 4)]
    for r in planted["rows"] + mtp:
        assert r["identical"] and r["mean_accepted_length"] >= 1 and r["speedup"] > 0 and r["predicted_speedup"] > 0
    train = res["train"]
    assert train["label"].startswith("training throughput only") and train["recipe"].endswith("Eagle3Recipe")
    assert [p["steps"] for p in train["parts"]] == [2, 2] and train["steps"] == 4  # stopped, then resumed
    assert train["tokens_per_s"] > 0 and train["tokens"] == sum(p["tokens"] for p in train["parts"])
    assert all(p["what"].startswith("the training loop alone") for p in train["parts"])  # as the trainer records each part
    md = (tmp_path / "results.md").read_text()
    assert "acceptance is planted, not learned" in md and "| rejection tree |" in md and "## Training throughput" in md
    assert "| captured ms |" in md and "Captured steps" in md
    if res["figures"]:  # matplotlib present
        assert all((tmp_path / f).stat().st_size > 0 for f in res["figures"])

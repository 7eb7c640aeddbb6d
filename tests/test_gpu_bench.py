"""The GPU kit: the planted-acceptance drafter, and the CPU dry run of `make gpu-bench DRY_RUN=1`."""

from __future__ import annotations

import os
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
    env = {**os.environ, "PYTHONPATH": str(ROOT / "experiments")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--dry-run", "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
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
    assert all(r["exact"] and r["speedup"] > 0 and r["unsynchronised_reads"] == 0 for r in kr["rows"])
    fw = res["forward"]["rows"]
    assert {r["batch"] for r in fw} == {1, 4} and all(r["t_over_t1"] == 1.0 for r in fw if r["m"] == 1)
    planted = res["planted"]
    assert planted["label"] == "systems benchmark: acceptance is planted, not learned"
    assert [(r["concurrency"], r["scheduler"]) for r in planted["rows"]] == [(c, s) for c in (1, 4) for s in (False, True)]
    assert {c: v["source"] for c, v in planted["scheduler_costs"].items()} == {
        "1": "forward section, batch 1", "4": "forward section, batch 4"}  # the scheduler priced by measured forwards
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
    if res["figures"]:  # matplotlib present
        assert all((tmp_path / f).stat().st_size > 0 for f in res["figures"])


def _bench_module(name: str, monkeypatch):
    """A module of experiments/benchmarks/, imported as the kit imports it (experiments/ on the path)."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    return importlib.import_module(f"benchmarks.{name}")


def test_a_kernel_case_that_differs_names_its_first_element_and_the_reference_value(monkeypatch):
    kb = _bench_module("kernels", monkeypatch)
    from specdec.types import Verification

    ref = Verification(path=torch.tensor([[0, 1], [-1, -1]]), num_accepted=torch.tensor([2, 0]),
                       tokens=torch.tensor([[5, 6, 7], [9, -1, -1]]))
    same = Verification(ref.path.clone(), ref.num_accepted.clone(), ref.tokens.clone())
    assert kb.verification_difference(ref, same) is None
    ker = Verification(ref.path.clone(), ref.num_accepted.clone(), ref.tokens.clone())
    ker.tokens[1, 0] = 4
    assert kb.verification_difference(ref, ker) == {"where": "tokens[1, 0]", "reference": 9, "kernel": 4}
    ker.num_accepted[1] = 1  # the count is named before the tokens
    assert kb.verification_difference(ref, ker)["where"] == "num_accepted[1]"
    # floats within a tolerance; a tuple names its part
    a = torch.zeros(2, 3)
    b = a.clone()
    b[1, 2] = 1e-3
    assert kb.first_difference(a, b, atol=1e-2) is None
    assert kb.first_difference((a, a), (a, b), atol=1e-4) == {"where": "[1][1, 2]", "reference": 0.0,
                                                               "kernel": b[1, 2].item()}
    assert kb.first_difference(a, a[:1])["where"] == " shape"
    assert kb.describe_difference(None) == "True"
    assert kb.describe_difference({"where": "tokens[23, 0]", "reference": 25961, "kernel": 12089}) == \
        "False: tokens[23, 0] = 12089, reference 25961"


def test_the_kit_table_shows_the_first_difference(monkeypatch):
    gpu = _bench_module("gpu", monkeypatch)
    row = {"kernel": "rejection tree", "shape": "B=64 k=8 V=32000", "torch_ms": 6.2, "torch_pct_copy_bw": 0.5,
           "triton_ms": 0.13, "triton_pct_copy_bw": 24.8, "speedup": 47.1, "exact": False,
           "first_difference": {"where": "num_accepted[23]", "reference": 2, "kernel": 0}}
    ok = {**row, "exact": True, "first_difference": None}
    md = gpu.markdown({"kernels": {"path": "compiled", "copy_bandwidth_GBps": 4252.0, "rows": [row, ok],
                                   "errors": [], "autotune": {}}, "errors": {}, "skipped": []},
                      {"gpu": "test", "date": "today", "torch": "x", "triton": "y", "transformers": "z"})
    assert "| 47.10 | False: num_accepted[23] = 0, reference 2 | – |" in md
    assert md.count("| True | – |") == 1


def test_the_kit_records_the_path_auto_takes(monkeypatch):
    """Each kernel row says which path the dispatcher takes there, and the run lists every choice."""
    gpu = _bench_module("gpu", monkeypatch)
    from specdec.kernels import choice

    calls = []

    def build():
        return (lambda: calls.append(1) or torch.ones(2)), 8, gpu.first_difference

    monkeypatch.setattr(choice, "_LAST", {"markov": ("torch", "measured")})
    row = gpu.kernel_row(build, 1e9, "cpu", True, with_triton=False, dispatched="markov")
    assert (row["auto"], row["auto_why"]) == ("torch", "measured") and len(calls) >= 2
    rec = [{"kernel": "markov", "shape": {"B": 64, "G": 4, "V": 128256, "R": 64}, "backend": "torch",
            "source": "measured", "triton_ms": 13.476, "torch_ms": 4.093}]
    md = gpu.markdown({"kernels": {"path": "compiled", "copy_bandwidth_GBps": 1.0, "errors": [], "autotune": {},
                                   "rows": [{"kernel": "markov sampler", "shape": "B=64", **row}]},
                       "kernel_choices": rec, "errors": {}, "skipped": []},
                      {"gpu": "test", "date": "today", "torch": "x", "triton": "y", "transformers": "z"})
    assert "| torch (measured) |" in md
    assert "| markov | B=64 G=4 V=128256 R=64 | torch | measured | 13.476 | 4.093 |" in md
    assert set(gpu.DISPATCHED.values()) == {"rejection", "norm_concat_linear", "markov", "gather_slots"}

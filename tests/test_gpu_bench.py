"""The GPU kit: the planted-acceptance drafter, and the CPU dry run of `make gpu-bench DRY_RUN=1`."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.loop import Request, run
from specdec.target import Target
from specdec.testing.planted import PlantedDrafter, choice_margin, greedy_continuations, separate_choices
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
        assert r["measured_over_predicted"] == pytest.approx(r["speedup"] / r["predicted_speedup"])
    for r in planted["rows"]:  # the planted acceptance at every position tested (the target's choices are separated)
        acceptance = r["acceptance_given_reached"]  # None: a position the scheduler never had verified
        assert acceptance[0] is not None and all(a is None or abs(a - planted["p"]) <= 0.05 for a in acceptance), r
    train = res["train"]
    assert train["label"].startswith("training throughput only") and train["recipe"].endswith("Eagle3Recipe")
    assert [p["steps"] for p in train["parts"]] == [2, 2] and train["steps"] == 4  # stopped, then resumed
    assert train["tokens_per_s"] > 0 and train["tokens"] == sum(p["tokens"] for p in train["parts"])
    assert train["positions_per_s"] > 0 and train["positions"] == sum(p["positions"] for p in train["parts"])
    assert 0 < train["positions_per_token"] < 1  # every response position with a label, of every target token
    assert all(p["what"].startswith("the training loop alone") for p in train["parts"])  # as the trainer records each part
    md = (tmp_path / "results.md").read_text()
    assert "acceptance is planted, not learned" in md and "| rejection tree |" in md and "## Training throughput" in md and "trained positions/s" in md
    if res["figures"]:  # matplotlib present
        assert all((tmp_path / f).stat().st_size > 0 for f in res["figures"])


def _separated(dtype: torch.dtype, separate: bool = True) -> Target:
    model = tiny_model("llama", vocab_size=256, init_scale=0.3, seed=0, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=4).to(dtype)
    target = Target(model)
    if separate:
        separate_choices(target, seed=0)
    return target


def _block_choices(target: Target, prompt: list[int], continuation: list[int], m: int) -> tuple[list[int], float]:
    """The argmax after every token of ``continuation`` from forwards over blocks of ``m`` tokens
    (as a verify step runs them), and the smallest choice margin seen."""
    session = target.new_session(1)
    target.prefill(session, [prompt])
    choices, margin = [], float("inf")
    for lo in range(0, len(continuation) - m + 1, m):
        out = target.forward(session, torch.tensor([continuation[lo:lo + m]]))
        target.commit(session, None)
        choices += out.logits[0].argmax(-1).tolist()
        margin = min(margin, float(choice_margin(out.logits[0]).min()))
    return choices, margin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_separated_choices_are_the_same_from_one_token_and_block_forwards(dtype):
    """The kit's target: its greedy continuation (one token per forward) is what a verify forward over
    a block of 5 picks at every position, by a margin of half the top logit, in bf16 too."""
    target = _separated(dtype)
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, 256, (6, 16), generator=g).tolist()
    for prompt, cont in zip(prompts, greedy_continuations(target, prompts, 41)):
        choices, margin = _block_choices(target, prompt, cont, 5)
        assert choices == cont[1:len(choices) + 1]
        assert margin > 0.4, margin
        assert len(set(cont)) > 20  # a permutation's cycle, not one repeated token


def test_a_random_target_in_bf16_has_near_ties_that_separation_removes():
    """What the separation is for: the same random model, unseparated, has choices within 1% of a tie."""
    target = _separated(torch.bfloat16, separate=False)
    prompts = torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(3)).tolist()
    margins = [_block_choices(target, p, c, 5)[1] for p, c in zip(prompts, greedy_continuations(target, prompts, 41))]
    assert min(margins) < 0.01, margins


def test_separation_needs_an_untied_head():
    with pytest.raises(ValueError, match="not tied"):
        separate_choices(Target(tiny_model("llama", vocab_size=64, tie_word_embeddings=True)))


@pytest.mark.parametrize("p", [0.8, 0.55, 1.0, 0.0])
def test_even_pattern_plants_p_at_every_position_to_half_a_trial(p):
    target = _separated(torch.float32)
    k, prompts = 4, torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(5)).tolist()
    res = run(target, PlantedDrafter.create(target, p=p, pattern="even", horizon=64), GreedyVerifier(),
              [Request(q, 48) for q in prompts], k=k, eos_token_ids=set())
    reached, accepted = _per_position(res, k)
    for d, (n, a) in enumerate(zip(reached, accepted)):
        if n:
            assert abs(a - p * n) <= 0.5 + 1e-9, (d, n, a)
    assert reached[0] > 0 and (p < 1 or accepted == reached) and (p > 0 or sum(accepted) == 0)


def test_even_pattern_gives_back_what_a_policy_did_not_verify():
    """Positions a draft-length policy cut were never tested: their share is planted again later."""
    from specdec.policy import PrefixPolicy, StepCosts

    target = _separated(torch.float32)
    tokens = [1, 8, 64, 512]
    costs = StepCosts(tokens, [1.0 + 0.5 * n for n in tokens], [1, 64], [0.0, 0.0])  # drafts cost: chains cut short
    prompts = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(6)).tolist()
    res = run(target, PlantedDrafter.create(target, p=0.8, pattern="even"), GreedyVerifier(),
              [Request(q, 48) for q in prompts], k=4, eos_token_ids=set(), policy=PrefixPolicy(costs))
    reached, accepted = _per_position(res, 4)
    drafted = sum(r.metrics.drafted for r in res.requests)
    assert 0 < drafted < 4 * sum(r.metrics.steps for r in res.requests)  # the policy did cut
    for n, a in zip(reached, accepted):
        if n >= 10:
            assert abs(a / n - 0.8) <= 0.05, (reached, accepted)


def _per_position(res, k: int) -> tuple[list[int], list[int]]:
    """Times each draft position was tested (reached within the verified drafts) and accepted."""
    drafted = [sum(r.metrics.drafted_at[d] if d < len(r.metrics.drafted_at) else 0 for r in res.requests)
               for d in range(k)]
    accepted = [sum(r.metrics.accepted_at[d] if d < len(r.metrics.accepted_at) else 0 for r in res.requests)
                for d in range(k)]
    reached = [min(drafted[d], accepted[d - 1]) if d else drafted[0] for d in range(k)]
    return reached, accepted


def test_the_kits_planted_section_is_identical_to_autoregressive_at_the_planted_acceptance(monkeypatch):
    """The dry run's planted section (CPU, tiny shapes): every row, with and without the scheduler,
    is the target's own greedy output, and accepts p at every draft position to within 0.05."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    gpu = importlib.import_module("benchmarks.gpu")
    target = gpu.build_target("cpu", True)
    runs: list[tuple[bool, bool, list]] = []  # (drafter, scheduler, the target forwards' shapes), per decode
    forward, decode, inside = target.forward, gpu.decode, [False]

    def recording_forward(session, tokens, *args, **kwargs):
        if inside[0]:  # not the scheduler's cost measurements between runs
            runs[-1][2].append(tuple(tokens.shape))
        return forward(session, tokens, *args, **kwargs)

    def recording_decode(target, drafter, prompts, new_tokens, k, policy=None):
        runs.append((drafter is not None, policy is not None, []))
        inside[0] = True
        try:
            return decode(target, drafter, prompts, new_tokens, k, policy)
        finally:
            inside[0] = False

    monkeypatch.setattr(target, "forward", recording_forward)
    monkeypatch.setattr(gpu, "decode", recording_decode)
    # verify costs that do not grow with the block: the scheduler verifies every draft, whatever this CPU measures
    flat = [{"batch": c, "m": m, "ms": 1.0} for c in (1, 4) for m in (1, 2, 4, 8)]
    res = gpu.bench_planted(target, "cpu", True, gpu.Budget(1e9, gpu.now()), p=0.8, k=4, forward_rows=flat)
    rows = res["rows"]
    # per concurrency: AR and planted untimed, then timed (r times each), the scheduled run untimed, then timed
    r = gpu.PLANTED["dry"]["repeats"]
    ar, plain, sched = (False, False), (True, False), (True, True)
    per_c = [ar, plain] + [ar] * r + [plain] * r + [sched] * (1 + r)
    assert [(d, s) for d, s, _ in runs] == per_c * 2
    for c in range(2):
        at_c = runs[len(per_c) * c: len(per_c) * (c + 1)]
        for kind in (ar, plain, sched):  # every run of a configuration, untimed and timed, ran the same forwards
            assert len({tuple(f) for d, s, f in at_c if (d, s) == kind}) == 1
        # the scheduler verified every draft here: the same forwards as without it
        assert next(f for d, s, f in at_c if (d, s) == plain) == next(f for d, s, f in at_c if (d, s) == sched)
    assert [(r["concurrency"], r["scheduler"]) for r in rows] == [(c, s) for c in (1, 4) for s in (False, True)]
    for r in rows:
        assert r["identical"], r
        assert all(abs(a - 0.8) <= 0.05 for a in r["acceptance_given_reached"]), r["acceptance_given_reached"]
    for plain, scheduled in zip(rows[::2], rows[1::2]):  # the same drafts accepted: the same work
        assert plain["mean_accepted_length"] == pytest.approx(scheduled["mean_accepted_length"], abs=0.15)


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

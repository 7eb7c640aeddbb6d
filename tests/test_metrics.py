"""Metrics: mean accepted length counts the bonus token; per-depth acceptance; time split."""

from __future__ import annotations

from specdec.loop import Request, run
from specdec.metrics import GenerationSummary, RequestMetrics, summarize
from specdec.verifiers import GreedyVerifier


def test_request_metrics_arithmetic():
    m = RequestMetrics(prompt_tokens=3)
    m.record(depth_drafted=3, depth_accepted=3, drafted=3)
    m.record(depth_drafted=3, depth_accepted=1, drafted=3)
    m.record(depth_drafted=0, depth_accepted=0, drafted=0)
    assert m.mean_accepted_length == (4 + 3) / 3
    assert m.acceptance_at == [1.0, 0.5, 0.5]
    assert summarize([m, m])["acceptance_at"] == [1.0, 0.5, 0.5]


def test_autoregressive_run_scores_one_and_splits_time(target):
    res = run(target, None, GreedyVerifier(), [Request([1, 2, 3], 8), Request([4], 5)], eos_token_ids=set())
    assert [len(r.tokens) for r in res.requests] == [8, 5]
    assert all(r.metrics.mean_accepted_length == 1.0 for r in res.requests)
    rm = res.metrics
    assert rm.new_tokens == 13 and rm.wall_s > 0
    assert rm.other_s >= -1e-6 and rm.prefill_s + rm.target_s <= rm.wall_s
    s = GenerationSummary.of([r.metrics for r in res.requests], rm, None, "greedy", True, 1)
    assert s.batch_steps == 7 and abs(s.other_ms_per_step - rm.other_s * 1e3 / 7) < 1e-9
    assert abs(s.other_step_frac * (rm.wall_s - rm.prefill_s) - rm.other_s) < 1e-9 and "loop overhead" in str(s)

"""The roofline benchmark (``mode: roofline``, :mod:`specdec.eval.roofline`): its two forwards give
the same logits and return to their context, its cost model counts what a forward moves and
computes, its memory probe sees an allocation, and the tiny preset runs end to end through the
entry point and writes every field. No time is asserted: the machine is shared.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.eval.config import RooflineConfig, RunConfig
from specdec.eval.roofline import (ForwardCost, GeneralLibraryForward, LibraryForward, PeakMemory,
                                   TransformersForward, tree_parents)

ROOT = Path(__file__).resolve().parents[1]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_a_tree_of_m_nodes_is_a_binary_heap():
    assert tree_parents(1) == [-1] and tree_parents(6) == [-1, 0, 0, 1, 1, 2]


def _forwards_agree(target, tree: bool, tol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, target.vocab_size, (2, 7), generator=gen)
    tokens = torch.randint(0, target.vocab_size, (2, 6), generator=gen)
    parents = tree_parents(6) if tree else None
    logits = []
    with torch.inference_mode():
        for fwd in (LibraryForward(target, context), GeneralLibraryForward(target, context),
                    TransformersForward(target, context)):
            for _ in range(2):  # the second forward sees the same context as the first
                logits.append(fwd.call(tokens, parents)().logits.float())
                fwd.drop(tokens)
    for other in logits[1:]:
        torch.testing.assert_close(other, logits[0], rtol=tol, atol=tol)


@pytest.mark.parametrize("tree", [False, True])
def test_library_and_transformers_forwards_agree_and_go_back_to_the_context(target, tree):
    _forwards_agree(target, tree, 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("tree", [False, True])
def test_on_smollm2_the_two_timed_forwards_compute_the_same_logits(smollm2, tree):
    _forwards_agree(smollm2, tree, 1e-4)


def test_the_cost_model_counts_weights_kv_and_flops(target):
    c = target.config  # the tiny Llama: untied embeddings, grouped-query attention
    D, I, L, V, H, Hkv = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size, \
        c.num_attention_heads, c.num_key_value_heads
    hd = D // H
    linear = L * (2 * D * D + 2 * D * Hkv * hd + 3 * D * I) + V * D  # q, o; k, v; gate, up, down; LM head
    params = sum(p.numel() for p in target.model.parameters())
    cost = ForwardCost.of(target)
    assert cost.linear_params == linear
    assert cost.weight_bytes == 4 * (params - V * D)  # fp32; the untied input embedding is only gathered
    assert cost.kv_bytes_per_slot == L * 2 * Hkv * hd * 4 and cost.attn_flops_per_pair == L * 4 * H * hd
    assert cost.bytes(2, 3, 5) == cost.weight_bytes + 2 * 8 * cost.kv_bytes_per_slot
    assert cost.flops(2, 3, 5) == 2 * 3 * (2 * linear + 8 * cost.attn_flops_per_pair)


def test_peak_memory_sees_an_allocation_and_forgets_it():
    mem = PeakMemory(torch.device("cpu"))
    if mem.kind is None:
        pytest.skip("this system has no resettable resident-set peak (/proc/self/clear_refs)")
    mem.start()
    x = torch.ones(16 * 2**20)  # 64 MiB, touched
    assert mem.peak_mib() >= 60
    del x
    mem.start()
    y = torch.ones(2**18)  # 1 MiB
    assert mem.peak_mib() < 30
    del y


def test_the_roofline_config_refuses_what_it_cannot_measure():
    with pytest.raises(ValueError, match="m = 1"):
        RooflineConfig(new_tokens=[2, 4])
    with pytest.raises(ValueError, match="masks"):
        RooflineConfig(masks=["ring"])
    with pytest.raises(ValueError, match="batches"):
        RooflineConfig(batches=[0])
    with pytest.raises(ValueError, match="mode"):
        RunConfig(mode="bench")


def test_the_tiny_preset_writes_every_field_table_and_figure(tmp_path):
    """roofline_tiny through experiments/run.py, as a user runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "experiments/run.py", "--config-name", "roofline_tiny",
                           f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "roofline.json").read_text())
    rc = RooflineConfig(**json.loads((tmp_path / "config.json").read_text())["config"]["roofline"])

    assert [b["threads"] for b in res["bandwidth"]] == rc.threads
    assert all(_positive(b["copy_gb_s"]) and _positive(b["triad_gb_s"]) for b in res["bandwidth"])
    assert {(p["dtype"], p["threads"]) for p in res["compute"]} == {(d, t) for d in rc.dtypes for t in rc.threads}
    assert all(_positive(p["gflop_s"]) for p in res["compute"])

    # every point of the grid is timed or listed as skipped (a tree needs m >= 3)
    grid = {(i, d, t, b, k, m) for i in rc.impls for d in rc.dtypes for t in rc.threads for b in rc.batches
            for k in rc.masks for m in rc.new_tokens if k == "chain" or m >= 3}
    key = lambda r: (r["impl"], r["dtype"], r["threads"], r["batch"], r["mask"], r["m"])  # noqa: E731
    assert {key(r) for r in res["forward"]} | {key(r) for r in res["skipped"]} == grid
    assert {key(r) for r in res["skipped"]} == {k for k in grid if k[3] * k[5] > rc.max_block_tokens}
    for r in res["forward"]:
        for field in ("time_s", "bytes", "flops", "bandwidth_limit_s", "compute_limit_s", "roofline_s",
                      "pct_of_bandwidth_limit", "ratio", "roofline_ratio"):
            assert _positive(r[field]), (field, r)
        assert r["roofline_s"] == max(r["bandwidth_limit_s"], r["compute_limit_s"]) and len(r["times_s"]) == rc.reps
    assert {r["ratio"] for r in res["forward"] if r["m"] == 1 and r["mask"] == "chain"} == {1.0}
    assert len(res["summary"]) == len(rc.impls) * len(rc.dtypes) * len(rc.threads) * len(rc.batches) * len(rc.masks)
    assert all(_positive(s["pct_of_bandwidth_limit_m1"]) and all(map(_positive, s["ratio"].values()))
               for s in res["summary"])

    assert {(r["context"], r["impl"], r["m"]) for r in res["context"]} == {
        (c, i, m) for c in rc.contexts for i in rc.impls for m in rc.context_new_tokens}
    for r in res["context"]:
        assert _positive(r["time_s"]) and _positive(r["prefill_s"]) and _positive(r["pct_of_bandwidth_limit"])
        assert r["memory"] is None or all(math.isfinite(r[f]) for f in ("prefill_peak_mib", "decode_peak_mib"))
        # the tensors' own count: the prefill leaves at least the K and V of the context allocated
        assert r["held_tensor_mib"] >= 0.99 * r["kv_mib"] > 0, r
        assert r["prefill_tensor_mib"] >= r["held_tensor_mib"] and r["decode_tensor_mib"] >= r["held_tensor_mib"]

    assert {(r["context"], r["method"]) for r in res["speedup"]} == {
        (c, m) for c in rc.speedup_contexts for m in ("ar", "ngram", "eagle3")}
    for r in res["speedup"]:
        assert r["prompt_tokens"] == r["context"]
        if r["method"] != "ar":  # greedy: speculation reproduces autoregressive decoding
            assert _positive(r["speedup"]) and _positive(r["mean_accepted_length"])
            assert r["identical_to_baseline"] == r["requests"] == 1

    # which few-row product each row count took, per dtype and thread count (the tiny target's layers:
    # float32 ones measured, bf16 ones never), and what the packed copies hold
    assert [(f["dtype"], [p["threads"] for p in f["plans"]]) for f in res["few_rows"]] == [
        (d, rc.threads) for d in rc.dtypes]
    for f in res["few_rows"]:
        products = [how for p in f["plans"] for rows, how in p["plan"]]
        assert set(products) <= {"mm", "packed"} and all(rows >= 1 for p in f["plans"] for rows, _ in p["plan"])
        assert f["packed_mib"] >= 0 and (f["packed_mib"] > 0) == ("packed" in products)
        assert f["dtype"] == "float32" or not products

    table = (tmp_path / "roofline.md").read_text()
    assert all(f"| {name} |" in table for name in ("library", "library_unpacked", "library_gqa", "library_general",
                                                    "transformers",
                                                    "roofline", "ngram", "eagle3"))
    assert "Few-row products of the library's float32 linear layers" in table
    for fig in ("roofline_time.png", "roofline_ratio.png", "context.png"):
        assert (tmp_path / fig).stat().st_size > 10_000, fig
    assert all((tmp_path / f"speedup_ctx{c}" / "summary.json").exists() for c in rc.speedup_contexts)


def test_tensor_peak_counts_what_is_allocated_in_time_order():
    from specdec.eval.roofline import TensorPeak

    x = torch.randn(100, 100)
    with torch.inference_mode(), TensorPeak() as tp:
        a = torch.empty(4_000_000, dtype=torch.uint8)
        b = torch.empty(1_000_000, dtype=torch.uint8)
        del a
        c = x.new_zeros(500_000)  # 2 MB of float32
        tp.mark()
        d = torch.empty(6_000_000, dtype=torch.uint8)
        del d, c
    mib = 2**20
    assert tp.segments == [pytest.approx((5_000_000 / mib, 3_000_000 / mib), abs=1e-3),
                           pytest.approx((9_000_000 / mib, 1_000_000 / mib), abs=1e-3)]
    assert tp.peak_mib == pytest.approx(9_000_000 / mib, abs=1e-3)
    assert tp.net_mib == pytest.approx(1_000_000 / mib, abs=1e-3)
    del b

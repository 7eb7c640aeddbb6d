"""Every Triton kernel against its torch reference, in Triton's CPU interpreter, on tiny shapes;
then a slice of the conformance suite with the kernel path forced on, so losslessness is shown
through the kernels themselves. Skipped, with the reason, when triton is not installed.

Integer outputs must be identical given the same random numbers; floats agree within the
tolerances each kernel module states. Vocabularies are not multiples of the interpreter's block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest sets it first: it must precede triton's import
pytest.importorskip("triton", reason="triton is not installed (pip install 'specdec[triton]'); CI installs it")

import specdec  # noqa: E402
from specdec import SamplingParams  # noqa: E402
from specdec.kernels import (gather_slots, markov_sample, norm_concat_linear, rejection_sample,  # noqa: E402
                             use_backend)
from specdec.kernels.dispatch import backend_for  # noqa: E402
from specdec.kv import KVStore  # noqa: E402
from specdec.loop import Request, run  # noqa: E402
from specdec.testing import RandomDrafter, assert_greedy_equivalent, greedy_reference, sampled_gof  # noqa: E402
from specdec.types import chain_parents  # noqa: E402
from specdec.verifiers import GreedyVerifier, RejectionVerifier  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="these tests run Triton's interpreter on CPU tensors")
ROOT = Path(__file__).resolve().parents[1]


def both(fn, *args, **kwargs):
    """(reference output, kernel output) of one call."""
    with use_backend("torch"):
        ref = fn(*args, **kwargs)
    with use_backend("triton"):
        ker = fn(*args, **kwargs)
    return ref, ker


# --- dispatch ---------------------------------------------------------------------------------
def test_dispatch_defaults_to_torch_on_cpu_and_obeys_overrides(monkeypatch):
    x = torch.zeros(2)
    assert backend_for(x) == "torch"
    monkeypatch.setenv("SPECDEC_KERNELS", "triton")
    assert backend_for(x) == "triton"
    with use_backend("torch"):
        assert backend_for(x) == "torch"
    monkeypatch.setenv("SPECDEC_KERNELS", "cuda")
    with pytest.raises(ValueError, match="SPECDEC_KERNELS"):
        backend_for(x)


# --- rejection sampler --------------------------------------------------------------------------
def _draft(B, n, V, dense, seed, tree=False, agree=0.0):
    """Target logits and a draft. ``agree`` pulls the draft towards the target (more acceptance)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, n + 1, V, generator=g) * 2
    draft_logits = agree * logits[:, 1:] + torch.randn(B, n, V, generator=g)
    # tree: two root children, each with two children, then one more root child (drawn last)
    parents = torch.tensor([[-1, -1, 0, 0, 1, -1][:n]] * B) if tree else chain_parents(n, B)
    if dense:
        q = draft_logits.softmax(-1)
        tokens = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, n)
    else:
        q = None
        tokens = torch.where(torch.rand(B, n, generator=g) < agree, logits[:, :-1].argmax(-1),
                             torch.randint(0, V, (B, n), generator=g))
    num_valid = torch.randint(0, n + 1, (B,), generator=g)
    num_valid[0] = n
    u = torch.rand(B, n, generator=g)
    noise = torch.empty(B, V).exponential_(generator=g)
    return logits, q, tokens, parents, num_valid, u, noise


def _same(a, b):
    assert torch.equal(a.tokens, b.tokens), (a.tokens, b.tokens)
    assert torch.equal(a.path, b.path) and torch.equal(a.num_accepted, b.num_accepted)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("dense", [False, True], ids=["deterministic", "dense_q"])
@pytest.mark.parametrize("mode", ["probs", "logits"])
def test_rejection_kernel_equals_reference(mode, dense, tree):
    for seed, agree in ((0, 0.0), (1, 3.0), (2, 30.0)):
        logits, q, tokens, parents, nv, u, noise = _draft(6, 6 if tree else 4, 37, dense, seed, tree, agree)
        temperature = torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0, 2.0])
        kw = dict(probs=logits.softmax(-1)) if mode == "probs" else dict(logits=logits, temperature=temperature)
        _same(*both(rejection_sample, tokens, parents, nv, u, noise, q, **kw))


def test_rejection_kernel_edge_cases():
    logits, q, tokens, parents, _, u, noise = _draft(3, 1, 19, True, 5)
    p = logits.softmax(-1)
    for nv in (torch.tensor([1, 0, 1]), torch.tensor([0, 0, 0])):  # k = 1, padding rows
        ref, ker = both(rejection_sample, tokens, parents, nv, u, noise, q, probs=p)
        _same(ref, ker)
        assert (ker.num_accepted <= nv).all()
    # all accepted: the draft is the target; none accepted: the draft has no target mass
    n, V = 5, 23
    target = torch.randn(2, n + 1, V).softmax(-1)
    toks = target[:, :-1].argmax(-1)
    ref, ker = both(rejection_sample, toks, chain_parents(n, 2), torch.full((2,), n), torch.rand(2, n),
                    torch.empty(2, V).exponential_(), target[:, :-1].clone(), probs=target)
    _same(ref, ker)
    assert ker.num_accepted.tolist() == [n, n]
    target[:, :, 0] = 0
    ref, ker = both(rejection_sample, torch.zeros_like(toks), chain_parents(n, 2), torch.full((2,), n),
                    torch.rand(2, n), torch.empty(2, V).exponential_(), None, probs=target / target.sum(-1, True))
    _same(ref, ker)
    assert ker.num_accepted.tolist() == [0, 0] and (ker.tokens[:, 0] != 0).all()


def test_rejection_kernel_logits_with_masked_blocks():
    """Logits at −inf (suppressed tokens), a whole interpreter block of them first: no NaN."""
    logits, q, tokens, parents, nv, u, noise = _draft(3, 3, 37, True, 11)
    logits[..., :20] = float("-inf")
    q = q.clone()
    q[..., :20] = 0
    q = q / q.sum(-1, keepdim=True)
    tokens = tokens.clamp(min=20)
    ref, ker = both(rejection_sample, tokens, parents, nv, u, noise, q, logits=logits,
                    temperature=torch.tensor([1.0, 0.0, 0.5]))
    _same(ref, ker)
    assert (ker.tokens.gather(1, ker.num_accepted.unsqueeze(1)) >= 20).all()


def test_rejection_kernel_clamps_token_ids():
    """An out-of-range draft id is read clamped, never out of bounds; every emitted id is in range."""
    logits, _, tokens, parents, nv, u, noise = _draft(2, 3, 11, False, 7, agree=30.0)
    tokens[0, 0], tokens[1, 0] = 10_000, -5
    ref, ker = both(rejection_sample, tokens, parents, nv, u, noise, None, probs=logits.softmax(-1))
    _same(ref, ker)
    emitted = ker.tokens[ker.tokens >= 0]
    assert (emitted < 11).all()


def test_exponential_race_samples_the_distribution():
    """The race picks i with probability r_i / Σr (χ² on the reference; the kernel equals it)."""
    from specdec.kernels.rejection import race
    from specdec.testing import chi_square

    r = torch.tensor([0.0, 3.0, 1.0, 0.5, 0.0, 2.5])
    g = torch.Generator().manual_seed(0)
    draws = race(r.expand(20000, -1), torch.empty(20000, 6).exponential_(generator=g))
    assert chi_square(torch.bincount(draws, minlength=6), r) > 1e-3


# --- memory ordering inside a program (what the interpreter alone cannot show) ---------------------
class _Poisoned:
    """``torch`` for a kernel module, whose ``empty`` fills what it allocates with NaN (floats) or
    -7 (integers): a kernel that reads memory before writing it gives different results."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -7)


@pytest.fixture
def poisoned(monkeypatch):
    """Every ``torch.empty`` of the Triton launchers returns poison."""
    import specdec.kernels.markov_triton as mk
    import specdec.kernels.rejection_triton as rk

    for module in (rk, mk):
        monkeypatch.setattr(module, "torch", _Poisoned())


def test_weak_memory_sees_a_store_read_back_without_a_barrier():
    """The emulation itself: a program that stores a block and reads one element of it back is a
    hazard (and reads the old value) unless a barrier separates them."""
    import triton
    import triton.language as tl

    from specdec.testing.triton_memory import weak_memory

    @triton.jit
    def store_then_read(buf_ptr, out_ptr, SYNC: tl.constexpr):
        offs = tl.arange(0, 8)
        tl.store(buf_ptr + offs, offs + 1.0)
        if SYNC:
            tl.debug_barrier()
        tl.store(out_ptr, tl.load(buf_ptr + 5))

    for sync, hazards, value in ((False, 1, 0.0), (True, 0, 6.0)):
        buf, out = torch.zeros(8), torch.zeros(1)
        with weak_memory() as log:
            store_then_read[(1,)](buf, out, SYNC=sync)
        assert len(log.hazards) == hazards and out.item() == value
        assert torch.equal(buf, torch.arange(1.0, 9.0))  # every store lands by the program's end


@pytest.mark.parametrize("mode", ["probs", "logits"])
@pytest.mark.parametrize("dense", [False, True], ids=["deterministic", "dense_q"])
def test_tree_kernel_reads_its_residual_only_after_a_barrier(poisoned, mode, dense):
    """A rejected node with a later sibling writes its residual to a scratch row; the sibling's
    p(x) is then one element of that row, stored by another thread on a GPU. Without a barrier
    between the two the read races (on an H200 two identical calls disagreed and a row the
    reference accepts two drafts for accepted none). Under :func:`weak_memory` a store is visible
    only after a barrier and the scratch starts as NaN, so the race is a wrong answer here."""
    from specdec.testing.triton_memory import weak_memory

    kit_tree = torch.tensor([-1, -1, 0, 1, 2, 3])  # the GPU kit's tree: two root children, two chains
    for seed, agree in ((0, 0.0), (1, 3.0), (2, 30.0)):
        logits, q, tokens, parents, nv, u, noise = _draft(6, 6, 37, dense, seed, True, agree)
        for par in (parents, kit_tree.expand(6, 6)):
            kw = (dict(probs=logits.softmax(-1)) if mode == "probs"
                  else dict(logits=logits, temperature=torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0, 2.0])))
            with use_backend("torch"):
                ref = rejection_sample(tokens, par, nv, u, noise, q, **kw)
            with use_backend("triton"), weak_memory() as log:
                ker = rejection_sample(tokens, par, nv, u, noise, q, **kw)
            assert not log.hazards, log.hazards[:3]
            _same(ref, ker)
    assert log.barriers > 0  # the residual was written (and synchronised) at least once


def test_markov_kernel_reads_q_back_only_after_a_barrier(poisoned):
    """The Markov sampler stores q, then reads it back for the inverse CDF: behind a barrier."""
    from specdec.testing.triton_memory import weak_memory

    g = torch.Generator().manual_seed(1)
    B, G, V, r = 3, 3, 29, 5
    U = torch.randn(B, G, V, generator=g) * 2
    W1, W2 = torch.randn(V, r, generator=g), torch.randn(V, r, generator=g) * 0.5
    x0, u = torch.randint(0, V, (B,), generator=g), torch.rand(B, G, generator=g, dtype=torch.float64)
    t = torch.tensor([1.0, 0.0, 0.8])
    with use_backend("torch"):
        ref, q_ref = markov_sample(U, x0, W1, W2, t, u)
    with use_backend("triton"), weak_memory() as log:
        ker, q_ker = markov_sample(U, x0, W1, W2, t, u)
    assert not log.hazards and log.barriers == B * G
    assert torch.equal(ref, ker)
    torch.testing.assert_close(q_ker, q_ref, atol=1e-6, rtol=1e-5)


def test_streaming_kernels_never_read_what_they_wrote():
    """The draft-input GEMM and the KV gather write only their outputs, never read back."""
    from specdec.testing.triton_memory import weak_memory

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 3, 24, generator=g), torch.randn(2, 3, 20, generator=g)
    W = torch.randn(37, 44, generator=g) * 0.1
    x, order = torch.randn(2, 3, 11, 10), torch.tensor([[0, 3, 4, 9, 10, 1, 2], [5, 6, 7, 8, 0, 0, 0]])
    with use_backend("triton"), weak_memory() as log:
        y = norm_concat_linear([a, b], [torch.ones(24), None], W, 1e-6, None)
        kv = gather_slots(x, order)
    assert not log.hazards
    with use_backend("torch"):
        torch.testing.assert_close(y, norm_concat_linear([a, b], [torch.ones(24), None], W, 1e-6, None))
        assert torch.equal(kv, gather_slots(x, order))


# --- fused draft input ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_norm_concat_linear_kernel_matches_reference(dtype, tol):
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(2, 3, d, generator=g).to(dtype) for d in (24, 20, 9))
    wa, wb = torch.randn(24, generator=g).to(dtype), torch.randn(20, generator=g).to(dtype)
    W = (torch.randn(37, 53, generator=g) * 0.1).to(dtype)
    bias = torch.randn(37, generator=g).to(dtype)
    cases = [([a, b], [wa, wb], W[:, :44], None),  # MTP's eh_proj
             ([a, b, c], [None, None, None], W, bias),  # EAGLE-3's fc: no norms
             ([a, b], [wa, None], W[:, :44], None)]
    for xs, nws, w, bb in cases:
        ref, ker = both(norm_concat_linear, xs, nws, w, 1e-6, bb)
        assert ker.shape == ref.shape == (2, 3, 37) and ker.dtype == ref.dtype
        torch.testing.assert_close(ker.float(), ref.float(), atol=tol, rtol=tol)


def test_mtp_draft_input_is_the_fused_function():
    """The MTP module's draft input equals eh_proj(cat[enorm, hnorm]), through either path."""
    from specdec.drafters.mtp.drafter import build_mtp_modules
    from specdec.target import Target
    from specdec.testing.tiny import tiny_model

    module = build_mtp_modules(Target(tiny_model("deepseek_v3", vocab_size=48, seed=3)), 1)[0]
    e, h = torch.randn(2, 3, module.eh_proj.in_features // 2), torch.randn(2, 3, module.eh_proj.in_features // 2)
    expected = module.eh_proj(torch.cat([module.enorm(e), module.hnorm(h)], -1))
    ref, ker = both(module.draft_input, e, h)
    assert torch.equal(ref, expected)
    torch.testing.assert_close(ker, expected, atol=1e-4, rtol=1e-4)


# --- DSpark's Markov sampler -------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0, "mixed"])
def test_markov_kernel_matches_reference(temperature):
    g = torch.Generator().manual_seed(1)
    B, G, V, r = 3, 4, 29, 5
    U = torch.randn(B, G, V, generator=g) * 2
    W1, W2 = torch.randn(V, r, generator=g), torch.randn(V, r, generator=g) * 0.5
    x0, u = torch.randint(0, V, (B,), generator=g), torch.rand(B, G, generator=g, dtype=torch.float64)
    t = torch.tensor([1.0, 0.0, 0.8]) if temperature == "mixed" else temperature
    (ref, q_ref), (ker, q_ker) = both(markov_sample, U, x0, W1, W2, t, u)
    assert torch.equal(ref, ker) and ((ker >= 0) & (ker < V)).all()
    if temperature == 0.0:
        assert q_ref is None and q_ker is None
    else:
        torch.testing.assert_close(q_ker, q_ref, atol=1e-6, rtol=1e-5)
        assert torch.equal(q_ker.gather(2, ker.unsqueeze(2)) > 0, torch.ones(B, G, 1, dtype=torch.bool))


@pytest.mark.parametrize("arch", ["cuda", "gfx942"])
def test_markov_configs_keep_the_bias_tile_small(arch):
    """The Markov sampler's autotune configs: narrow blocks, pruned per rank to a [BLOCK, next_pow2(R)]
    tile of at most 16K elements (the narrowest when none fits), the AMD knobs kept on ROCm."""
    from specdec.kernels.tuning import MARKOV_TILE, fits_markov_tile, markov_configs

    configs = markov_configs(arch)
    assert {c.kwargs["BLOCK"] for c in configs} <= {128, 256, 512}
    assert all(("waves_per_eu" in c.kwargs) == arch.startswith("gfx") for c in configs)
    assert fits_markov_tile(configs, {"R": 5}) == configs  # rank 5 → 8 columns: every block fits
    at_64 = fits_markov_tile(configs, {"R": 64})
    assert at_64 and all(c.kwargs["BLOCK"] * 64 <= MARKOV_TILE for c in at_64)
    assert [c.kwargs["BLOCK"] for c in fits_markov_tile(configs, {"R": 1000})] == [128]


def test_norm_concat_linear_tunes_per_bucket_of_rows():
    """The GEMM's autotune key stands for M by a bounded set of powers of two."""
    from specdec.kernels.norm_concat_linear_triton import m_bucket

    assert [m_bucket(m) for m in (1, 2, 3, 5, 8, 9, 200, 256, 257, 5000)] == [1, 2, 4, 8, 8, 16, 256, 256, 256, 256]


# --- KV compaction -----------------------------------------------------------------------------
def test_gather_slots_kernel_equals_reference():
    x = torch.randn(2, 3, 11, 12)[..., :10]  # a strided view, as cache layers can be
    order = torch.tensor([[0, 3, 4, 9, 10, 1, 2], [5, 6, 7, 8, 0, 0, 0]])
    ref, ker = both(gather_slots, x, order)
    assert torch.equal(ref, ker)


# --- which path auto takes on a GPU: measured per device and shape ------------------------------------
from specdec.kernels import choice  # noqa: E402


@pytest.fixture
def as_on_a_gpu(monkeypatch, tmp_path):
    """``auto`` as on a GPU (the device rule stubbed: the Triton path runs in the interpreter), an
    empty choice cache, no choice made yet in this process."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    import specdec.kernels.dispatch as dispatch

    monkeypatch.setattr(dispatch, "on_gpu_device", lambda *tensors: True)
    choice.forget()
    yield tmp_path / "kernels"
    choice.forget()


def _timings(monkeypatch, triton_s: float, torch_s: float) -> list[str]:
    """Stub the measurement: each path takes the given seconds; returns the paths timed, in order."""
    timed: list[str] = []

    def seconds(path, fn, device):
        timed.append(path)
        return {"triton": triton_s, "torch": torch_s}[path]

    monkeypatch.setattr(choice, "seconds", seconds)
    return timed


def _ran(monkeypatch) -> list[str]:
    """Which path each gather_slots call ran."""
    import specdec.kernels.compaction as compaction
    import specdec.kernels.compaction_triton as compaction_triton

    ran: list[str] = []
    ref, fused = compaction.gather_slots_reference, compaction_triton.gather_slots_triton
    monkeypatch.setattr(compaction, "gather_slots_reference", lambda *a: ran.append("torch") or ref(*a))
    monkeypatch.setattr(compaction_triton, "gather_slots_triton", lambda *a: ran.append("triton") or fused(*a))
    return ran


@pytest.mark.parametrize("faster", ["triton", "torch"])
def test_auto_takes_the_path_measured_faster(as_on_a_gpu, monkeypatch, faster):
    timed = _timings(monkeypatch, *((1e-3, 2e-3) if faster == "triton" else (2e-3, 1e-3)))
    ran = _ran(monkeypatch)
    x, order = torch.randn(3, 2, 9, 4), torch.randint(0, 9, (3, 5))
    out = gather_slots(x, order)
    assert timed == ["triton", "torch"] and ran == [faster]  # measured once, then only the winner runs
    assert choice.last("gather_slots") == (faster, "measured")
    assert torch.equal(out, torch.gather(x, 2, order[:, None, :, None].expand(-1, 2, -1, 4)))
    gather_slots(x[:2], order[:2])  # another row count, the same bucket (B = 2 → 2, 3 → 4): no new bucket
    gather_slots(x[:1], order[:1])  # B = 1: a bucket of its own, measured
    assert timed == ["triton", "torch"] * 3 and ran == [faster] * 3
    rec = choice.record()
    assert [(r["kernel"], r["shape"]["B"], r["backend"], r["source"]) for r in rec] == [
        ("gather_slots", 1, faster, "measured"), ("gather_slots", 2, faster, "measured"),
        ("gather_slots", 4, faster, "measured")]
    assert rec[0]["shape"] == {"B": 1, "H": 2, "S": 8, "D": 4, "dtype": "float32"}
    assert {r["triton_ms"] for r in rec} == {1.0 if faster == "triton" else 2.0}


def test_a_choice_is_cached_on_disk_per_device_and_shape(as_on_a_gpu, monkeypatch):
    timed = _timings(monkeypatch, 2e-3, 1e-3)
    x, order = torch.randn(2, 2, 9, 4), torch.randint(0, 9, (2, 5))
    gather_slots(x, order)
    files = sorted(as_on_a_gpu.glob("*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    key = choice.choice_key("gather_slots", {"B": 2, "H": 2, "S": 8, "D": 4, "dtype": "float32"}, x.device)
    assert saved["key"] == key and saved["backend"] == "torch" and saved["torch_ms"] == 1.0
    assert set(key) == {"device", "torch", "triton", "kernel", "shape"} and key["device"] == {"name": "cpu", "arch": "cpu"}
    choice.forget()  # a new process on the same machine: read, not measured
    ran = _ran(monkeypatch)
    gather_slots(x, order)
    assert timed == ["triton", "torch"] and ran == ["torch"] and choice.last("gather_slots") == ("torch", "cached")
    assert choice.record()[0]["source"] == "cached"
    # another torch (or GPU, or triton) is another key: measured again
    saved["key"]["torch"] = "0.0"
    files[0].write_text(json.dumps(saved))
    choice.forget()
    gather_slots(x, order)
    assert timed == ["triton", "torch"] * 2 and choice.last("gather_slots") == ("torch", "measured")


def test_a_forced_backend_is_obeyed_and_never_measured(as_on_a_gpu, monkeypatch):
    timed = _timings(monkeypatch, 1e-3, 2e-3)
    ran = _ran(monkeypatch)
    for forced in ("torch", "triton"):
        with use_backend(forced):
            gather_slots(torch.randn(1, 1, 4, 2), torch.tensor([[1, 0]]))
        assert choice.last("gather_slots") == (forced, "forced")
    assert timed == [] and ran == ["torch", "triton"] and choice.record() == []


def test_every_kernel_names_its_bucket(as_on_a_gpu, monkeypatch):
    """Each public kernel goes through the measured choice, with the shape its cost depends on."""
    _timings(monkeypatch, 2e-3, 1e-3)  # the reference wins: fast on CPU
    logits, q, tokens, parents, nv, u, noise = _draft(3, 5, 37, True, 0)
    rejection_sample(tokens, parents, nv, u, noise, q, probs=logits.softmax(-1))
    markov_sample(torch.randn(3, 2, 29), torch.tensor([1, 2, 3]), torch.randn(29, 5), torch.randn(29, 5), 1.0,
                  torch.rand(3, 2, dtype=torch.float64))
    norm_concat_linear([torch.randn(3, 24), torch.randn(3, 20)], [torch.ones(24), None], torch.randn(37, 44))
    shapes = {r["kernel"]: r["shape"] for r in choice.record()}
    assert shapes == {
        "rejection": {"B": 4, "n": 8, "V": 37, "scores": "probs", "q": True, "noise": True},
        "markov": {"B": 4, "G": 2, "V": 29, "R": 5},
        "norm_concat_linear": {"M": 4, "widths": [24, 20], "N": 37, "norms": [True, False], "bias": False,
                               "dtype": "float32"}}


def test_the_generation_summary_records_each_kernel_path(as_on_a_gpu, monkeypatch, target):
    _timings(monkeypatch, 2e-3, 1e-3)
    res = specdec.generate(target, [[1, 2, 3]], RandomDrafter.create(target, siblings="iid"), k=3,
                           max_new_tokens=4, sampling=SamplingParams(temperature=1.0, seed=0))
    kernels = res.summary.kernels
    assert kernels and {(c["kernel"], c["backend"], c["source"]) for c in kernels} == {("rejection", "torch", "measured")}
    assert "kernels: rejection torch" in str(res.summary)
    assert json.loads(res.summary.to_json())["kernels"] == kernels
    choice.forget()
    with use_backend("torch"):  # nothing chosen: nothing recorded
        assert specdec.generate(target, [[1, 2, 3]], None, max_new_tokens=2).summary.kernels is None


# --- the conformance suite through the kernels ----------------------------------------------------
import specdec.testing.conformance as conformance  # noqa: E402


@pytest.fixture
def kernels_on():
    with use_backend("triton"):
        yield


DRAFTERS = {
    "draft_model": lambda t: specdec.drafters.DRAFTERS["draft_model"].tiny(t),
    "random[chain,iid]": lambda t: RandomDrafter.create(t, siblings="iid"),
    "random[tree,iid]": lambda t: RandomDrafter.create(t, siblings="iid", branching=[2, 2]),
    "random[tree,deterministic]": lambda t: RandomDrafter.create(t, siblings="deterministic", branching=[2, 2]),
}


@pytest.mark.parametrize("verifier", [GreedyVerifier, RejectionVerifier], ids=["greedy", "rejection"])
@pytest.mark.parametrize("case", ["draft_model", "random[tree,deterministic]"])
def test_greedy_equivalence_through_kernels(kernels_on, target, case, verifier):
    drafter = DRAFTERS[case](target)
    prompts, n = [[1, 2, 3, 4], [7, 7]], 8
    res = run(target, drafter, verifier(), [Request(p, n) for p in prompts], k=3, eos_token_ids=set())
    for p, r in zip(prompts, res.requests):
        ref, logits = greedy_reference(target.model, p, n)
        assert_greedy_equivalent(r.tokens, ref, logits)


@pytest.mark.parametrize("case,sampling,verifier", [
    ("random[chain,iid]", SamplingParams(temperature=1.0), RejectionVerifier(in_kernel_temperature=True)),
    ("random[tree,iid]", SamplingParams(temperature=0.7, top_k=5), RejectionVerifier()),
], ids=["chain-t1-in_kernel_temperature", "tree-t0.7-topk5-warped_probs"])
@pytest.mark.slow  # the interpreter runs one program per row: the longest tests of the suite
def test_sampled_matches_target_distribution_through_kernels(kernels_on, target, case, sampling, verifier):
    """Small samples (the interpreter runs one program per row): weak power, but any systematic
    error of the kernel path (a wrong residual, an off-by-one race) fails at these sizes."""
    r = sampled_gof(target, DRAFTERS[case](target), verifier, conformance.PROMPT, sampling, n_samples=400,
                    positions=2, min_group=100, batch=400)
    assert r.pvalues, "no conditional test: the test would prove nothing"
    worst = min(zip(r.pvalues, r.tests))
    assert worst[0] > conformance.ALPHA / (len(r.pvalues) * 2), f"not the target's distribution: {worst}"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_do_not_depend_on_their_batch_through_kernels(kernels_on, target, temperature):
    case = ("random[tree,iid]", DRAFTERS["random[tree,iid]"](target))
    conformance.test_rows_do_not_depend_on_their_batch(case, target, temperature, "rejection")


def test_edge_cases_through_kernels(kernels_on, target):
    conformance.test_all_accepted_and_none_accepted(target)
    conformance.test_num_valid_shorter_than_n(target)
    conformance.test_k_equals_one(("draft_model", DRAFTERS["draft_model"](target)), target)


def test_kv_compaction_through_kernels(kernels_on, target, monkeypatch):
    """Trees compact the cache through the gather kernel; decoding stays the target's greedy."""
    monkeypatch.setattr(KVStore, "compact_at", 0.0)  # compact whenever there are holes
    drafter = DRAFTERS["random[tree,deterministic]"](target)
    res = run(target, drafter, GreedyVerifier(), [Request([3, 1, 4], 10), Request([2, 7], 10)], k=3,
              eos_token_ids=set())
    for p, r in zip([[3, 1, 4], [2, 7]], res.requests):
        ref, logits = greedy_reference(target.model, p, 10)
        assert_greedy_equivalent(r.tokens, ref, logits)


# --- the benchmark script -------------------------------------------------------------------------
def test_benchmark_smoke_runs(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), "--config-name", "lab/kernels",
                          "smoke=true", f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "| B |" in out.stdout and "backend" in out.stdout


@pytest.mark.slow
def test_kernels_compile_for_mi300x_without_a_gpu(tmp_path):
    """Triton compiles ahead of time for a named target: every kernel type-checks, lowers and
    assembles for gfx942 with its AMD tuning knobs (the interpreter alone would not catch a
    kernel that only fails to compile). ``experiments/run.py --config-name lab/compile_kernels`` does all targets."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), "--config-name", "lab/compile_kernels",
                          "quick=true", "targets=[gfx942]", f"hydra.run.dir={tmp_path}"],
                         env={**env, "TRITON_DEFAULT_FP_FUSION": "1"}, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "all compiled" in out.stdout, out.stdout + out.stderr[-3000:]


@pytest.mark.slow
def test_the_barriers_survive_compilation_for_sm_90():
    """The tree kernel's barrier (after its residual is written) and the Markov sampler's (before q is
    read back) are in the code compiled for an H200: one ``ttg.barrier`` each after Triton's passes
    (the reductions' own barriers come later, in the lowering to LLVM)."""
    code = ("import sys; sys.path.insert(0, '.')\n"
            "from benchmarks.compile_kernels import kernels, compile_one, TARGETS\n"
            "for name, fn, types, consts, configs in kernels('cuda', True):\n"
            "    if name in ('rejection', 'markov'):\n"
            "        b = compile_one(fn, types, consts, configs[0], TARGETS['cuda'])\n"
            "        print(name, b.asm['ttgir'].count('ttg.barrier'), 'bar.sync' in b.asm['ptx'])\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT / "experiments", capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["rejection 1 True", "markov 1 True"], out.stdout

"""DSpark: the Markov sampler's exact q (every head), the confidence head and its calibration, the
prefix scheduler (bounds, budget, batch-aware trade-off, losslessness), the DeepSpec layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from specdec.drafters.dflash.checkpoint import load_block_draft, save_block_draft
from specdec.drafters.dspark.drafter import DSparkDrafter
from specdec.drafters.dspark.heads import MarkovHead, calibrate_temperatures, expected_calibration_error
from specdec.drafters.dspark.model import DSparkModel
from specdec.kernels.markov import markov_chain, markov_sample_reference
from specdec.loop import Request, run
from specdec.sampling import RowSampling, SamplingParams, sample_from, warp
from specdec.policy import StepCosts, best_throughput, profile_step_costs, schedule
from specdec.testing import assert_greedy_equivalent, greedy_reference
from specdec.types import Committed
from specdec.verifiers import GreedyVerifier

V = 32


def _warp(t: float = 0.8, k: int = 0, p: float = 0.9, B: int = 3):
    temp, top_k, top_p = torch.full((B,), t), torch.full((B,), k), torch.full((B,), p)
    return lambda logits: warp(logits, temp, top_k, top_p)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_markov_q_is_exactly_what_each_token_was_drawn_from(kind):
    torch.manual_seed(0)
    B, gamma, d, r = 3, 5, 16, 4
    head = MarkovHead(V, r, d, kind)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=1.0)
    base, hidden = torch.randn(B, gamma, V) * 2, torch.randn(B, gamma, d)
    anchors, u = torch.randint(0, V, (B,)), torch.rand(B, gamma, dtype=torch.float64)
    probs = _warp()
    with torch.no_grad():
        tokens, q = markov_chain(base, anchors, head.sampler_bias(hidden), probs, u)
        prev = torch.cat([anchors[:, None], tokens[:, :-1]], 1)
        expect = torch.stack([probs(x) for x in (base + head.block_bias(prev, hidden)).unbind(1)], 1)
    torch.testing.assert_close(q, expect)  # teacher-forced on the drawn tokens: the same distributions
    for k in range(gamma):
        assert torch.equal(tokens[:, k], sample_from(q[:, k], u[:, k]))
        assert bool((q[:, k].gather(1, tokens[:, k:k + 1]) > 0).all())


@pytest.mark.parametrize("temperature", [[0.7, 1.0, 1.3], [0.0, 0.0, 0.0]])
def test_the_vanilla_head_samples_as_the_kernels_reference(temperature):
    """The fused kernel's specification (raw weights, temperature-only warp) is what the drafter's
    vanilla head draws, greedy included (argmax, no q)."""
    torch.manual_seed(2)
    head = MarkovHead(V, 6, 8, "vanilla")
    base, anchors = torch.randn(3, 4, V) * 2, torch.randint(0, V, (3,))
    u = torch.rand(3, 4, dtype=torch.float64)
    temp = torch.tensor(temperature)
    greedy = not bool(temp.any())
    probs = None if greedy else (lambda x: warp(x, temp, torch.zeros(3, dtype=torch.long), torch.ones(3)))
    with torch.no_grad():
        ours = markov_chain(base, anchors, head.sampler_bias(None), probs, u)
        theirs = markov_sample_reference(base, anchors, head.markov_w1.weight, head.markov_w2.weight, temp, u)
    assert torch.equal(ours[0], theirs[0])
    if greedy:
        assert ours[1] is None and theirs[1] is None
    else:
        torch.testing.assert_close(ours[1], theirs[1])


def test_markov_bias_depends_on_the_previous_token_not_the_position():
    head = MarkovHead(V, 4, 8, "vanilla")
    prev = torch.tensor([[3, 3, 5]])
    bias = head.block_bias(prev, None)
    torch.testing.assert_close(bias[0, 0], bias[0, 1])
    assert not torch.allclose(bias[0, 0], bias[0, 2])


def test_confidences_are_probabilities_and_temperatures_apply(target):
    d = DSparkDrafter.tiny(target)
    rows = RowSampling([SamplingParams(temperature=1.0, seed=3)])
    state = _start(target, d, [1, 2, 3, 4, 5], rows)
    c = d.propose(state, 4, rows).confidence  # reported on every proposal, for a draft-length policy
    assert c.shape == (1, 4) and bool(((c > 0) & (c < 1)).all())
    hidden = d.block_hidden(state, 4)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    plain = d.confidences(hidden, state.anchors, tokens)
    d.cfg.confidence_temperatures = [0.01] * 4  # sharpened: pushed to 0 or 1
    sharp = d.confidences(hidden, state.anchors, tokens)
    assert bool(((sharp - 0.5).abs() >= (plain - 0.5).abs() - 1e-6).all())


def _start(target, drafter, prompt, rows):
    from specdec.types import Committed

    session = target.new_session(1)
    with target.capturing(drafter.requirements()):
        out, padded, lengths = target.prefill(session, [prompt])
    c = Committed(tokens=padded, num_tokens=lengths, positions=torch.arange(len(prompt))[None],
                  next_tokens=out.logits[:, -1].argmax(-1), active=torch.ones(1, dtype=torch.bool), hidden=out.hidden)
    return drafter.start(c, rows)


def test_sequential_temperature_scaling_recovers_an_overconfident_head():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(4000, 3, generator=gen) * 3
    truth = torch.sigmoid(z / 2.5)  # the head is overconfident by a factor 2.5
    outcome = torch.bernoulli(truth, generator=gen)
    temps = calibrate_temperatures(z, outcome)
    assert all(1.8 < t < 3.5 for t in temps[:2]), temps
    surv = outcome.cumprod(-1)
    before = expected_calibration_error(torch.sigmoid(z).cumprod(-1)[:, 1], surv[:, 1])
    after = expected_calibration_error(torch.sigmoid(z / torch.tensor(temps)).cumprod(-1)[:, 1], surv[:, 1])
    assert after < before


def _linear_costs(per_token: float = 1.0, fixed: float = 4.0, draft: float = 0.5) -> StepCosts:
    return StepCosts.linear(per_token, fixed, draft)


def test_linear_costs_extrapolate():
    c = StepCosts.linear(per_token=0.5, fixed=4.0, draft=0.25)
    assert c.verify(1) == pytest.approx(4.5) and c.verify(1000) == pytest.approx(504.0)
    assert c.draft(1) == c.draft(4000) == pytest.approx(0.25)


def test_schedule_bounds_budget_and_prefixes():
    gen = torch.Generator().manual_seed(0)
    conf = torch.rand(6, 5, generator=gen)
    for budget in (None, 0, 3, 7):
        n = schedule(conf, _linear_costs(per_token=0.05), budget)
        assert bool(((n >= 0) & (n <= 5)).all())
        if budget is not None:
            assert int(n.sum()) <= budget
    assert schedule(torch.ones(2, 4), _linear_costs(per_token=0.0)).tolist() == [4, 4]  # free tokens: all
    assert schedule(torch.zeros(2, 4), _linear_costs()).tolist() == [0, 0]  # hopeless drafts: none


def test_schedule_moves_drafts_to_the_more_confident_request():
    conf = torch.tensor([[0.95] * 6, [0.3] * 6])
    n = schedule(conf, _linear_costs(per_token=1.0, fixed=8.0), ragged=True)
    assert n[0] > n[1]
    n_budget = schedule(conf, _linear_costs(per_token=0.0), budget=4, ragged=True)
    assert n_budget.tolist() == [4, 0]


def test_best_throughput_prefers_autoregressive_when_drafting_costs_too_much():
    conf = torch.full((4, 4), 0.2)
    spec, ar = best_throughput(conf, _linear_costs(per_token=1.0, fixed=1.0, draft=50.0))
    assert spec < ar


def test_profiled_costs_are_cached(tmp_path):
    calls = []

    def verify(r, w):
        calls.append((r, w))
        return 0.001 * r * w

    path = tmp_path / "costs.json"
    a = profile_step_costs(verify, lambda r: 0.01 * r, rows=(1, 2), widths=(1, 3), repeats=1, cache=path)
    n = len(calls)
    b = profile_step_costs(verify, lambda r: 0.01 * r, rows=(1, 2), widths=(1, 3), repeats=1, cache=path)
    assert len(calls) == n and a == b and a.verify(6) == pytest.approx(0.006)
    with pytest.raises(ValueError, match="ascending"):
        StepCosts([4, 1], [0.1, 0.2], [1], [0.1])


@pytest.mark.parametrize("costs", ["linear", "never_draft"])
def test_scheduler_is_lossless_greedy(target, costs):
    table = _linear_costs(per_token=0.1) if costs == "linear" else _linear_costs(per_token=1.0, draft=1e3)
    d = DSparkDrafter.tiny(target, scheduler=True, costs=table)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    res = run(target, d, GreedyVerifier(), [Request(p, 12) for p in prompts], k=4, eos_token_ids=set())
    for p, r in zip(prompts, res.requests):
        ref, logits = greedy_reference(target.model, p, 12)
        assert_greedy_equivalent(r.tokens, ref, logits)
    if costs == "never_draft":  # skipped most steps: few drafts were even proposed
        assert sum(r.metrics.drafted for r in res.requests) < sum(r.metrics.steps for r in res.requests) * 4


def test_reads_and_writes_the_deepspec_layout(target, tmp_path):
    for kind in ("vanilla", "gated", "rnn"):
        d = DSparkDrafter.tiny(target, markov_head_type=kind, confidence_temperatures=[1.5, 1.0])
        folder = save_block_draft(d.model, tmp_path / kind, dtype=torch.float32)
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_head_type"] == kind
        loaded = load_block_draft(folder)
        assert isinstance(loaded, DSparkModel) and loaded.cfg.confidence_temperatures == [1.5, 1.0]
        for k, v in d.model.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[k], v)
    names = set(loaded.state_dict())
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "markov_head.joint_proj.weight"} <= names


def test_bad_inputs_raise(target):
    from specdec.drafters.dflash.drafter import DFlashDrafter

    with pytest.raises(ValueError, match="anchor"):
        DSparkDrafter(DFlashDrafter.tiny(target).model)
    with pytest.raises(ValueError, match="confidence head"):
        DSparkDrafter.tiny(target, enable_confidence_head=False, scheduler=True, costs=_linear_costs())
    with pytest.raises(ValueError, match="markov"):
        MarkovHead(V, 4, 8, "lstm")


def test_scheduler_is_lossless_sampled(target, monkeypatch):
    """χ² of sampled output with the prefix scheduler on: it only shortens what is verified, so the
    output must still be distributed as the target's; here the shared budget also shortens drafts
    (the conformance suite's scheduled cases check that some draft is verified)."""
    from specdec.policy import PrefixPolicy
    from specdec.testing import sampled_gof
    from specdec.verifiers import RejectionVerifier

    chosen: list[torch.Tensor] = []
    choose = PrefixPolicy.choose

    def recording_choose(self, *args, **kwargs):
        n = choose(self, *args, **kwargs)
        chosen.append(n.clone())
        return n

    monkeypatch.setattr(PrefixPolicy, "choose", recording_choose)
    # verifying is nearly free, so the schedule admits by confidence until the shared budget runs out
    d = DSparkDrafter.tiny(target, scheduler=True, costs=_linear_costs(per_token=1e-5, fixed=1.0, draft=0.05),
                           budget=1800, ragged=True)
    r = sampled_gof(target, d, RejectionVerifier(), [1, 2, 3, 4], SamplingParams(temperature=1.0), n_samples=3000, k=4)
    lengths = torch.cat(chosen)
    assert bool((lengths < 4).any() & (lengths > 0).any()), f"the schedule never shortened a draft: {lengths.unique()}"
    assert len(r.pvalues) >= 3, "too few conditional tests: the check would prove nothing"
    worst = min(zip(r.pvalues, r.tests))
    assert worst[0] > 1e-3 / len(r.pvalues), f"not distributed as the target's: {worst[1]} p={worst[0]:.2e}"


def test_reads_and_writes_the_speculators_dspark_layout(target, tmp_path):
    """speculators' DSparkSpeculatorConfig names: head fields at top level, hidden_states ids; our
    export in that layout loads back and drafts identically; a file built by hand with those names
    (and speculators' extra tensors) loads too."""
    d = DSparkDrafter.tiny(target, markov_head_type="gated", confidence_temperatures=[1.5, 1.0])
    cfg = d.cfg
    folder = save_block_draft(d.model, tmp_path / "ours", dtype=torch.float32, layout="speculators", verifier="tiny")
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["architectures"] == ["DSparkDraftModel"]
    assert config["markov_rank"] == cfg.markov_rank and config["markov_head_type"] == "gated"
    assert config["enable_confidence_head"] and config["confidence_head_with_markov"] and config["sample_from_anchor"]
    assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in cfg.target_layer_ids]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == cfg.block_size
    again = DSparkDrafter.create(target, checkpoint=str(folder))
    assert again.cfg == cfg
    with torch.no_grad():
        hs = target.model(torch.tensor([[1, 2, 3, 4]]), output_hidden_states=True).hidden_states
    prefill = Committed(tokens=torch.tensor([[1, 2, 3, 4]]), num_tokens=torch.tensor([4]),
                        positions=torch.arange(4)[None], next_tokens=torch.tensor([6]),
                        active=torch.ones(1, dtype=torch.bool), hidden={i: hs[i] for i in d.hidden_ids})
    props = []
    for drafter in (d, again):
        rows = RowSampling([SamplingParams(temperature=1.0, seed=0)])  # a fresh generator per drafter
        props.append(drafter.propose(drafter.start(prefill, rows), 3, rows))
    torch.testing.assert_close(props[0].tokens, props[1].tokens)
    torch.testing.assert_close(props[0].q, props[1].q)
    # by hand, with speculators' own names and tensors (embedding, LM head, verifier norm: skipped)
    hand = tmp_path / "hand"
    hand.mkdir()
    t = config["transformer_layer_config"]
    (hand / "config.json").write_text(json.dumps({
        "speculators_model_type": "dspark", "transformer_layer_config": t, "draft_vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size, "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id, "markov_rank": cfg.markov_rank, "markov_head_type": "gated"}))
    state = {k: v.contiguous() for k, v in d.model.state_dict().items()}
    state |= {"lm_head.weight": torch.zeros(cfg.vocab_size, cfg.hidden_size),
              "verifier_norm.weight": torch.ones(cfg.hidden_size)}
    save_file(state, str(hand / "model.safetensors"))
    loaded = load_block_draft(hand)  # absent head flags: speculators' defaults (both heads on)
    assert isinstance(loaded, DSparkModel) and loaded.cfg.enable_confidence_head and loaded.cfg.markov_rank == 4
    for k, v in d.model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)

"""The hybrid drafter: its choice rules on planted evidence, the merge of rows that chose different
parts, sampled output under every lossless verifier with both rules, and its options.

The conformance suite (tests/test_conformance.py, case ``hybrid[tiny]``) proves the default rule
lossless; here are the parts it cannot see."""

from __future__ import annotations

import pytest
import torch

from specdec import make_drafter
from specdec.drafters.hybrid.drafter import (LEARNED, MODEL_FREE, HybridDrafter, _Draft, calibrated, choose,
                                             expected_length, walk)
from specdec.loop import Request, run
from specdec.registry import verifier_class
from specdec.sampling import SamplingParams
from specdec.target import Target
from specdec.testing.conformance import ALPHA, SAMPLED_VERIFIERS
from specdec.testing.tiny import tiny_model
from specdec.testing.tools import sampled_gof
from specdec.verifiers import GreedyVerifier


@pytest.fixture(scope="module")
def target() -> Target:
    return Target(tiny_model("llama", vocab_size=32, init_scale=0.3, seed=0))


def chain(tokens: list[int], conf: list[float]) -> _Draft:
    return _Draft(tokens, [i - 1 for i in range(len(tokens))], conf)


# --- the evidence -------------------------------------------------------------------------------
def test_expected_length_sums_path_probabilities_over_a_tree_and_a_window():
    tree = _Draft([5, 6, 7, 8], [-1, -1, 0, 2], [0.6, 0.3, 0.5, 0.5])  # two roots; 7 under 5, 8 under 7
    assert expected_length(tree) == pytest.approx(0.6 + 0.3 + 0.3 + 0.15)
    assert expected_length(tree, window=1) == pytest.approx(0.9)
    assert expected_length(None) == 0.0


def test_walk_follows_the_emitted_tokens_down_the_tree_and_stops_at_the_first_miss():
    tree = _Draft([5, 6, 7, 8], [-1, -1, 0, 2], [1, 1, 1, 1])
    assert walk(tree, [5, 7, 8, 9]) == 3
    assert walk(tree, [6, 7]) == 1  # 7 is a child of 5, not of 6
    assert walk(tree, [5, 7]) == 2  # censored at the emitted length
    assert walk(tree, [9]) == 0


# --- the rules ----------------------------------------------------------------------------------
def test_expected_picks_per_row_the_part_with_the_higher_expected_length():
    none = [0.0, 0.0]
    strong_mf, weak_mf = chain([1, 2, 3], [0.9, 0.9, 0.9]), chain([1], [0.2])
    strong_l, weak_l = chain([4, 5], [0.9, 0.8]), chain([4, 5], [0.1, 0.1])
    assert choose("expected", [strong_mf, weak_l], none, none, 2.0) == MODEL_FREE
    assert choose("expected", [weak_mf, strong_l], none, none, 2.0) == LEARNED
    assert choose("expected", [chain([], []), weak_l], none, none, 2.0) == LEARNED  # no model-free draft
    assert choose("expected", [strong_mf, None], none, none, 2.0) == MODEL_FREE  # the learned part sat out
    tie = chain([1, 2], [0.5, 0.5])
    assert choose("expected", [tie, chain([4, 5], [0.5, 0.5])], none, none, 2.0) == MODEL_FREE


def test_expected_calibrates_each_part_on_the_rows_history():
    """The same drafts flip the choice when the row's history says the learned part is
    underconfident (it was accepted far more often than its confidences said) or the model-free
    part overconfident."""
    mf, learned = chain([1, 2], [0.8, 0.8]), chain([4, 5], [0.5, 0.5])
    assert choose("expected", [mf, learned], [0.0, 0.0], [0.0, 0.0], 2.0) == MODEL_FREE
    assert choose("expected", [mf, learned], [10.0, 10.0], [10.0, 30.0], 2.0) == LEARNED  # learned: 3x its word
    assert choose("expected", [mf, learned], [20.0, 10.0], [2.0, 10.0], 2.0) == LEARNED  # model-free: 1/10 of it


def test_ngram_first_takes_the_model_free_draft_whenever_there_is_one():
    weak_mf, strong_l = chain([1], [0.01]), chain([4, 5], [1.0, 1.0])
    assert choose("ngram_first", [weak_mf, strong_l], [0.0, 10.0], [0.0, 10.0], 2.0) == MODEL_FREE
    assert choose("ngram_first", [chain([], []), strong_l], [0.0, 0.0], [0.0, 0.0], 2.0) == LEARNED


# --- the merge, in the loop ---------------------------------------------------------------------
class Recorded(HybridDrafter):
    """A hybrid that records, per step, both parts' proposals, its choice and its merged proposal."""

    def start(self, prefill, rows):
        self.steps, self.learned_calls = [], 0
        if not hasattr(self, "_last"):
            self._wrap()
        return super().start(prefill, rows)

    def _wrap(self):
        inner = [part.propose for part in self.parts]

        def wrap(i):
            def propose(state, k, rows):
                p = inner[i](state, k, rows)
                self._last[i] = p
                if i == LEARNED:
                    self.learned_calls += 1
                return p
            return propose

        self._last = [None, None]
        for i, part in enumerate(self.parts):
            part.propose = wrap(i)

    def propose(self, state, k, rows):
        self._last = [None, None]
        merged = super().propose(state, k, rows)
        self.steps.append((list(self._last), list(state.chosen), merged))
        return merged


REPEATING, FRESH = [3, 1, 4, 1, 5, 3, 1, 4, 1, 5, 3, 1, 4], [9, 2, 6, 8]


@pytest.mark.parametrize("rule", ["expected", "ngram_first"])
def test_each_row_proposes_its_chosen_parts_draft_and_the_output_is_the_targets_greedy(target, rule):
    d = Recorded.tiny(target, rule=rule)
    reqs = [Request(REPEATING, 16), Request(FRESH, 16)]
    got = run(target, d, GreedyVerifier(), reqs, k=4, eos_token_ids=set())
    alone = run(target, None, GreedyVerifier(), reqs, k=4, eos_token_ids=set())
    assert [r.tokens for r in got.requests] == [r.tokens for r in alone.requests]
    mixed = False
    for (mf, learned), chosen, merged in d.steps:
        mixed |= len(set(chosen)) > 1
        for b, c in enumerate(chosen):
            part = learned if c == LEARNED else mf
            n = int(part.num_valid[b])
            assert int(merged.num_valid[b]) == n
            assert merged.tokens[b, :n].tolist() == part.tokens[b, :n].tolist()
            if rule == "ngram_first":
                assert c == (MODEL_FREE if int(mf.num_valid[b]) else LEARNED)
    assert mixed, "no step had rows choosing different parts: the merge went untested"


def test_ngram_first_lets_the_learned_part_sit_out_when_every_greedy_row_has_a_model_free_draft(target):
    d = Recorded.tiny(target, rule="ngram_first")
    run(target, d, GreedyVerifier(), [Request(REPEATING * 2, 12)], k=3, eos_token_ids=set())
    sat_out = [s for s in d.steps if s[0][LEARNED] is None]
    assert sat_out and all(int(s[0][MODEL_FREE].num_valid[0]) > 0 for s in sat_out)
    assert d.learned_calls == len(d.steps) - len(sat_out)


def test_expected_lets_the_learned_part_sit_out_only_when_its_best_case_loses(target):
    """Greedy, on a prompt the continuation copies: a step without a learned draft is one where the
    model-free draft's calibrated expected length is at least the learned part's upper bound (all
    of its last proposal's nodes accepted, calibrated by the row's record), and the output is the
    target's greedy."""
    d = Recorded.tiny(target, rule="expected")
    seen = []
    settled = d._settled

    def spy(state, b, mf):
        out = settled(state, b, mf)
        bound = calibrated(state.learned_nodes or 0, state.predicted[b][LEARNED], state.observed[b][LEARNED], 2.0)
        mine = calibrated(expected_length(mf), state.predicted[b][MODEL_FREE], state.observed[b][MODEL_FREE], 2.0)
        seen.append((out, state.learned_nodes is not None and bool(mf.tokens) and mine >= bound))
        return out

    d._settled = spy
    reqs = [Request(REPEATING * 3, 24)]
    got = run(target, d, GreedyVerifier(), reqs, k=4, eos_token_ids=set())
    assert got.requests[0].tokens == run(target, None, GreedyVerifier(), reqs, eos_token_ids=set()).requests[0].tokens
    assert all(out == expect for out, expect in seen)
    sat_out = [s for s in d.steps if s[0][LEARNED] is None]
    assert sat_out and len(sat_out) < len(d.steps)
    assert d.learned_calls == len(d.steps) - len(sat_out)


@pytest.mark.parametrize("rule", ["expected", "ngram_first"])
@pytest.mark.parametrize("verifier", SAMPLED_VERIFIERS)
def test_sampled_output_is_the_targets_distribution_when_rows_mix_parts(target, rule, verifier):
    """χ² of three sampled positions after a prompt whose own tokens the continuation often
    repeats, so some rows draft from the suffix tree (one-hot q) and others from the learned part
    (its sampled q), in the same batch."""
    d = Recorded.tiny(target, rule=rule, model_free_options={"tree": False})  # chains: block's own path
    r = sampled_gof(target, d, verifier_class(verifier)(), [1, 2, 1, 2, 3], SamplingParams(temperature=1.0),
                    n_samples=2000)
    assert len(r.pvalues) >= 3
    worst = min(zip(r.pvalues, r.tests))
    assert worst[0] > ALPHA / len(r.pvalues), f"output is not distributed as the target's: {worst[1]} p={worst[0]:.2e}"
    assert any(len(set(chosen)) > 1 and merged.q is not None and merged.is_chain for _, chosen, merged in d.steps)


# --- options ------------------------------------------------------------------------------------
def test_with_no_committed_checkpoint_for_the_target_it_says_which_option_to_pass(target):
    with pytest.raises(ValueError, match=r"learned_options=\{'checkpoint'"):
        make_drafter("hybrid", target)


@pytest.mark.parametrize("options, message", [
    ({"rule": "best"}, "rule must be one of"),
    ({"model_free": "nope"}, "hybrid model_free='nope': unknown drafter"),
    ({"learned_options": {"chekpoint": "x"}}, "eagle3 has no option 'chekpoint'"),
    ({"model_free_options": {"max_ngram": 3}}, "suffix has no option 'max_ngram'"),
    ({"learned_k": 0}, "learned_k must be"),
    ({"learned": "hybrid"}, "cannot be hybrids"),
    ({"rule_": "expected"}, "has no option 'rule_'"),
])
def test_bad_options_are_refused_before_any_work(target, options, message):
    with pytest.raises(ValueError, match=message):
        make_drafter("hybrid", target, **options)


def test_parts_and_rule_are_chosen_by_options(target):
    d = HybridDrafter.tiny(target, model_free="ngram", model_free_options={"max_ngram": 2}, rule="ngram_first",
                           learned_k=None)
    assert [p.name for p in d.parts] == ["ngram", "eagle3"] and d.parts[MODEL_FREE].config.max_ngram == 2
    assert d.parts[LEARNED].config.confidence  # the learned part is asked for its confidences
    reqs = [Request(REPEATING, 10), Request(FRESH, 10)]
    got = run(target, d, GreedyVerifier(), reqs, k=3, eos_token_ids=set())
    assert [r.tokens for r in got.requests] == [r.tokens for r in run(target, None, GreedyVerifier(), reqs,
                                                                         eos_token_ids=set()).requests]


@pytest.mark.slow
def test_with_no_options_it_builds_suffix_and_the_committed_eagle3_for_smollm2(smollm2):
    d = make_drafter("hybrid", smollm2)
    assert [p.name for p in d.parts] == ["suffix", "eagle3"] and d.config.rule == "expected"
    assert d.parts[LEARNED].model.spec.draft_vocab_size == 4096  # the committed head's reduced vocabulary
    ids = smollm2.tokenizer.encode("def fib(n):\n    return")
    got = run(smollm2, d, GreedyVerifier(), [Request(ids, 24)], k=4)
    assert got.requests[0].tokens == run(smollm2, None, GreedyVerifier(), [Request(ids, 24)]).requests[0].tokens


def test_eagle3_reports_its_greedy_draft_probabilities_only_when_asked(target):
    from specdec.drafters.eagle3.drafter import Eagle3Drafter

    for flag in (False, True):
        d = Eagle3Drafter.tiny(target, confidence=flag)
        rec = Recorded(d, d, HybridDrafter.tiny(target, learned_k=2).config)  # both parts the same head: records its drafts
        rec.bind(target)
        run(target, rec, GreedyVerifier(), [Request(FRESH, 6)], k=2, eos_token_ids=set())
        conf = rec.steps[0][0][LEARNED].confidence
        if not flag:
            assert conf is None
        else:
            assert conf.shape == (1, 2) and bool(((conf > 0) & (conf <= 1)).all())


def test_the_choice_benchmark_counts_steps_choices_and_sat_out_steps(target):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / "benchmarks" / "hybrid_choice.py"
    spec = importlib.util.spec_from_file_location("specdec_experiments_hybrid_choice", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    d = Recorded.tiny(target, rule="ngram_first")
    for prompt in (REPEATING * 2, FRESH):  # one prompt a call: Recorded keeps one generation's steps
        counts = bench.choice_counts(target, d, [prompt], 12, 3)
        assert counts["steps"] == len(d.steps) > 0
        assert counts["learned_chosen"] == sum(c == LEARNED for _, chosen, _ in d.steps for c in chosen)
        assert counts["learned_sat_out"] == sum(s[0][LEARNED] is None for s in d.steps)
        assert "propose" not in vars(d)  # the drafter is handed back as it came
        if prompt == FRESH:
            assert counts["learned_chosen"] > 0
        else:
            assert counts["learned_sat_out"] > 0

"""Which part the hybrid drafter chooses, per rule: steps, rows that took the learned part's draft,
and steps the learned part sat out, greedy, on a dataset's first (held-out) prompts. No clock.

    .venv/bin/python experiments/run.py --config-name lab/hybrid_choice [datasets=[mtbench,humaneval] prompts=3 tokens=64 k=8]
"""

from __future__ import annotations

import argparse
import torch

from specdec import Drafter, Target, load_target, make_drafter
from specdec.data.config import DatasetConfig
from specdec.data.datasets import load_dataset
from specdec.eval.runner import encode_turn
from specdec.loop import Request, run
from specdec.verifiers import GreedyVerifier

RULES = ("expected", "ngram_first")


def choice_counts(target: Target, drafter: Drafter, prompts: list[list[int]], tokens: int, k: int) -> dict[str, int]:
    """Decode each prompt alone with a hybrid ``drafter`` and count its steps, the rows that
    proposed the learned part's draft, and the steps the learned part sat out."""
    counts = {"steps": 0, "learned_chosen": 0, "learned_sat_out": 0}
    propose = drafter.propose

    def counted(state, k, rows):
        proposal = propose(state, k, rows)
        counts["steps"] += 1
        counts["learned_chosen"] += sum(c == 1 for c in state.chosen)
        counts["learned_sat_out"] += all(last[1] is None for last in state.last)
        return proposal

    drafter.propose = counted
    try:
        for p in prompts:
            run(target, drafter, GreedyVerifier(), [Request(p, tokens)], k=k)
    finally:
        del drafter.propose  # the class's own again
    return counts


def choices(datasets: list[str] = ("mtbench", "humaneval"), prompts: int = 3, tokens: int = 64, k: int = 8,
            threads: int = 2) -> None:
    """Mode ``hybrid_choice``: the counts of :func:`choice_counts` for both rules on the first
    ``prompts`` (held-out) prompts of each dataset with SmolLM2-135M, as a Markdown table. Every
    suffix tree is per request, since both rules answer the same prompts."""
    torch.set_num_threads(threads)
    target = load_target("smollm2-135m", dtype=torch.float32)
    print("| dataset | rule | steps | rows on the learned draft | steps the learned part sat out |")
    print("|---|---|---:|---:|---:|")
    for name in datasets:
        samples = load_dataset(DatasetConfig(name=name, num_prompts=prompts, output_len=tokens, turns=1),
                               target.tokenizer)
        asked = [encode_turn(target, s, 0, [], True) for s in samples]
        for rule in RULES:
            drafter = make_drafter("hybrid", target, rule=rule, model_free_options={"max_cached_requests": 0})
            c = choice_counts(target, drafter, asked, tokens, k)
            print(f"| {name} | {rule} | {c['steps']} | {c['learned_chosen']} | {c['learned_sat_out']} |", flush=True)

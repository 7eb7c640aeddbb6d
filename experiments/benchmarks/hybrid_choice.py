"""Which part the hybrid drafter chooses, per rule: steps, rows that took the learned part's draft,
and steps the learned part sat out, greedy, on a dataset's first (held-out) prompts. No clock.

    .venv/bin/python experiments/bench.py hybrid_choice --datasets mtbench humaneval --prompts 3 --tokens 64 --k 8
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", nargs="+", default=["mtbench", "humaneval"])
    ap.add_argument("--prompts", type=int, default=3, help="the first N of each dataset (held out)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("smollm2-135m", dtype=torch.float32)
    print("| dataset | rule | steps | rows on the learned draft | steps the learned part sat out |")
    print("|---|---|---:|---:|---:|")
    for name in args.datasets:
        samples = load_dataset(DatasetConfig(name=name, num_prompts=args.prompts, output_len=args.tokens, turns=1),
                               target.tokenizer)
        prompts = [encode_turn(target, s, 0, [], True) for s in samples]
        for rule in RULES:
            # per-request suffix trees: each rule answers the same prompts
            drafter = make_drafter("hybrid", target, rule=rule, model_free_options={"max_cached_requests": 0})
            c = choice_counts(target, drafter, prompts, args.tokens, args.k)
            print(f"| {name} | {rule} | {c['steps']} | {c['learned_chosen']} | {c['learned_sat_out']} |", flush=True)

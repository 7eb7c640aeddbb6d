"""EAGLE-3 on SmolLM2: chains and trees against autoregressive decoding, greedy and sampled.

On held-out MT-bench first turns (the first ``--prompts`` questions, never trained on; see
:data:`specdec.training.data.HELD_OUT`) under the chat template, batch size 1, one torch thread, it runs
autoregressive decoding (``drafter=None``, the same loop) and the committed drafter
``experiments/checkpoints/smollm2-135m-eagle3`` as chains ``k = 3, 5, 7``, a static tree and dynamic
(EAGLE-2) trees, at temperature 0 and 0.7. Methods are interleaved per prompt after a warm-up, so
drift of the shared machine hits all alike. Prints one markdown table per temperature: mean
accepted length (bonus included), acceptance per depth (the rate at which a depth was reached,
given the tree had that depth), nodes verified per step, tokens/s, wall-clock speedup over
autoregressive decoding in the same run, and (greedy) whether outputs equal autoregressive decoding.

    .venv/bin/python experiments/bench_eagle3.py [--prompts 8] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

torch.set_num_threads(1)  # the 2 cores are shared

from tqdm import tqdm  # noqa: E402

import specdec  # noqa: E402
from specdec.api import encode_messages  # noqa: E402
from specdec.eval.config import DatasetConfig  # noqa: E402
from specdec.eval.datasets import load_dataset  # noqa: E402
from specdec.drafters.eagle3.drafter import DEFAULT_STATIC_TREE, Eagle3Drafter  # noqa: E402
from specdec.metrics import summarize  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402

CHECKPOINT = Path(__file__).parent / "checkpoints" / "smollm2-135m-eagle3"

# name -> (k, drafter options); k is the chain length or the tree depth
METHODS: dict[str, tuple[int, dict]] = {
    "chain k=3": (3, {}),
    "chain k=5": (5, {}),
    "chain k=7": (7, {}),
    "static tree (8 nodes, depth 4)": (4, {"tree": "static", "static_tree": DEFAULT_STATIC_TREE}),
    "dynamic tree (top-4, 16 nodes, depth 5)": (5, {"tree": "dynamic", "tree_top_k": 4, "tree_budget": 16}),
    "dynamic tree (top-6, 32 nodes, depth 6)": (6, {"tree": "dynamic", "tree_top_k": 6, "tree_budget": 32}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=str(CHECKPOINT))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), help="a subset of the method names")
    args = ap.parse_args()

    target = specdec.load_target("smollm2-135m")
    samples = load_dataset(DatasetConfig(name="mtbench", num_prompts=args.prompts, turns=1))
    prompts = [encode_messages(target, [{"role": "user", "content": s.turns[0]}], chat=True) for s in samples]
    drafters = {name: Eagle3Drafter.create(target, checkpoint=args.checkpoint, **METHODS[name][1])
                for name in args.methods}
    names = ["autoregressive", *args.methods]

    def once(name: str, prompt: list[int], n: int, temperature: float, seed: int):
        k = METHODS[name][0] if name in METHODS else 1
        sampling = SamplingParams(temperature=temperature, seed=seed)
        return specdec.generate(target, [prompt], drafter=drafters.get(name), k=k, max_new_tokens=n,
                                sampling=sampling, verifier="rejection", eos_token_ids=None)

    for temperature in args.temperatures:
        for name in names:  # warm-up
            once(name, prompts[0], 8, temperature, 0)
        wall = {name: 0.0 for name in names}
        metrics = {name: [] for name in names}
        outputs = {name: [] for name in names}
        nodes = {name: 0 for name in names}
        for i, p in enumerate(tqdm(prompts, desc=f"T={temperature}")):
            for name in names:
                t0 = time.perf_counter()
                res = once(name, p, args.max_new_tokens, temperature, i)
                wall[name] += time.perf_counter() - t0
                metrics[name] += [r.metrics for r in res.run.requests]
                outputs[name] += res.tokens
                nodes[name] += sum(r.metrics.drafted for r in res.run.requests)
        ar_rate = sum(len(t) for t in outputs["autoregressive"]) / wall["autoregressive"]
        print(f"\nSmolLM2-135M-Instruct + EAGLE-3 ({Path(args.checkpoint).name}): {len(prompts)} held-out MT-bench"
              f" first turns, up to {args.max_new_tokens} new tokens, temperature {temperature}, batch 1,"
              f" torch threads {torch.get_num_threads()}\n")
        print("| method | mean accepted len | acceptance per depth | nodes/step | tok/s | speedup vs AR |"
              + (" identical to AR |" if temperature == 0 else ""))
        print("|---|---:|---|---:|---:|---:|" + ("---:|" if temperature == 0 else ""))
        for name in names:
            s = summarize(metrics[name])
            rate = sum(len(t) for t in outputs[name]) / wall[name]
            acc = " ".join(f"{a:.2f}" for a in s["acceptance_at"]) or "-"
            per_step = nodes[name] / max(1, s["steps"]) if name in METHODS else 0
            same = sum(a == b for a, b in zip(outputs[name], outputs["autoregressive"]))
            print(f"| {name} | {s['mean_accepted_length']:.2f} | {acc} | {per_step:.1f} | {rate:.1f}"
                  f" | {rate / ar_rate:.2f}x |" + (f" {same}/{len(prompts)} |" if temperature == 0 else ""),
                  flush=True)


if __name__ == "__main__":
    main()

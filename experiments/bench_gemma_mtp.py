"""The Gemma-4-style assistant (``gemma_mtp``) trained for SmolLM2, on MT-bench first turns.

In one process, greedy, batch size 1: autoregressive decoding (``drafter=None``, the same loop)
and the assistant for ``k = 2..6``, interleaved per prompt after one warm-up each. It prints mean
accepted length (bonus included), acceptance per position, tokens/s, the wall-clock speedup over
autoregressive decoding, whether outputs equal autoregressive decoding, and the assistant's draft
cost per drafted token relative to one target step (the figure that makes reading the target's
KV cache, instead of keeping a cache of its own, worth it).

    .venv/bin/python experiments/bench_gemma_mtp.py [--prompts 8] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

torch.set_num_threads(1)  # the 2 cores are shared; 2 threads under contention are ~10x slower

from tqdm import tqdm  # noqa: E402

import specdec  # noqa: E402
from specdec.eval.config import DatasetConfig  # noqa: E402
from specdec.eval.datasets import load_dataset  # noqa: E402
from specdec.metrics import summarize  # noqa: E402

CHECKPOINT = Path(__file__).parent / "checkpoints" / "smollm2-135m-gemma-mtp"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=str(CHECKPOINT))
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 5, 6])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    target = specdec.load_target("smollm2-135m", dtype=torch.float32)
    drafter = specdec.make_drafter("gemma_mtp", target, checkpoint=args.checkpoint)
    samples = load_dataset(DatasetConfig(name="mtbench", num_prompts=args.prompts, turns=1))
    prompts = [s.turns[0] for s in samples]
    methods = {"autoregressive": (None, 1)} | {f"gemma_mtp k={k}": (drafter, k) for k in args.ks}
    for name, (d, k) in methods.items():  # warm-up
        specdec.generate(target, prompts[0], d, k=k, max_new_tokens=8, chat=True)
    results: dict[str, list] = {name: [] for name in methods}
    for prompt in tqdm(prompts, desc="prompts"):
        for name, (d, k) in methods.items():
            results[name].append(specdec.generate(target, prompt, d, k=k, max_new_tokens=args.max_new_tokens,
                                                  chat=True))

    base = results["autoregressive"]
    base_wall = sum(r.run.metrics.wall_s for r in base)
    base_tokens = sum(r.run.metrics.new_tokens for r in base)
    step_s = sum(r.run.metrics.target_s for r in base) / max(sum(r.run.metrics.batch_steps for r in base), 1)
    print(f"SmolLM2-135M-Instruct fp32, CPU, 1 thread, MT-bench first turns ({len(prompts)}),"
          f" {args.max_new_tokens} new tokens, greedy, batch 1; assistant {args.checkpoint}")
    print("| method | tok/s | speedup | mean accepted len | acceptance per position | draft cost / token"
          " (× target step) | identical to AR |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for name, runs in results.items():
        wall = sum(r.run.metrics.wall_s for r in runs)
        tokens = sum(r.run.metrics.new_tokens for r in runs)
        summ = summarize([r.run.requests[0].metrics for r in runs])
        drafted = sum(r.run.requests[0].metrics.drafted for r in runs)
        draft_cost = sum(r.run.metrics.draft_s for r in runs) / drafted / step_s if drafted else 0.0
        same = sum(r.tokens == b.tokens for r, b in zip(runs, base))
        speedup = (tokens / wall) / (base_tokens / base_wall)
        print(f"| {name} | {tokens / wall:.1f} | {speedup:.2f}x | {summ['mean_accepted_length']:.2f} | "
              + " ".join(f"{a:.2f}" for a in summ["acceptance_at"])
              + f" | {draft_cost:.3f} | {same}/{len(runs)} |")


if __name__ == "__main__":
    main()

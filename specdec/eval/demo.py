"""The main job: speculative decoding on the offline SmolLM2-135M-Instruct, against plain
autoregressive decoding measured by the same loop in the same run.

    specdec-demo [--drafter ngram] [--k 8] [--max-new-tokens 96] [--temperature 0]

Drafters with a trained SmolLM2 checkpoint (``mtp``, ``gemma_mtp``, ``eagle3``, ``dflash``,
``dspark``) load it from the repository's ``experiments/checkpoints/``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import specdec

PROMPT = """Add type hints to this function and return the whole function, unchanged otherwise.

def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
"""


# the committed SmolLM2 drafters, in the repository (an editable install finds them)
CHECKPOINTS = Path(__file__).resolve().parents[2] / "experiments" / "checkpoints"
SMOLLM2_DRAFTERS = {"mtp": "smollm2-135m-mtp", "gemma_mtp": "smollm2-135m-gemma-mtp", "eagle3": "smollm2-135m-eagle3",
                    "dflash": "smollm2-135m-dflash", "dspark": "smollm2-135m-dspark"}


def drafter_options(name: str) -> dict:
    """The options that point ``name`` at its committed SmolLM2 checkpoint (none for ``ngram``)."""
    if name not in SMOLLM2_DRAFTERS:
        return {}
    folder = CHECKPOINTS / SMOLLM2_DRAFTERS[name]
    if not folder.is_dir():
        raise SystemExit(f"{name}: the SmolLM2 checkpoint {folder} is missing (it ships with the repository,"
                         " not the wheel: install with `pip install -e .`)")
    return {"checkpoint": str(folder)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="ngram", choices=["ngram", *SMOLLM2_DRAFTERS])
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    target = specdec.load_target("smollm2-135m", dtype=torch.float32)
    sampling = specdec.SamplingParams(temperature=args.temperature, seed=args.seed)
    common = dict(sampling=sampling, max_new_tokens=args.max_new_tokens, chat=True)
    specdec.generate(target, PROMPT, None, max_new_tokens=4, chat=True)  # warm-up
    base = specdec.generate(target, PROMPT, None, **common)
    spec = specdec.generate(target, PROMPT, args.drafter, k=args.k, **common, **drafter_options(args.drafter))

    s, b = spec.summary, base.summary
    print(spec.texts[0] if spec.texts else spec.tokens[0])
    print("-" * 72)
    print(f"target: SmolLM2-135M-Instruct (fp32, CPU)   drafter: {args.drafter}   k={args.k}"
          f"   temperature={args.temperature}")
    print(f"autoregressive : {b['tokens_per_s']:7.1f} tok/s  ({b['new_tokens']} tokens, {b['wall_s']:.2f} s)")
    print(f"speculative    : {s['tokens_per_s']:7.1f} tok/s  ({s['new_tokens']} tokens, {s['wall_s']:.2f} s)")
    print(f"speedup        : {b['wall_s'] / s['wall_s'] * s['new_tokens'] / max(b['new_tokens'], 1):.2f}x")
    print(f"mean accepted length (bonus included): {s['mean_accepted_length']:.2f}"
          f"   acceptance rate: {s['acceptance_rate']:.2f}")
    print("acceptance per position: " + " ".join(f"{a:.2f}" for a in s["acceptance_at"]))
    print(f"time split: draft {s['draft_s']:.2f} s, target {s['target_s'] + s['prefill_s']:.2f} s,"
          f" verify {s['verify_s']:.2f} s, loop overhead {s['other_s']:.2f} s")
    if args.temperature == 0:
        print(f"identical to autoregressive output: {spec.tokens == base.tokens}")


if __name__ == "__main__":
    main()

"""Speculative decoding on the offline SmolLM2-135M-Instruct against plain autoregressive decoding,
both measured by the same loop in the same run, with the costs that decide which one wins.

    specdec-demo                                  # ngram drafter, a code-editing prompt
    specdec-demo --drafter eagle3 --k 2           # a committed SmolLM2 drafter, found by name
    specdec-demo --prompt "Explain KV caches." --json

Verifying k+1 tokens is not free (on a 2-core CPU, 5 tokens cost about 1.7 decoding steps:
docs/results.md), so a drafter must be accepted often to pay for it: the demo prints the measured
draft and verify costs per step and, when speculation loses, the accepted length it would need.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import specdec
from specdec.metrics import GenerationSummary

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

# the committed SmolLM2 drafters, by checkpoint name (specdec.checkpoints)
SMOLLM2_DRAFTERS = {"mtp": "smollm2-135m-mtp", "gemma_mtp": "smollm2-135m-gemma-mtp", "eagle3": "smollm2-135m-eagle3",
                    "dflash": "smollm2-135m-dflash", "dspark": "smollm2-135m-dspark"}
NGRAM_K = 8  # prompt lookup: long drafts cost nothing to make, and code edits copy long spans
# a trained drafter without a recorded best k: the committed heads are accepted at the first position
# only (docs/results.md, "All drafters on the same prompts": 0.00-0.06 at position 2)
TRAINED_K = 1


def drafter_options(name: str) -> dict:
    """The options that point ``name`` at its committed SmolLM2 checkpoint (none for ``ngram``)."""
    return {"checkpoint": SMOLLM2_DRAFTERS[name]} if name in SMOLLM2_DRAFTERS else {}


def recorded_best_k(folder: Path) -> dict | None:
    """The best measured draft length recorded with a checkpoint: ``best_k`` of its
    ``training.json`` (``{"k": int, "measured": "command and figure"}``), or None when absent."""
    meta = folder / "training.json"
    best = json.loads(meta.read_text()).get("best_k") if meta.is_file() else None
    if best is None:
        return None
    if not (isinstance(best, dict) and isinstance(best.get("k"), int) and best["k"] >= 1 and best.get("measured")):
        raise ValueError(f"{meta}: best_k must be {{\"k\": int >= 1, \"measured\": \"command and figure\"}},"
                         f" got {best!r}")
    return best


def default_k(name: str) -> tuple[int, str]:
    """The demo's draft length and where it comes from: long for prompt lookup; for a trained
    drafter the best k recorded with its checkpoint, else :data:`TRAINED_K`."""
    if name not in SMOLLM2_DRAFTERS:
        return NGRAM_K, "prompt lookup's default"
    from specdec.models import resolve_checkpoint  # transformers: not for --help

    best = recorded_best_k(resolve_checkpoint(SMOLLM2_DRAFTERS[name]))
    if best is None:
        return TRAINED_K, "no best k recorded with the checkpoint; position-2 acceptance is near zero"
    return best["k"], f"best measured, recorded with the checkpoint: {best['measured']}"


def verdict(spec: GenerationSummary, base: GenerationSummary) -> list[str]:
    """Why speculation won or lost, from the measured costs alone."""
    ar_ms = base.verify_ms_per_step  # one autoregressive step: one target forward + sampling
    step_ms = spec.draft_ms_per_step + spec.verify_ms_per_step
    need = step_ms / ar_ms if ar_ms else float("nan")
    lines = [f"one autoregressive step {ar_ms:.1f} ms; one speculative step {step_ms:.1f} ms"
             f" (draft {spec.draft_ms_per_step:.1f} + verify {spec.verify_ms_per_step:.1f}) = {need:.2f} AR steps"]
    if spec.mean_accepted_length >= need:
        lines.append(f"each step yields {spec.mean_accepted_length:.2f} tokens > {need:.2f}: speculation pays")
    else:
        lines.append(f"each step yields {spec.mean_accepted_length:.2f} tokens < {need:.2f}: speculation loses here;"
                     f" it would pay at a mean accepted length above {need:.2f} (more acceptance, a cheaper draft,"
                     " or a smaller k)")
    return lines


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec-demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="ngram", choices=["ngram", *SMOLLM2_DRAFTERS],
                    help="ngram (prompt lookup) or a drafter with a committed SmolLM2 checkpoint (default: ngram)")
    ap.add_argument("--k", type=int, default=None,
                    help=f"draft tokens per step (default: ngram {NGRAM_K}; a trained drafter the best k measured"
                         " with its checkpoint, recorded as best_k in its training.json, else"
                         f" {TRAINED_K}, as acceptance beyond the first position is near zero)")
    ap.add_argument("--prompt", default=PROMPT, help="the user message (default: a code-editing request)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="tokens to generate (default: 96)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    ap.add_argument("--threads", type=int, default=None,
                    help=f"torch threads (default: every core of this machine, {os.cpu_count()})")
    ap.add_argument("--json", action="store_true", help="print both summaries and the speedup as JSON only")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    try:
        k, k_source = (args.k, "--k") if args.k is not None else default_k(args.drafter)
        options = drafter_options(args.drafter)
        if "checkpoint" in options:
            from specdec.models import resolve_checkpoint

            resolve_checkpoint(options["checkpoint"])
    except FileNotFoundError as e:  # a checkpoint recorded but not committed: its recipe, no traceback
        raise SystemExit(f"specdec-demo: {e}") from None
    target = specdec.load_target("smollm2-135m", dtype=torch.float32)
    sampling = specdec.SamplingParams(temperature=args.temperature, seed=args.seed)
    common = dict(sampling=sampling, max_new_tokens=args.max_new_tokens, chat=True)
    drafter = specdec.make_drafter(args.drafter, target, **options)
    for d in (None, drafter):  # warm-up: first calls pay for allocation and lazy initialisation
        specdec.generate(target, args.prompt, d, k=k, max_new_tokens=4, chat=True)
    base = specdec.generate(target, args.prompt, None, **common)
    spec = specdec.generate(target, args.prompt, drafter, k=k, **common)
    s, b = spec.summary, base.summary
    speedup = s.tokens_per_s / b.tokens_per_s if b.tokens_per_s else float("nan")
    identical = spec.tokens == base.tokens if args.temperature == 0 else None

    if args.json:
        print(json.dumps({"speedup": speedup, "identical_to_autoregressive": identical, "threads": torch.get_num_threads(),
                          "k": k, "k_source": k_source,
                          "speculative": s.to_dict(), "autoregressive": b.to_dict()}, indent=2))
        return
    print(spec.texts[0] if spec.texts else spec.tokens[0])
    print("-" * 72)
    print(f"target: SmolLM2-135M-Instruct (fp32, CPU, {torch.get_num_threads()} threads)   drafter: {args.drafter}"
          f"   temperature={args.temperature}")
    print(f"k={k}: {k_source}")
    print(f"autoregressive : {b.tokens_per_s:7.1f} tokens/s  ({b.new_tokens} tokens, {b.wall_s:.2f} s)")
    print(f"speculative    : {s.tokens_per_s:7.1f} tokens/s  ({s.new_tokens} tokens, {s.wall_s:.2f} s)")
    print(f"speedup        : {speedup:.2f}x")
    print(f"mean accepted length (bonus included): {s.mean_accepted_length:.2f} tokens/step"
          f"   acceptance by position: " + " ".join(f"{a:.2f}" for a in s.acceptance_at))
    for line in verdict(s, b):
        print(line)
    if identical is not None:
        print(f"identical to autoregressive output: {identical}")


if __name__ == "__main__":
    main()

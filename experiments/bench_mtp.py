"""Native MTP drafting on the tiny DeepSeek-V3 trained with its own two MTP modules.

On the committed checkpoint ``experiments/checkpoints/tiny-deepseek-v3-mtp`` (see
``train_mtp.py``) and prompts cut from the held-out standard-library files (never trained on),
greedy, batch size 1, in one process, it runs autoregressive decoding (``drafter=None``, the same
loop) and the ``mtp`` drafter for ``k = 1..K`` under each recursion policy (``k > 2`` reuses the
two modules). Methods are interleaved per prompt after one warm-up each, so drift of the shared
machine hits all alike. It prints a markdown table: mean accepted length (bonus included),
acceptance per position (the rate at which a draft at that depth survived, given it was drafted),
tokens/s, wall-clock speedup over autoregressive decoding in the same run, and whether every
output is identical to autoregressive decoding.

    .venv/bin/python experiments/bench_mtp.py [--max-k 6] [--policies cycle last] [--prompts 8]

``--target smollm2-135m --checkpoint experiments/checkpoints/smollm2-135m-mtp`` runs the post-hoc
module trained for the frozen SmolLM2 instead.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

torch.set_num_threads(1)  # the 2 cores are shared; 2 threads under contention are ~10x slower

from tqdm import tqdm  # noqa: E402

import specdec  # noqa: E402
from specdec.drafters.mtp.drafter import MTPDrafter  # noqa: E402
from specdec.metrics import summarize  # noqa: E402
from specdec.training.text import stdlib_files  # noqa: E402

CHECKPOINT = Path(__file__).parent / "checkpoints" / "tiny-deepseek-v3-mtp"


def heldout_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens, cut at a line start from the held-out files in turn."""
    files = stdlib_files("heldout")
    prompts = []
    for i in range(n):
        text = files[i % len(files)].read_text()
        lines = text.splitlines(keepends=True)
        start = (len(lines) * (1 + i // len(files))) // 3  # past the module docstring
        prompts.append(tokenizer.encode("".join(lines[start:]))[:length])
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=str(CHECKPOINT), help="folder with the MTP layers")
    ap.add_argument("--target", default="", help="the target (alias or folder); default: --checkpoint")
    ap.add_argument("--max-k", type=int, default=6)
    ap.add_argument("--policies", nargs="+", default=["cycle", "last"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tree", type=int, default=0, help="also run a top-K tree (K = this) at k = 3")
    args = ap.parse_args()

    target = specdec.load_target(args.target or args.checkpoint)
    prompts = heldout_prompts(target.tokenizer, args.prompts, args.prompt_len)
    methods: dict[str, MTPDrafter | None] = {"autoregressive": None}
    for policy in args.policies:
        for k in range(1, args.max_k + 1):
            methods[f"{policy} k={k}"] = MTPDrafter.create(target, checkpoint=args.checkpoint, policy=policy)
    if args.tree:
        methods[f"tree top-{args.tree} k=3"] = MTPDrafter.create(target, checkpoint=args.checkpoint,
                                                                 tree_top_k=args.tree)
    ks = {name: (int(name.rsplit("=", 1)[1]) if d is not None else 1) for name, d in methods.items()}

    def once(name: str, prompt: list[int], n: int):
        return specdec.generate(target, [prompt], drafter=methods[name], k=ks[name], max_new_tokens=n,
                                verifier="greedy", eos_token_ids=set())

    for name in methods:  # warm-up
        once(name, prompts[0], 8)
    wall = {name: 0.0 for name in methods}
    metrics = {name: [] for name in methods}
    outputs = {name: [] for name in methods}
    for p in tqdm(prompts, desc="prompts"):
        for name in methods:
            t0 = time.perf_counter()
            res = once(name, p, args.max_new_tokens)
            wall[name] += time.perf_counter() - t0
            metrics[name] += [r.metrics for r in res.run.requests]
            outputs[name] += res.tokens

    ar_rate = sum(len(t) for t in outputs["autoregressive"]) / wall["autoregressive"]
    label = f"{args.target or Path(args.checkpoint).name} + MTP from {Path(args.checkpoint).name}"
    print(f"\n{label}: {len(prompts)} held-out prompts x {args.prompt_len} tokens, {args.max_new_tokens} new"
          f" tokens, greedy, batch 1, torch threads {torch.get_num_threads()}\n")
    print("| method | mean accepted len | acceptance per position | tok/s | speedup vs AR | identical to AR |")
    print("|---|---:|---|---:|---:|---:|")
    for name in methods:
        s = summarize(metrics[name])
        rate = sum(len(t) for t in outputs[name]) / wall[name]
        same = sum(a == b for a, b in zip(outputs[name], outputs["autoregressive"]))
        acc = " ".join(f"{a:.2f}" for a in s["acceptance_at"]) or "-"
        print(f"| {name} | {s['mean_accepted_length']:.2f} | {acc} | {rate:.1f} | {rate / ar_rate:.2f}x"
              f" | {same}/{len(prompts)} |")


if __name__ == "__main__":
    main()

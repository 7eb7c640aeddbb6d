"""Grow the training corpus: the target's own greedy and sampled answers (specdec.data.corpus).

    python experiments/generate_corpus.py --num-prompts 8192 --threads 1

Resumes at the first missing shard, so it can run in several parts; each shard is written whole.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import specdec
from specdec.data.corpus import corpus_stats, generate_corpus
from specdec.timing import now

ROOT = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="target alias or folder (loaded in fp32)")
    ap.add_argument("--out", type=Path, default=ROOT / "data" / "smollm2-135m", help="corpus folder")
    ap.add_argument("--num-prompts", type=int, default=8192, help="prompts to answer in total")
    ap.add_argument("--shard-size", type=int, default=64, help="prompts per shard (one file)")
    ap.add_argument("--batch", type=int, default=32, help="requests decoded together")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="answer length cap")
    ap.add_argument("--drafter", default=None, help="a lossless drafter to decode with (e.g. ngram on a GPU)")
    ap.add_argument("--k", type=int, default=4, help="draft length when --drafter is set")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--seed", type=int, default=0, help="prompt order and sampling seeds")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = specdec.load_target(args.model, dtype=torch.float32)
    start = now()
    generate_corpus(target, args.out, args.num_prompts, shard_size=args.shard_size, batch=args.batch,
                    max_new_tokens=args.max_new_tokens, drafter=args.drafter, k=args.k, seed=args.seed)
    stats = corpus_stats(args.out)
    print(json.dumps({**stats, "seconds_this_run": round(now() - start, 1)}))


if __name__ == "__main__":
    main()

"""Grow the training corpus: the target's own greedy and sampled answers (specdec.data.corpus).

    python experiments/run.py --config-name lab/corpus num_prompts=8192 threads=1

Resumes at the first missing shard, so it can run in several parts; each shard is written whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import specdec
from specdec.data.corpus import corpus_stats, generate_corpus
from specdec.timing import now

ROOT = Path(__file__).resolve().parent


def grow(model: str = "smollm2-135m", out: str = "experiments/data/smollm2-135m", num_prompts: int = 8192,
         shard_size: int = 64, batch: int = 32, max_new_tokens: int = 256, drafter: str | None = None, k: int = 4,
         threads: int = 1, seed: int = 0) -> None:
    """Mode ``corpus``: answer ``num_prompts`` prompts in total with ``model`` (an alias or folder,
    loaded in fp32) into ``out``, ``shard_size`` prompts a file, ``batch`` requests decoded together
    (with ``drafter``, a lossless drafter at ``k``, e.g. ngram on a GPU); ``seed``: prompt order and
    sampling seeds."""
    torch.set_num_threads(threads)
    target = specdec.load_target(model, dtype=torch.float32)
    start = now()
    generate_corpus(target, Path(out), num_prompts, shard_size=shard_size, batch=batch,
                    max_new_tokens=max_new_tokens, drafter=drafter, k=k, seed=seed)
    stats = corpus_stats(Path(out))
    print(json.dumps({**stats, "seconds_this_run": round(now() - start, 1)}))

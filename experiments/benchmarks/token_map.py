"""Rank the target's tokens by how often it writes them in the corpus: a token map (specdec.draft_vocab).

    python experiments/run.py --config-name lab/token_map    # experiments/data/smollm2-135m/token_map.safetensors

Counts the response tokens of the corpus's training sequences (the one held-out rule, as training
splits them), writes the ids that occur, most frequent first, and prints what the first N cover of
the held-out sequences' responses. A drafter that reads the target's LM head drafts over the first
``draft_vocab`` of them with ``token_map=<file> draft_vocab=N``. Reads no model: only the corpus.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import safe_open

from specdec.draft_vocab import coverage, rank_tokens, save_token_map
from specdec.data.corpus import corpus_token_counts
from specdec.provenance import command_line

ROOT = Path(__file__).resolve().parents[1]  # experiments/
SIZES = (1024, 2048, 4096, 8192, 16384)


def build(corpus: str = "experiments/data/smollm2-135m", out: str | None = None, held_out_every: int = 20) -> None:
    """Mode ``token_map``: the map of ``corpus`` into ``out`` (default: ``<corpus>/token_map.safetensors``);
    ``held_out_every``: the held-out rule's modulus (``data.held_out_every``)."""
    folder = Path(corpus)
    path = Path(out) if out else folder / "token_map.safetensors"
    first = next(iter(sorted(folder.glob("shard-*.safetensors"))), None)
    if first is None:
        raise SystemExit(f"no corpus shards (shard-*.safetensors) in {folder}")
    with safe_open(str(first), framework="pt") as f:
        meta = f.metadata() or {}
    if "vocab_size" not in meta:
        raise SystemExit(f"{first} does not record the vocab_size its ids come from")
    vocab_size = int(meta["vocab_size"])
    train, held = corpus_token_counts(folder, vocab_size, held_out_every)
    ranked = rank_tokens(train)
    cover = {n: round(coverage(held, ranked[:n]), 4) for n in SIZES if n <= ranked.numel()}
    where = lambda p: os.path.relpath(p.resolve(), ROOT.parent)  # noqa: E731 (paths as the repository names them)
    save_token_map(path, ranked, {"source": where(folder), "vocab_size": str(vocab_size),
                                  "train_response_tokens": str(int(train.sum())),
                                  "held_out_coverage": json.dumps(cover), "command": command_line()})
    print(json.dumps({"out": where(path), "ids": ranked.numel(), "train_response_tokens": int(train.sum()),
                      "held_out_response_tokens": int(held.sum()), "held_out_coverage": cover}))

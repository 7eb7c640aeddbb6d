"""Rank the target's tokens by how often it writes them in the corpus: a token map (specdec.draft_vocab).

    python experiments/bench.py token_map                 # experiments/data/smollm2-135m/token_map.safetensors

Counts the response tokens of the corpus's training sequences (the one held-out rule, as training
splits them), writes the ids that occur, most frequent first, and prints what the first N cover of
the held-out sequences' responses. A drafter that reads the target's LM head drafts over the first
``draft_vocab`` of them with ``token_map=<file> draft_vocab=N``. Reads no model: only the corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from safetensors import safe_open

from specdec.draft_vocab import coverage, rank_tokens, save_token_map
from specdec.data.corpus import corpus_token_counts

ROOT = Path(__file__).resolve().parents[1]  # experiments/
SIZES = (1024, 2048, 4096, 8192, 16384)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=ROOT / "data" / "smollm2-135m", help="corpus folder")
    ap.add_argument("--out", type=Path, default=None, help="token map file (default: <corpus>/token_map.safetensors)")
    ap.add_argument("--held-out-every", type=int, default=20, help="the held-out rule's modulus (data.held_out_every)")
    args = ap.parse_args()
    out = args.out or args.corpus / "token_map.safetensors"
    first = next(iter(sorted(args.corpus.glob("shard-*.safetensors"))), None)
    if first is None:
        sys.exit(f"no corpus shards (shard-*.safetensors) in {args.corpus}")
    with safe_open(str(first), framework="pt") as f:
        meta = f.metadata() or {}
    if "vocab_size" not in meta:
        sys.exit(f"{first} does not record the vocab_size its ids come from")
    vocab_size = int(meta["vocab_size"])
    train, held = corpus_token_counts(args.corpus, vocab_size, args.held_out_every)
    ranked = rank_tokens(train)
    cover = {n: round(coverage(held, ranked[:n]), 4) for n in SIZES if n <= ranked.numel()}
    where = lambda p: os.path.relpath(p.resolve(), ROOT.parent)  # noqa: E731 (paths as the repository names them)
    save_token_map(out, ranked, {"source": where(args.corpus), "vocab_size": str(vocab_size),
                                 "train_response_tokens": str(int(train.sum())),
                                 "held_out_coverage": json.dumps(cover),
                                 "command": "python " + " ".join([where(Path(sys.argv[0])), *sys.argv[1:]])})
    print(json.dumps({"out": where(out), "ids": ranked.numel(), "train_response_tokens": int(train.sum()),
                      "held_out_response_tokens": int(held.sum()), "held_out_coverage": cover}))


if __name__ == "__main__":
    main()

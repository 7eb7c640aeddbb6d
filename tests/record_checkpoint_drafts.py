"""Record what every committed checkpoint drafts (tests/data/checkpoint_drafts.json), for
tests/test_checkpoints.py. Run it only when a checkpoint or its case changes on purpose, from
outside the repository root: ``python tests/record_checkpoint_drafts.py [folder-name ...]``.

The output is checked against the target's own greedy decoding before it is recorded.
"""

from __future__ import annotations

import json
import sys

import torch

from specdec.metrics import summarize
from specdec.testing import assert_greedy_equivalent, greedy_reference
from test_checkpoints import CASES, RECORD, ROOT, drive, load, settings  # this script's folder is on sys.path


def record(name: str) -> dict:
    folder = ROOT / name
    target, case = load(folder), CASES[name]
    prompts = [list(map(int, p)) for p in case.prompts(target)]
    res, drafts = drive(target, folder, case, prompts)
    for p, r in zip(prompts, res.requests):
        ref, logits = greedy_reference(target.model, p, case.max_new_tokens)
        assert_greedy_equivalent(r.tokens, ref, logits)
    s = summarize([r.metrics for r in res.requests])
    print(f"{name}: mean accepted length {s['mean_accepted_length']:.3f}, acceptance by depth "
          f"{[round(a, 3) for a in s['acceptance_at']]}")
    return {"settings": settings(case), "prompts": prompts, "drafts": drafts,
            "output": [r.tokens for r in res.requests],
            "measured": {"mean_accepted_length": s["mean_accepted_length"], "acceptance_at": s["acceptance_at"]}}


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    records = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    for name in names or sorted(CASES):
        records[name] = record(name)
    RECORD.write_text(json.dumps(records, indent=None, separators=(",", ":")).replace('},"', '},\n"') + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])

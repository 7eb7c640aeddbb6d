"""Every committed checkpoint in experiments/checkpoints/ loads and drafts exactly as recorded.

The folders are discovered, so a new checkpoint is checked automatically; one without an entry in
:data:`CASES` or in tests/data/checkpoint_drafts.json fails (record it with
``python tests/record_checkpoint_drafts.py``, from outside the repository root). Each case runs its
drafter greedily on fixed prompts (token ids stored in the record) and must give

- the recorded drafts of the first :data:`STEPS` steps, token for token (tree parents included),
- the recorded greedy output (checked against the target's own greedy decoding when recorded),
- a mean accepted length above the case's floor: a trained drafter is far above the ~1.0 a
  drafter with random weights gets.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import specdec
from specdec.loop import Request, RunResult, run
from specdec.metrics import summarize
from specdec.target import Target
from specdec.testing import Recording
from specdec.verifiers import GreedyVerifier

ROOT = Path(__file__).resolve().parents[1] / "experiments" / "checkpoints"
RECORD = Path(__file__).resolve().parent / "data" / "checkpoint_drafts.json"
STEPS = 8  # drafts compared token for token: enough to cover every draft position, few enough to stay small
K = 4


def chat_prompts(target: Target) -> list[list[int]]:
    """Two chat-formatted requests (SmolLM2-135M-Instruct)."""
    texts = ["Write a short story about a cat who learns to fly.", "Explain how a rainbow forms."]
    return [target.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False) for t in texts]


def heldout_prompts(target: Target) -> list[list[int]]:
    """The first 48 tokens of two held-out standard-library files (the MTP recipes train on the others)."""
    from specdec.training.text import stdlib_files

    return [target.tokenizer.encode(f.read_text())[:48] for f in stdlib_files("heldout")[:2]]


@dataclass(frozen=True)
class Case:
    drafter: str
    floor: float  # mean accepted length the run must beat (measured value in the table's comment)
    on_smollm2: bool = True  # the real SmolLM2-135M (slow tier); False: the checkpoint folder is the target
    options: dict[str, Any] = field(default_factory=dict)
    prompts: Callable[[Target], list[list[int]]] = chat_prompts
    max_new_tokens: int = 32
    first_floor: float = 0.0  # acceptance of the first draft position it must beat


# Floors sit clearly above a random drafter (~1.0) and below what the run measured when recorded
# (in the comments; the record keeps the exact figures).
CASES: dict[str, Case] = {
    "smollm2-135m-dflash": Case("dflash", floor=1.03, first_floor=0.03),  # 1.07, 0.07
    "smollm2-135m-dspark": Case("dspark", floor=1.06, first_floor=0.06),  # 1.13, 0.13
    "smollm2-135m-eagle3": Case("eagle3", floor=1.4,  # 1.63
                                options=dict(tree="dynamic", tree_top_k=4, tree_budget=16)),
    "smollm2-135m-gemma-mtp": Case("gemma_mtp", floor=1.06),  # 1.13
    "smollm2-135m-mtp": Case("mtp", floor=1.15, prompts=heldout_prompts),  # 1.34
    "tiny-deepseek-v3-mtp": Case("mtp", floor=2.2, on_smollm2=False, options=dict(policy="cycle"),
                                 prompts=heldout_prompts, first_floor=0.5),  # 2.78, 0.61
}


def load(folder: Path) -> Target:
    model = "smollm2-135m" if CASES[folder.name].on_smollm2 else str(folder)
    return specdec.load_target(model, dtype=torch.float32)


def settings(case: Case) -> dict[str, Any]:
    """What a record was made with (compared first, so a changed table asks for a new record)."""
    return {"drafter": case.drafter, "options": case.options, "k": K, "max_new_tokens": case.max_new_tokens}


def drive(target: Target, folder: Path, case: Case, prompts: list[list[int]]) -> tuple[RunResult, list[dict]]:
    """One greedy batched run of the checkpoint's drafter and the drafts of its first STEPS steps."""
    drafter = Recording(specdec.make_drafter(case.drafter, target, checkpoint=str(folder), **case.options))
    with torch.inference_mode():  # the drafter is built outside it: its weights must stay ordinary tensors
        res = run(target, drafter, GreedyVerifier(), [Request(list(p), case.max_new_tokens) for p in prompts], k=K,
                  eos_token_ids=set())
    drafts = []
    for p in drafter.proposals[:STEPS]:
        nv = p.num_valid.tolist()
        drafts.append({"tokens": [row[:n] for row, n in zip(p.tokens.tolist(), nv)],
                       "parents": [row[:n] for row, n in zip(p.parents.tolist(), nv)]})
    return res, drafts


def checkpoint_params() -> list:
    folders = sorted(p for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders, f"no checkpoints under {ROOT}"
    slow = {name for name, c in CASES.items() if c.on_smollm2}
    return [pytest.param(f, id=f.name, marks=[pytest.mark.slow] if f.name in slow else []) for f in folders]


@pytest.mark.parametrize("folder", checkpoint_params())
def test_checkpoint_loads_and_drafts_as_recorded(folder: Path, request: pytest.FixtureRequest):
    assert folder.name in CASES, f"{folder.name}: add it to CASES in {Path(__file__).name}"
    records = json.loads(RECORD.read_text())
    assert folder.name in records, f"{folder.name}: no record; run tests/record_checkpoint_drafts.py"
    rec = records[folder.name]
    case = CASES[folder.name]
    target = request.getfixturevalue("smollm2") if case.on_smollm2 else load(folder)  # SmolLM2: once a session
    assert rec["settings"] == settings(case), "the case changed since it was recorded: record it again"
    res, drafts = drive(target, folder, case, rec["prompts"])
    assert len(drafts) == STEPS
    for step, (ours, theirs) in enumerate(zip(drafts, rec["drafts"], strict=True)):
        assert ours == theirs, f"step {step}: drafts differ from the record"
    assert [r.tokens for r in res.requests] == rec["output"]
    s = summarize([r.metrics for r in res.requests])
    assert s["mean_accepted_length"] > case.floor and s["acceptance_at"][0] > case.first_floor, s
    assert s["acceptance_at"][0] > s["acceptance_at"][-1], s  # acceptance falls with depth

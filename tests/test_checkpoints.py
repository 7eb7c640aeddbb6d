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
    """The first turns of the first three held-out MT-bench questions, chat-formatted: benchmark items
    no recipe trains on (the held-out rule, :data:`specdec.data.datasets.HELD_OUT`)."""
    from specdec.data.config import DatasetConfig
    from specdec.data.datasets import load_dataset

    texts = [s.turns[0] for s in load_dataset(DatasetConfig(name="mtbench", num_prompts=3, turns=1))]
    return [target.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False) for t in texts]


def heldout_prompts(target: Target) -> list[list[int]]:
    """The first 48 tokens of two held-out standard-library files (the MTP recipes train on the others)."""
    from specdec.data.text import stdlib_files

    return [target.tokenizer.encode(f.read_text())[:48] for f in stdlib_files("heldout")[:2]]


@dataclass(frozen=True)
class Case:
    drafter: str
    floors: tuple[float, ...]  # acceptance per draft position (1..K) the run must reach: the regression guard
    mal_floor: float  # mean accepted length the run must beat
    on_smollm2: bool = True  # the real SmolLM2-135M (slow tier); False: the checkpoint folder is the target
    options: dict[str, Any] = field(default_factory=dict)
    prompts: Callable[[Target], list[list[int]]] = chat_prompts
    max_new_tokens: int = 48


# The regression guard, as speculators keeps one: floors sit about 20% below what the committed
# weights measured when recorded (the record's "measured" keeps the exact figures; the comments
# repeat them), and clearly above a drafter with random weights (~0 acceptance, length ~1.0).
CASES: dict[str, Case] = {
    "smollm2-135m-eagle3": Case("eagle3", floors=(0.25, 0.11, 0.04, 0.02), mal_floor=1.43,
                                options=dict(tree="chain")),  # 0.312 0.140 0.054 0.032, length 1.538
    "smollm2-135m-dspark": Case("dspark", floors=(0.17, 0.02, 0.0, 0.0), mal_floor=1.19),  # 0.217 0.026 0 0, 1.243
    "tiny-deepseek-v3-mtp": Case("mtp", floors=(0.48, 0.38, 0.31, 0.24), mal_floor=2.2, on_smollm2=False,
                                 options=dict(policy="cycle"), prompts=heldout_prompts,
                                 max_new_tokens=32),  # 0.61 0.48 0.39 0.30, length 2.78
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
    folders = sorted(p for p in ROOT.iterdir() if (p / "config.json").is_file())  # committed weights only
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
    assert s["mean_accepted_length"] > case.mal_floor, s
    assert len(s["acceptance_at"]) == K and all(a >= f for a, f in zip(s["acceptance_at"], case.floors)), s

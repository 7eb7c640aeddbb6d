"""An EAGLE-3 head's training-time-test estimate against what decoding accepts, on the same text.

    .venv/bin/python experiments/run.py --config-name lab/eagle3_chain_estimate checkpoint=experiments/checkpoints/smollm2-135m-eagle3

The target answers held-out MT-bench first turns greedily; the head then drafts chains of ``k``
through the library's loop (what decoding accepts per depth), and the training-time test scores
every anchor of the same answers (:func:`specdec.drafters.eagle3.train.ttt_loss`): per position on
its own given the true tokens before it (the recipe's held-out estimate), and as a chain, the
anchors whose first ``s`` drafts all match (what decoding can accept). The chain figure is the one
that agrees with decoding; the per-position one counts a deep position right after a wrong first
guess, which decoding never reaches.
"""

from __future__ import annotations

import json

import torch

import specdec
from specdec.drafters.eagle3.drafter import Eagle3Drafter
from specdec.drafters.eagle3.train import ttt_loss
from specdec.data.config import DatasetConfig
from specdec.data.datasets import load_dataset
from specdec.target import Target
from specdec.training.data import FeatureSeq, target_features
from specdec.training.recipe import head_rows


@torch.inference_mode()
def estimates(target: Target, drafter: Eagle3Drafter, prompts: list[list[int]], max_new_tokens: int, k: int
              ) -> dict[str, list[float]]:
    """Acceptance per depth 1..k: ``decoded`` (the share of decoding steps that accepted at least s drafts),
    ``per_position`` and ``chain`` (the training-time test on the same greedy answers, every anchor)."""
    run = specdec.generate(target, prompts, drafter, k=k, verifier="greedy", max_new_tokens=max_new_tokens,
                           progress=False)
    model = drafter.model
    head = head_rows(target, model.draft_ids).to(model.fc.weight.dtype)
    right, chain, anchors = torch.zeros(k), torch.zeros(k), 0
    for prompt, answer in zip(prompts, run.tokens):
        tokens = torch.tensor(prompt + answer[:-1])
        f = target_features(target, tokens.unsqueeze(0), model.spec.layer_ids)
        seq = FeatureSeq(tokens, len(prompt), f["features"][0], f["final"][0])
        a = torch.arange(len(prompt) - 1, tokens.numel() - k - 1)  # anchors whose k labels all exist
        if not a.numel():
            continue
        r = ttt_loss(model, lambda ids: target.embed(ids), head, model.t2d, seq, a, steps=k)
        ok = torch.stack([r.logits[s].argmax(-1) == (seq.final[a + s + 1].to(head.dtype) @ head.T).argmax(-1)
                          for s in range(k)], 1)  # [A, k] draft argmax = target argmax at each depth
        right += ok.sum(0)
        chain += ok.long().cumprod(1).sum(0)
        anchors += a.numel()
    decoded = run.summary.acceptance_at  # every step drafts k deep: the share of steps accepting >= s
    return {"decoded": decoded, "per_position": (right / max(anchors, 1)).tolist(),
            "chain": (chain / max(anchors, 1)).tolist()}


def estimate(checkpoint: str, prompts: int = 8, new_tokens: int = 48, k: int = 4) -> None:
    """Mode ``eagle3_chain_estimate``: the estimates for an EAGLE-3 ``checkpoint`` of SmolLM2-135M on
    ``prompts`` held-out MT-bench first turns, printed as JSON."""
    torch.set_num_threads(1)
    target = specdec.load_target("smollm2-135m", dtype=torch.float32)
    samples = load_dataset(DatasetConfig(name="mtbench", num_prompts=prompts, turns=1), target.tokenizer)
    asked = [specdec.api.encode_messages(target, [{"role": "user", "content": s.turns[0]}], True) for s in samples]
    drafter = specdec.make_drafter("eagle3", target, checkpoint=checkpoint, tree="chain")
    out = estimates(target, drafter, asked, new_tokens, k)
    print(json.dumps({name: [round(x, 3) for x in v] for name, v in out.items()}))

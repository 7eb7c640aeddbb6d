"""Training data for drafters: the target's own responses to offline prompts (self-distillation).

A drafter is judged by how often the target agrees with it, so it learns best from text the target
itself wrote: each prompt is formatted with the target's chat template and answered by the target
(greedy, through this library's own autoregressive loop, so exactly what it would emit when served).

Prompts come from ShareGPT (first human turns), MT-bench and HumanEval. The benchmark items are
held out: the first :data:`HELD_OUT` ``["mtbench"]`` MT-bench questions and the first
``["humaneval"]`` HumanEval problems are what the benchmark scripts load
(``load_dataset(DatasetConfig(name=..., num_prompts=N))`` takes the first N), so no drafter is
trained on a prompt it is measured on.

Generated sequences are cached once per (model, settings) under ``cache_dir()/distill/`` as
safetensors, so every recipe and every rerun reads the same data.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from specdec.eval.config import DatasetConfig
from specdec.eval.datasets import load_dataset, packaged_file, read_sharegpt
from specdec.models import cache_dir
from specdec.target import Target

__all__ = ["HELD_OUT", "RECIPE_DATA", "DistilledSeq", "FeatureSeq", "training_conversations", "self_distill",
           "recipe_data", "target_features", "extract_features"]

# benchmark items never trained on: the first N of each dataset's file order
HELD_OUT: dict[str, int] = {"mtbench": 40, "humaneval": 82}
# the data every committed SmolLM2 recipe trains on (generated once, then read from the cache)
RECIPE_DATA: dict[str, int] = {"n": 512, "max_new_tokens": 256, "seed": 0}


@dataclass
class DistilledSeq:
    tokens: Tensor  # [T] int64: chat-formatted prompt, then the target's response
    response_start: int  # index of the first response token


@dataclass
class FeatureSeq:
    tokens: Tensor  # [T] int64
    response_start: int
    features: Tensor  # [T, m·D] the chosen hidden states, concatenated in id order
    final: Tensor  # [T, D] post-norm final hidden state (target logits = lm_head(final))


def _save_ragged(path: Path, fields: dict[str, list[Tensor]], response_start: list[int],
                 metadata: dict[str, str] | None = None) -> None:
    """Per-sequence tensors concatenated along dim 0 with their offsets, in one safetensors file
    (written to a temporary name first, so an interrupted run leaves no half file)."""
    lengths = torch.tensor([0] + [t.shape[0] for t in fields["tokens"]])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({**{k: torch.cat(v) for k, v in fields.items()}, "offsets": lengths.cumsum(0),
               "response_start": torch.tensor(response_start)}, str(tmp), metadata=metadata)
    tmp.replace(path)


def _load_ragged(path: Path) -> tuple[dict[str, list[Tensor]], list[int]]:
    """What :func:`_save_ragged` wrote: each field split back into its sequences."""
    data = load_file(str(path))
    off = data.pop("offsets").tolist()
    starts = data.pop("response_start").tolist()
    return {k: [v[a:b] for a, b in zip(off[:-1], off[1:])] for k, v in data.items()}, starts


def training_conversations(n: int, seed: int = 0, max_chars: int = 2000) -> list[list[dict]]:
    """``n`` single-user-turn conversations: every non-held-out MT-bench turn and HumanEval problem,
    then ShareGPT first turns, shuffled with ``seed``. Very long prompts (> ``max_chars``) are skipped."""
    texts: list[str] = []
    mt = load_dataset(DatasetConfig(name="mtbench", num_prompts=10_000, turns=2))[HELD_OUT["mtbench"]:]
    texts += [t for s in mt for t in s.turns]
    texts += [s.turns[0] for s in load_dataset(DatasetConfig(name="humaneval", num_prompts=10_000))[HELD_OUT["humaneval"]:]]
    for conv in read_sharegpt(packaged_file("sharegpt")):
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value"):
            texts.append(turns[0]["value"])
        if len(texts) >= 4 * n:
            break
    texts = [t for t in texts if 0 < len(t) <= max_chars]
    random.Random(seed).shuffle(texts)
    if len(texts) < n:
        raise ValueError(f"only {len(texts)} offline prompts are available, {n} were asked for")
    return [[{"role": "user", "content": t}] for t in texts[:n]]


def _model_key(target: Target) -> str:
    """Identifies the target's weights cheaply: its config and a checksum of a few parameters."""
    h = hashlib.sha1(json.dumps(target.config.to_dict(), sort_keys=True, default=str).encode())
    for p in list(target.model.parameters())[:4]:
        h.update(p.detach().float().sum().item().hex().encode())
    return h.hexdigest()[:12]


def self_distill(target: Target, n: int, max_new_tokens: int = 256, seed: int = 0, batch: int = 16,
                 max_prompt_tokens: int = 384, path: str | Path | None = None) -> list[DistilledSeq]:
    """The target's greedy responses to ``n`` training conversations; cached on disk.

    Generation runs through :func:`specdec.loop.run` with no drafter (ragged batches, per-row EOS),
    prompts sorted by length so a batch wastes little. Prompts longer than ``max_prompt_tokens`` are
    cut from the left (the question's end carries the instruction).
    """
    from specdec.api import encode_messages
    from specdec.loop import Request, run
    from specdec.verifiers import GreedyVerifier

    key = f"{_model_key(target)}-n{n}-new{max_new_tokens}-s{seed}-p{max_prompt_tokens}"
    file = Path(path) if path else cache_dir() / "distill" / f"{key}.safetensors"
    if file.exists():
        fields, starts = _load_ragged(file)
        return [DistilledSeq(t, s) for t, s in zip(fields["tokens"], starts)]

    prompts = [encode_messages(target, c, chat=True)[-max_prompt_tokens:] for c in training_conversations(n, seed)]
    order = sorted(range(n), key=lambda i: len(prompts[i]))
    answers: dict[int, list[int]] = {}
    for lo in tqdm(range(0, n, batch), desc="self-distill"):
        idx = order[lo: lo + batch]
        reqs = [Request(prompts[i], max_new_tokens) for i in idx]
        with torch.inference_mode():
            out = run(target, None, GreedyVerifier(), reqs, k=1)
        answers.update({i: r.tokens for i, r in zip(idx, out.requests)})
    seqs = [DistilledSeq(torch.tensor(prompts[i] + answers[i], dtype=torch.long), len(prompts[i])) for i in range(n)]

    _save_ragged(file, {"tokens": [s.tokens for s in seqs]}, [s.response_start for s in seqs],
                 metadata={"max_new_tokens": str(max_new_tokens), "seed": str(seed)})
    return seqs


def recipe_data(target: Target) -> list[DistilledSeq]:
    """The committed recipes' data: :data:`RECIPE_DATA` through :func:`self_distill` (load the target
    in fp32, as served: the cache key includes the dtype)."""
    return self_distill(target, batch=64, **RECIPE_DATA)


@torch.no_grad()  # not inference_mode: training code uses these tensors next to autograd
def target_features(target: Target, tokens: Tensor, hs_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Hidden states of one sequence: ``output_hidden_states`` entries ``hs_ids`` ``[T, m, D]``
    (entry ``i`` = the input of layer ``i``) and the post-norm final hidden state ``[T, D]``
    (``target.lm_head(final)`` gives the target's logits)."""
    if any(not 0 <= i <= target.num_layers for i in hs_ids):
        raise ValueError(f"hidden-state ids {hs_ids} outside [0, {target.num_layers}]")
    out = target.decoder(input_ids=tokens.view(1, -1).to(target.device), output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    picked = torch.stack([hs[i][0] for i in hs_ids], dim=1) if hs_ids else tokens.new_zeros(0)
    return picked, out.last_hidden_state[0]


def extract_features(target: Target, seqs: list[DistilledSeq], hs_ids: list[int] | tuple[int, ...],
                     path: Path | None = None, max_len: int | None = None,
                     dtype: torch.dtype = torch.bfloat16) -> list[FeatureSeq]:
    """:func:`target_features` of every sequence (cut to ``max_len`` tokens), one at a time (no
    padding), stored in ``dtype``; cached at ``path`` when given, read back from it when it exists."""
    if path is not None and path.exists():
        fields, starts = _load_ragged(path)
        return [FeatureSeq(t, s, f, h) for t, s, f, h in zip(fields["tokens"], starts, fields["features"], fields["final"])]
    out = []
    for s in tqdm(seqs, desc="target features"):
        tokens = s.tokens[:max_len]
        hs, final = target_features(target, tokens, list(hs_ids))
        out.append(FeatureSeq(tokens, s.response_start, hs.flatten(1).to(dtype), final.to(dtype)))
    if path is not None:
        _save_ragged(path, {"tokens": [f.tokens for f in out], "features": [f.features for f in out],
                            "final": [f.final for f in out]}, [f.response_start for f in out])
    return out

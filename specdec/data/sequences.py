"""Token sequences for training: a prompt and the target's answer, the held-out rule for them, stored.

A sequence is what every data source gives (:mod:`specdec.data.corpus`, the distilled answers here,
the standard library's windows in :mod:`specdec.data.text`); it carries no target features.
:func:`held_out_seq` is the one held-out rule for prompt/response sequences, by the whole prompt, so a
sequence never moves between the splits when its prompt is cut or the data set grows.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from specdec.data.config import DatasetConfig
from specdec.data.datasets import HELD_OUT, held_out, load_dataset, packaged_file, read_sharegpt
from specdec.models import cache_dir
from specdec.target import Target

__all__ = ["TokenSeq", "held_out_seq", "save_ragged", "load_ragged", "cut_prompt", "save_sequences", "load_sequences", "training_conversations",
           "model_key", "self_distill"]


@dataclass
class TokenSeq:
    tokens: Tensor  # [T] int64: chat-formatted prompt, then the target's response (or plain text)
    response_start: int  # index of the first response token (0 for plain text)
    features: dict[str, Tensor] = field(default_factory=dict)  # cached target features {name: [T, ...]}
    store_index: int | None = None  # its row in a feature store (specdec.data.store), if it came from one


# --- stored and distilled sequences --------------------------------------------------------------------------

def save_ragged(path: Path, fields: dict[str, list[Tensor]], response_start: list[int],
                 metadata: dict[str, str] | None = None) -> None:
    """Per-sequence tensors concatenated along dim 0 with their offsets, in one safetensors file
    (written to a temporary name first, so an interrupted run leaves no half file)."""
    lengths = torch.tensor([0] + [t.shape[0] for t in fields["tokens"]])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({**{k: torch.cat(v).contiguous() for k, v in fields.items()}, "offsets": lengths.cumsum(0),
               "response_start": torch.tensor(response_start)}, str(tmp), metadata=metadata)
    tmp.replace(path)


def load_ragged(path: Path) -> tuple[dict[str, list[Tensor]], list[int]]:
    """What :func:`save_ragged` wrote: each field split back into its sequences."""
    data = load_file(str(path))
    off = data.pop("offsets").tolist()
    starts = data.pop("response_start").tolist()
    return {k: [v[a:b] for a, b in zip(off[:-1], off[1:])] for k, v in data.items()}, starts


def save_sequences(path: str | Path, seqs: list[TokenSeq], metadata: dict[str, str] | None = None) -> None:
    """A data set as one safetensors file: token ids and each sequence's prompt/response split."""
    save_ragged(Path(path), {"tokens": [s.tokens for s in seqs]}, [s.response_start for s in seqs], metadata)


def load_sequences(path: str | Path) -> list[TokenSeq]:
    """What :func:`save_sequences` (or :func:`self_distill`) wrote."""
    fields, starts = load_ragged(Path(path))
    return [TokenSeq(t, s) for t, s in zip(fields["tokens"], starts)]


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


def model_key(target: Target) -> str:
    """Identifies the target's weights cheaply: its config and a checksum of a few parameters."""
    h = hashlib.sha1(json.dumps(target.config.to_dict(), sort_keys=True, default=str).encode())
    for p in list(target.model.parameters())[:4]:
        h.update(p.detach().float().sum().item().hex().encode())
    return h.hexdigest()[:12]


def self_distill(target: Target, n: int, max_new_tokens: int = 256, seed: int = 0, batch: int = 16,
                 max_prompt_tokens: int = 384, path: str | Path | None = None, progress: bool = True) -> list[TokenSeq]:
    """The target's greedy responses to ``n`` training conversations; cached on disk.

    Generation runs through :func:`specdec.loop.run` with no drafter (ragged batches, per-row EOS),
    prompts sorted by length so a batch wastes little. Prompts longer than ``max_prompt_tokens`` are
    cut from the left (the question's end carries the instruction).
    """
    from specdec.api import encode_messages
    from specdec.loop import Request, run
    from specdec.verifiers import GreedyVerifier

    key = f"{model_key(target)}-n{n}-new{max_new_tokens}-s{seed}-p{max_prompt_tokens}"
    file = Path(path) if path else cache_dir() / "distill" / f"{key}.safetensors"
    if file.exists():
        return load_sequences(file)

    prompts = [encode_messages(target, c, chat=True)[-max_prompt_tokens:] for c in training_conversations(n, seed)]
    order = sorted(range(n), key=lambda i: len(prompts[i]))
    answers: dict[int, list[int]] = {}
    for lo in tqdm(range(0, n, batch), desc="self-distill", disable=not progress):
        idx = order[lo: lo + batch]
        reqs = [Request(prompts[i], max_new_tokens) for i in idx]
        with torch.inference_mode():
            out = run(target, None, GreedyVerifier(), reqs, k=1)
        answers.update({i: r.tokens for i, r in zip(idx, out.requests)})
    seqs = [TokenSeq(torch.tensor(prompts[i] + answers[i], dtype=torch.long), len(prompts[i])) for i in range(n)]

    save_sequences(file, seqs, {"max_new_tokens": str(max_new_tokens), "seed": str(seed)})
    return seqs


def held_out_seq(seq: TokenSeq, every: int) -> bool:
    """The one held-out rule for a prompt/response sequence: by its whole prompt's token ids."""
    return held_out(",".join(map(str, seq.tokens[: seq.response_start].tolist())), every)


def cut_prompt(seq: TokenSeq, max_prompt: int | None, max_len: int | None) -> TokenSeq:
    """``seq`` with only its last ``max_prompt`` prompt tokens, then cut to ``max_len`` tokens."""
    drop = max(0, seq.response_start - max_prompt) if max_prompt is not None else 0
    return TokenSeq(seq.tokens[drop:][:max_len], seq.response_start - drop)

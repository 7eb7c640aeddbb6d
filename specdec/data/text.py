"""Offline plain text for a model trained from scratch (the tiny DeepSeek-V3 MTP recipe).

- CPython's own standard library source (``sysconfig.get_paths()["stdlib"]``), split into train and
  held-out files by :func:`specdec.data.datasets.held_out` on the file name, so every machine gets
  the same split.
- A byte-level BPE tokenizer trained with ``tokenizers`` and wrapped as a transformers fast tokenizer.
- The token stream cut into windows, the training sequences of :mod:`specdec.training.data`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from specdec.data.datasets import stdlib_files

__all__ = ["stdlib_files", "train_tokenizer", "encode_files", "windows"]

EOS = "<|endoftext|>"


def train_tokenizer(files: list[Path], vocab_size: int):
    """A byte-level BPE tokenizer (``tokenizers``), as a ``PreTrainedTokenizerFast`` with EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in files], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)


def encode_files(tokenizer, files: list[Path]) -> Tensor:
    """All files as one token stream, each followed by EOS. [N] int64"""
    ids: list[int] = []
    for f in files:
        ids += tokenizer.encode(f.read_text(encoding="utf-8", errors="replace"))
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: Tensor, length: int) -> list[Tensor]:
    """The stream cut into consecutive windows of ``length`` tokens (the tail shorter than that is dropped)."""
    return list(stream[: stream.numel() // length * length].view(-1, length))

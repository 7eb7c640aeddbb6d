"""Small training helpers shared by the MTP recipes (``experiments/train_mtp.py``).

- Offline text: CPython's own standard library source (``sysconfig.get_paths()["stdlib"]``), split
  into train and held-out files by a hash of the file name, so every machine gets the same split.
- A byte-level BPE tokenizer trained with ``tokenizers`` and wrapped as a transformers fast tokenizer.
- Random training windows from a seeded generator.
- The DeepSeek-V3 MTP loss (arXiv 2412.19437 §2.2): depth ``d`` at slot ``i`` reads ``emb(t_{i+d})``
  and depth ``d-1``'s representation at slot ``i`` and predicts ``t_{i+d+1}``;
  ``L = CE_main + λ/D · Σ_d CE_d``.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["stdlib_files", "train_tokenizer", "encode_files", "random_windows", "MTPLoss", "mtp_loss"]

EOS = "<|endoftext|>"


def stdlib_files(split: str = "train", heldout_every: int = 20) -> list[Path]:
    """The standard library's top-level ``*.py`` files; one in ``heldout_every`` (by name hash) is held out."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    held = [int(hashlib.sha1(f.name.encode()).hexdigest(), 16) % heldout_every == 0 for f in files]
    return [f for f, h in zip(files, held) if h == (split == "heldout")]


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


def random_windows(stream: Tensor, batch: int, length: int, gen: torch.Generator) -> Tensor:
    """``batch`` random windows of ``length`` tokens. [batch, length]"""
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=gen)
    return torch.stack([stream[s: s + length] for s in starts.tolist()])


@dataclass
class MTPLoss:
    loss: Tensor
    main_ce: float
    mtp_ce: list[float]  # per depth
    main_acc: float
    mtp_acc: list[float]  # top-1 accuracy per depth


def mtp_loss(window: Tensor, hidden: Tensor, modules: nn.ModuleList, embed: nn.Module, head: nn.Module,
             rotary: nn.Module, lam: float = 0.3, main_logits: Tensor | None = None,
             chain_hidden: str = "normed") -> MTPLoss:
    """DeepSeek-V3's main + MTP loss on ``window`` [B, T+1] (inputs are the first T tokens).

    ``hidden`` [B, T, D] is the target's post-norm final hidden state on ``window[:, :T]``;
    ``main_logits`` [B, T, V] adds the main CE (None: a frozen target, MTP loss only).
    """
    T, D = hidden.shape[1], len(modules)
    total = hidden.new_zeros(())
    main_ce = main_acc = 0.0
    if main_logits is not None:
        ce = F.cross_entropy(main_logits.flatten(0, 1).float(), window[:, 1:].flatten())
        total = total + ce
        main_ce, main_acc = float(ce), float((main_logits.argmax(-1) == window[:, 1:]).float().mean())
    prev, ces, accs = hidden, [], []
    for d, module in enumerate(modules, start=1):
        n = T - d  # slots 0..T-d-1 have a label t_{i+d+1}
        pos = torch.arange(d, d + n, device=window.device).unsqueeze(0).expand(window.shape[0], -1)
        emb = embed(window[:, d: d + n])
        residual, normed = module(emb, prev[:, :n], rotary(emb, pos), pos)  # no mask: causal
        logits = head(normed).float()
        labels = window[:, d + 1: d + 1 + n]
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        ces.append(float(ce))
        accs.append(float((logits.argmax(-1) == labels).float().mean()))
        total = total + lam / D * ce
        prev = normed if chain_hidden == "normed" else residual
    return MTPLoss(total, main_ce, ces, main_acc, accs)

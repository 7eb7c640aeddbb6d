"""A draft vocabulary for drafters that draft through the target's own LM head (FR-Spec).

A drafter that reads the target's head (post-hoc MTP, DFlash, DSpark) pays for all of its rows on
every draft token: for SmolLM2 a 49,152-row product that is most of a one-token draft step. Ranked
by how often the target writes each token, the first few thousand ids cover almost every token it
writes; drafting over those rows only (:meth:`specdec.target.Target.logits` with ``vocab=``) reads a
fraction of the head. Tokens outside are never proposed (draft probability 0), which verification
treats like any other proposal, so the output stays the target's; the price is acceptance wherever
the target's next token lies outside the kept ids.

A **token map** is a safetensors file holding ``token_ids`` [n] (int32): target token ids, most
frequent first. SGLang's ``--speculative-token-map`` carries the same ids as a pickled tensor, which
this library does not read (checkpoints and maps are never unpickled).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from specdec.paths import repo_path
from specdec.validate import as_int

__all__ = ["token_counts", "rank_tokens", "save_token_map", "read_token_map", "draft_vocabulary", "vocab_positions",
           "coverage"]

KEY = "token_ids"


def token_counts(seqs: Iterable[Any], vocab_size: int) -> Tensor:
    """How often each token appears in the responses of ``seqs`` (anything with ``tokens`` [T] and
    ``response_start``): what a draft must propose. [V] int64"""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s.tokens[s.response_start:], minlength=vocab_size)
    return counts


def rank_tokens(counts: Tensor) -> Tensor:
    """The ids that occur in ``counts`` [V], most frequent first (ties: the lower id first). [n] int64"""
    order = torch.sort(-counts.double(), stable=True).indices
    return order[: int((counts > 0).sum())]


def save_token_map(path: str | Path, ranked: Tensor, metadata: dict[str, str] | None = None) -> None:
    """Write ranked token ids [n] as a token map (int32 ``token_ids``, with ``metadata`` strings)."""
    save_file({KEY: ranked.to(torch.int32).contiguous()}, str(path), metadata=metadata)


def read_token_map(path: str | Path) -> Tensor:
    """The ranked ids of a token map file (a repository path such as ``experiments/data/...`` is found
    from any working directory: :func:`specdec.paths.repo_path`). [n] int64"""
    path = repo_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token_map: no file {str(path)!r}")
    with safe_open(str(path), framework="pt") as f:
        if KEY not in f.keys():
            raise ValueError(f"token_map {str(path)!r} holds no {KEY!r} tensor (it has {sorted(f.keys())})")
        return f.get_tensor(KEY).long()


def draft_vocabulary(token_map: str | Path | Sequence[int] | Tensor | None, size: Any, vocab_size: int
                     ) -> Tensor | None:
    """The first ``size`` ids (0: all) of ``token_map`` (a token map file, or the ranked ids
    themselves), sorted, int64; None without a map. Checked here, before any work: ids within
    the vocabulary and distinct, ``size`` an integer no larger than the map."""
    size = as_int("draft_vocab", size, minimum=0)
    if token_map is None or (isinstance(token_map, (str, Path)) and not str(token_map)):
        if size:
            raise ValueError(f"draft_vocab={size} needs a token_map (the ranked ids it takes the first of)")
        return None
    if isinstance(token_map, (str, Path)):
        ids = read_token_map(token_map)
    elif isinstance(token_map, Tensor):
        if token_map.dim() != 1 or token_map.dtype.is_floating_point or token_map.dtype == torch.bool:
            raise TypeError(f"token_map must be a 1-D integer tensor, got {token_map.dtype} {tuple(token_map.shape)}")
        ids = token_map.long().cpu()
    else:
        ids = torch.tensor([as_int("token_map id", i) for i in token_map], dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError("token_map holds no ids")
    if size > ids.numel():
        raise ValueError(f"draft_vocab={size} is more than the token map's {ids.numel()} ids")
    ids = ids[: size or None]
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"token_map ids must lie in [0, {vocab_size}), got {int(ids.min())}..{int(ids.max())}")
    kept = ids.sort().values
    if bool((kept[1:] == kept[:-1]).any()):
        raise ValueError("token_map ids must be distinct")
    return kept


def vocab_positions(ids: Tensor, vocab_size: int) -> Tensor:
    """Each target token's place in the draft vocabulary ``ids`` [S] (-1 outside it), on ``ids``'s
    device: maps labels to the columns of logits over those rows. [vocab_size] int64"""
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
    index[ids] = torch.arange(ids.numel(), device=ids.device)
    return index


def coverage(counts: Tensor, ids: Tensor) -> float:
    """The share of the counted tokens that ``ids`` covers."""
    return float(counts[ids].sum()) / max(float(counts.sum()), 1.0)

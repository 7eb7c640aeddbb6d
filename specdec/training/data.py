"""Training data for drafters: one pipeline, one held-out rule, for every recipe.

**Sequences.** A drafter is judged by how often the target agrees with it, so it learns best from
text the target itself wrote: ``source: distill`` formats offline prompts with the target's chat
template and has the target answer them (greedy, through this library's own loop, so exactly what
it would emit when served), cached once per (model, settings) under ``cache_dir()/distill/``.
Prompts come from ShareGPT (first human turns), MT-bench and HumanEval. ``source: corpus`` reads the
committed corpus instead (:mod:`specdec.data.corpus`: every ShareGPT turn, greedy and sampled
answers, grown in shards), so nobody regenerates it; ``max_prompt`` keeps only the end of each
prompt, since the losses read responses and features cost per token. A model trained from
scratch, which has no answers of its own, reads ``source: stdlib``: Python's standard library source
(:mod:`specdec.data.text`), cut into windows of ``window`` tokens.

**Held out, two ways, each by one rule.**

- Benchmark items are never trained on: the first :data:`specdec.data.datasets.HELD_OUT` ``["mtbench"]`` MT-bench
  questions and the first ``["humaneval"]`` HumanEval problems are what the benchmarks load
  (``load_dataset(DatasetConfig(name=..., num_prompts=N))`` takes the first N), so they are
  left out of the prompts.
- The held-out figures a run records come from items that :func:`specdec.data.datasets.held_out` marks: an item whose
  name (a distilled sequence's prompt tokens, a standard-library file's name) hashes to 0 modulo
  ``held_out_every``. The rule depends on the item alone, so an item stays held out when the data
  set grows and every recipe holds out the same prompts.

**Batches and features.** :class:`TrainData` draws training sequences in seeded epochs (a pure
function of the step, so a resumed run draws what an uninterrupted one would) and pads them into a
:class:`Batch` with the target features the recipe asks for (:meth:`Recipe.featurize`), computed
once and cached as safetensors (``cache_features``) or per batch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm import tqdm

from specdec.data.sequences import (TokenSeq, cut_prompt, held_out_seq, load_ragged, load_sequences, model_key,
                                    save_ragged, self_distill)
from specdec.data.store import FeatureStore, StoredRow, StoreNeeds
from specdec.models import cache_dir
from specdec.target import Target
from specdec.training.config import DataConfig

__all__ = ["FeatureSeq", "Batch", "TrainData", "target_features", "make_batch", "load_data"]


Featurize = Callable[[Tensor], dict[str, Tensor]]  # tokens [B, T] -> {name: [B, T, ...]}


@dataclass
class FeatureSeq:
    """One sequence with the features the layer-input recipes read (EAGLE-3's training-time test)."""

    tokens: Tensor  # [T] int64
    response_start: int
    features: Tensor  # [T, m·D] the chosen hidden states, concatenated in id order
    final: Tensor  # [T, D] post-norm final hidden state (target logits = target.logits(final))


@dataclass
class Batch:
    tokens: Tensor  # [B, T] int64, right-padded with 0
    lengths: Tensor  # [B]
    response_start: Tensor  # [B]
    features: dict[str, Tensor]  # {name: [B, T, ...]}, zero past each row's length
    # lengths and response starts as the batch was made, on the host: what a loss sizes or draws
    # anchors from without reading the device (None: lengths and response_start are the host's)
    host: tuple[Tensor, Tensor] | None = None

    def to(self, device: torch.device) -> Batch:
        return Batch(self.tokens.to(device), self.lengths.to(device), self.response_start.to(device),
                     {k: v.to(device) for k, v in self.features.items()}, self.on_host())

    def on_host(self) -> tuple[Tensor, Tensor]:
        """(lengths, response_start) on the host, without a device read when the batch was made there."""
        return self.host if self.host is not None else (self.lengths.cpu(), self.response_start.cpu())

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def num_response_tokens(self) -> int:
        return int((self.lengths - self.response_start).clamp(min=0).sum())

    def feature_seq(self, b: int) -> FeatureSeq:
        """Row ``b`` cut to its length, with the ``features`` and ``final`` entries."""
        n = int(self.lengths[b])
        return FeatureSeq(self.tokens[b, :n], int(self.response_start[b]), self.features["features"][b, :n],
                          self.features["final"][b, :n])


def make_batch(seqs: list[TokenSeq], featurize: Featurize | None = None) -> Batch:
    """Right-pad ``seqs`` into a batch: their cached features stacked, or ``featurize`` run on the
    padded tokens (a causal target gives every row's real positions exactly)."""
    lengths = torch.tensor([s.tokens.numel() for s in seqs], device="cpu")  # batches are made on the host
    T = int(lengths.max())
    tokens = torch.zeros(len(seqs), T, dtype=torch.long, device="cpu")
    for b, s in enumerate(seqs):
        tokens[b, : s.tokens.numel()] = s.tokens
    if seqs[0].features:
        feats = {}
        for name, first in seqs[0].features.items():
            out = first.new_zeros(len(seqs), T, *first.shape[1:])
            for b, s in enumerate(seqs):
                out[b, : s.tokens.numel()] = s.features[name]
            feats[name] = out
    else:
        feats = featurize(tokens) if featurize is not None else {}
    return Batch(tokens, lengths, torch.tensor([s.response_start for s in seqs], device="cpu"), feats)


class TrainData:
    """Training and held-out sequences, drawn into batches."""

    def __init__(self, train: list[TokenSeq], held: list[TokenSeq], featurize: Featurize | None = None,
                 tokenizer=None, row_features: Callable[[TokenSeq], dict[str, Tensor]] | None = None):
        if not train:
            raise ValueError("no training sequences")
        self.train, self.held, self.featurize, self.tokenizer = train, held, featurize, tokenizer
        self.row_features = row_features  # a sequence's features, read when its batch is made (a feature store)
        self._perm: tuple[tuple[int, int] | None, list[int]] = (None, [])

    def indices(self, start: int, count: int, seed: int) -> list[int]:
        """Training sequences ``start .. start+count-1`` of the run: epoch ``e`` is a permutation
        seeded by ``(seed, e)``, so the draw is a function of the position alone."""
        n = len(self.train)
        return [self._epoch(seed, c // n)[c % n] for c in range(start, start + count)]

    def _epoch(self, seed: int, epoch: int) -> list[int]:
        if self._perm[0] != (seed, epoch):  # one permutation kept: batches walk through epochs in order
            gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            self._perm = ((seed, epoch), torch.randperm(len(self.train), generator=gen).tolist())
        return self._perm[1]

    def batch(self, seqs: list[TokenSeq]) -> Batch:
        if self.row_features is not None:
            seqs = [TokenSeq(s.tokens, s.response_start, self.row_features(s), s.store_index) for s in seqs]
        return make_batch(seqs, self.featurize)

    def scan(self, split: str = "train", batch: int = 8, limit: int | None = None) -> Iterator[Batch]:
        """The first ``limit`` sequences of ``split`` in order, ``batch`` at a time."""
        seqs = (self.train if split == "train" else self.held)[:limit]
        for lo in range(0, len(seqs), batch):
            yield self.batch(seqs[lo: lo + batch])


def target_features(target: Target, tokens: Tensor, layer_inputs: list[int] | tuple[int, ...]) -> dict[str, Tensor]:
    """What the layer-reading recipes train on, through the target's seam: ``features`` [B, T, m·D]
    (the inputs of ``layer_inputs``, concatenated in that order; empty when none) and ``final``
    [B, T, D] (the post-norm final hidden state: ``target.logits(final)`` is the target's logits)."""
    hidden, final = target.features(tokens, layer_inputs)
    out = {"final": final}
    if layer_inputs:
        out["features"] = torch.cat([hidden[i] for i in layer_inputs], -1)
    return out


# --- the one entry point ---------------------------------------------------------------------------

def _sequences(cfg: DataConfig, target: Target | None, progress: bool) -> tuple[list[TokenSeq], list[TokenSeq], object]:
    """(train, held-out, tokenizer) before features, by the one held-out rule."""
    if cfg.source == "stdlib":
        from specdec.data.text import encode_files, stdlib_files, train_tokenizer, windows

        files = stdlib_files("train", cfg.held_out_every)[: cfg.max_files]
        held_files = stdlib_files("heldout", cfg.held_out_every)
        tokenizer = target.tokenizer if target is not None else train_tokenizer(files, cfg.vocab_size)
        train, held = ([TokenSeq(w, 0) for w in windows(encode_files(tokenizer, fs), cfg.window)]
                       for fs in (files, held_files))
        return train[: cfg.use], held, tokenizer
    if cfg.source == "corpus":
        from specdec.data.corpus import read_corpus

        seqs = [TokenSeq(s.tokens, s.response_start) for s in read_corpus(cfg.path)]
        if not seqs:
            raise ValueError(f"no corpus shards (shard-*.safetensors) in {cfg.path}")
    elif cfg.path:
        seqs = load_sequences(cfg.path)
    elif target is None:
        raise ValueError("data.source=distill needs a target to answer the prompts (or data.path)")
    else:
        seqs = self_distill(target, cfg.sequences, cfg.max_new_tokens, cfg.seed, batch=64, progress=progress)
    seqs = seqs[: cfg.use]
    split = [held_out_seq(s, cfg.held_out_every) for s in seqs]  # before any cut: by the whole prompt
    seqs = [cut_prompt(s, cfg.max_prompt, cfg.max_len) for s in seqs]
    return ([s for s, h in zip(seqs, split) if not h], [s for s, h in zip(seqs, split) if h],
            target.tokenizer if target is not None else None)


def load_data(cfg: DataConfig, target: Target | None, featurize: Featurize | None = None,
              feature_key: str | None = None, progress: bool = False,
              store_featurize: Callable[[object, Tensor], dict[str, Tensor]] | None = None,
              needs: StoreNeeds | None = None) -> TrainData:
    """Training and held-out sequences for a recipe, with its features.

    ``featurize`` computes the recipe's target features (None: it reads none). With
    ``cfg.cache_features`` they are computed once per sequence (no padding) and stored under
    ``cache_dir()/features/``, keyed by the target's weights, the data settings, the sequences'
    tokens (a corpus folder that grew is other data under the same settings) and ``feature_key``
    (what ``featurize`` computes); otherwise each batch computes its own. With ``cfg.store`` the
    sequences and features come from a feature store instead: ``store_featurize`` (the recipe's
    ``featurize``) reads each sequence's rows through a :class:`~specdec.data.store.StoredRow`
    when its batch is made, after the store is checked against the target and ``needs``.
    """
    if cfg.store:
        assert target is not None, "a feature store is read for a target"
        return _store_data(cfg, target, store_featurize, needs)
    train, held, tokenizer = _sequences(cfg, target, progress)
    dtype = getattr(torch, cfg.feature_dtype)
    if target is not None and target.dtype != dtype:
        target.model.to(dtype)  # after the data: the distillation cache is keyed on the served weights
    if featurize is None or not cfg.cache_features:
        return TrainData(train, held, featurize, tokenizer)
    assert target is not None and feature_key is not None, "cached features need a target and a feature key"
    settings = {k: v for k, v in vars(cfg).items() if k != "cache_features"}
    every = train + held
    tokens = hashlib.sha1()
    for s in every:
        tokens.update(s.tokens.numpy().tobytes() + b"|")
    key = hashlib.sha1(json.dumps([model_key(target), settings, feature_key, tokens.hexdigest()],
                                  sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / "features" / f"{feature_key}-{key}.safetensors"
    if path.exists():
        fields, _ = load_ragged(path)
        if not all(torch.equal(a, s.tokens) for a, s in zip(fields.pop("tokens"), every)):
            raise ValueError(f"{path} holds other sequences than this data set: delete it")
        for i, s in enumerate(every):
            s.features = {name: v[i] for name, v in fields.items()}
    else:
        for s in tqdm(every, desc="target features", disable=not progress):  # kept on the host, as when read back
            s.features = {k: v[0].to("cpu", dtype) if v.is_floating_point() else v[0].cpu()
                          for k, v in featurize(s.tokens.unsqueeze(0)).items()}
        save_ragged(path, {"tokens": [s.tokens for s in every],
                            **{k: [s.features[k] for s in every] for k in every[0].features}},
                     [s.response_start for s in every])
    return TrainData(train, held, None, tokenizer)


def _store_data(cfg: DataConfig, target: Target, featurize: Callable[[object, Tensor], dict[str, Tensor]] | None,
                needs: StoreNeeds | None) -> TrainData:
    """The store's sequences (its own held-out marks, checked to be the run's rule), each batch's
    features read from its rows: the target never runs."""
    store = FeatureStore(cfg.store)  # type: ignore[arg-type]
    store.check(target, needs, cfg.held_out_every)
    known = {s["name"] for s in store.manifest["sources"]}
    if cfg.store_sources is not None and not set(cfg.store_sources) <= known:
        raise ValueError(f"data.store_sources {cfg.store_sources}: {cfg.store} holds sources {sorted(known)}")
    idx = [i for i in range(len(store.sequences)) if cfg.store_sources is None or store.source[i] in cfg.store_sources]
    chosen = set(idx[cfg.skip:][: cfg.use])  # training reads these; held-out figures every held-out sequence
    idx = [i for i in idx if i in chosen or store.held[i]]
    seqs = {i: TokenSeq(store.sequences[i].tokens[: cfg.max_len], store.sequences[i].response_start, store_index=i)
            for i in idx}
    dtype = getattr(torch, cfg.feature_dtype)
    if target.dtype != dtype:
        target.model.to(dtype)

    def row_features(s: TokenSeq) -> dict[str, Tensor]:
        if featurize is None:
            return {}
        row = StoredRow(target, store, s.store_index)  # type: ignore[arg-type]
        full = store.sequences[s.store_index].tokens  # type: ignore[index]
        out = featurize(row, full.unsqueeze(0))
        n = s.tokens.numel()
        return {k: (v[0, :n].to("cpu", dtype) if v.is_floating_point() else v[0, :n].cpu()) for k, v in out.items()}

    train = [seqs[i] for i in idx if i in chosen and not store.held[i]]
    return TrainData(train, [seqs[i] for i in idx if store.held[i]], None, target.tokenizer,
                     row_features if featurize is not None else None)

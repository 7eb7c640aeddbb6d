"""What a drafter family gives the trainer: its model builder, its loss, its checkpoint writer and reader.

A family's room holds one :class:`Recipe` subclass in ``drafters/<family>/train.py``; the run
configuration names it by dotted path (``recipe: specdec.drafters.eagle3.train.Eagle3Recipe``) and
fills its ``Options`` dataclass from ``options``. The trainer (:mod:`specdec.training.trainer`)
owns everything else: data, optimiser, schedule, precision, resumption, evaluation and metadata.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from specdec.data.store import StoreNeeds
from specdec.target import Target
from specdec.training.data import Batch, TrainData

__all__ = ["Recipe", "StepOutput", "load_recipe", "head_rows", "forward_kl", "copy_weights", "draw_anchors",
           "batch_anchors", "masked_mean"]

Metric = float | list[float]


@dataclass
class StepOutput:
    loss: Tensor  # scalar, what the optimiser minimises
    metrics: dict[str, Metric]  # recorded figures: "accept" is the per-position acceptance estimate


class Recipe(ABC):
    """One drafter family's training: subclass it in the family's room and set ``Options``."""

    Options: ClassVar[type]  # a dataclass of the recipe's own settings (unknown keys fail)

    def __init__(self, options: Any):
        self.options = options

    def feature_key(self, target: Target) -> str | None:
        """A name for what :meth:`featurize` computes on this target (the cache key); None: nothing."""
        return None

    def featurize(self, target: Target, tokens: Tensor) -> dict[str, Tensor]:
        """The target features one batch of sequences needs, through the target's seam
        (:func:`~specdec.training.data.target_features`, :func:`~specdec.data.store.target_kv`):
        tokens [B, T] → {name: [B, T, ...]}. Computed once and cached, or per batch; with a feature
        store ``target`` is a :class:`~specdec.data.store.StoredRow` that reads them from disk."""
        return {}

    def store_needs(self, target: Target) -> StoreNeeds:
        """The hidden states (layer-input ids) and K/V layers :meth:`featurize` reads: what a feature
        store must hold for this recipe (the final hidden state is always stored)."""
        return StoreNeeds()

    @abstractmethod
    def build(self, target: Target | None, data: TrainData) -> nn.Module:
        """The trainable model, initialised (the trainer seeds the global RNG first); the
        parameters that require grad are the ones trained. ``target`` is None when the recipe
        trains a model of its own from scratch (``target: null`` in the config). The recipe may
        keep on ``self`` what :meth:`loss` needs (the target, its LM-head rows ...); a resumed run
        calls ``build`` again on the same data, so that must be a function of it."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Batch, gen: torch.Generator) -> StepOutput:
        """The loss of one batch; random draws (anchors ...) come from ``gen`` only. The trainer
        also calls it, under ``no_grad`` with ``model.training`` False, for the held-out figures."""

    def finish(self, model: nn.Module, data: TrainData, gen: torch.Generator) -> dict[str, Any]:
        """After the last step, before saving (e.g. calibrating on held-out data); figures to record."""
        return {}

    @abstractmethod
    def save(self, model: nn.Module, out: Path) -> None:
        """Write the checkpoint the family's drafter loads with its ``create(checkpoint=out)``."""

    def load(self, model: nn.Module, folder: Path) -> None:
        """Copy the weights of a checkpoint :meth:`save` wrote (a committed one) into ``model`` as
        :meth:`build` made it, so a new run starts where an earlier one ended (``init=``): more data,
        a new schedule. Shapes must match; :func:`copy_weights` refuses the rest."""
        raise NotImplementedError(f"{type(self).__name__} cannot start from a checkpoint (init=)")


def load_recipe(path: str, options: dict[str, Any]) -> Recipe:
    """The recipe class at dotted ``path`` (``package.module.Class``), built with its options."""
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(f"recipe must be a dotted path package.module.Class, got {path!r}")
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and issubclass(cls, Recipe)):
        raise ValueError(f"{path} is not a Recipe subclass")
    return cls(cls.Options(**options))


def head_rows(target: Target, ids: Tensor | None = None) -> Tensor:
    """The target's LM-head rows for token ``ids`` (all when None), float32 [S, D]: ``hidden @ rows.T``
    is the target's logits over those tokens at a fraction of the full head's cost. Targets whose
    logits go through more than the head (soft-capping) are refused."""
    if getattr(target.text_config, "final_logit_softcapping", None):
        raise ValueError("this target soft-caps its logits: a restricted LM head would not give them")
    w = target.lm_head.weight.detach()
    return (w if ids is None else w[ids]).float()


def forward_kl(logits: Tensor, p: Tensor) -> Tensor:
    """KL(p ‖ softmax(logits)) per position over the last dimension: a drafter learning the target's
    own distribution ``p`` (float32, no grad), as speculators and SpecForge train. [...]"""
    return (p * (p.clamp(min=1e-30).log() - logits.float().log_softmax(-1))).sum(-1)


def copy_weights(model: nn.Module, state: dict[str, Tensor], folder: Path) -> None:
    """``state`` copied into ``model``'s own tensors, in their dtypes and on their devices; a missing,
    unexpected or differently shaped tensor is refused before anything is written."""
    own = model.state_dict()
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    shapes = sorted(k for k in own.keys() & state.keys() if own[k].shape != state[k].shape)
    if missing or unexpected or shapes:
        raise ValueError(f"{folder} does not fit this run's model: missing {missing}, unexpected {unexpected}, "
                         f"other shapes {shapes} (options such as the draft vocabulary or layers must match)")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(state[k])


def draw_anchors(lo: int, hi: int, n: int, gen: torch.Generator) -> Tensor:
    """Up to ``n`` distinct positions in ``[lo, hi]``, sorted, drawn on the generator's device (nothing
    drawn when the range is empty): the anchors every recipe trains its drafts from. [≤ n] int64"""
    if hi < lo:
        return torch.zeros(0, dtype=torch.long, device=gen.device)
    return (torch.randperm(hi - lo + 1, generator=gen, device=gen.device)[:n] + lo).sort().values


def batch_anchors(response_start: Tensor, lengths: Tensor, n: int, gen: torch.Generator,
                  span: Callable[[int, int], tuple[int, int]], pad: int = 0,
                  device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """:func:`draw_anchors` for every row of a batch, in the range ``span(response_start, length)``
    gives it (the recipe's: where a draft has its labels): anchors [B, n] (``pad`` where a row has
    fewer) and which are real [B, n], on ``device``."""
    B, host = len(lengths), gen.device
    anchors = torch.full((B, n), pad, dtype=torch.long, device=host)
    keep = torch.zeros(B, n, dtype=torch.bool, device=host)
    for b, (start, length) in enumerate(zip(response_start.tolist(), lengths.tolist())):
        pick = draw_anchors(*span(start, length), n, gen)
        anchors[b, : pick.numel()], keep[b, : pick.numel()] = pick, True
    return anchors.to(device or host), keep.to(device or host)


def masked_mean(values: Tensor, weight: Tensor, floor: float = 1.0) -> Tensor:
    """``Σ values·weight / max(Σ weight, floor)``: every recipe's loss over the positions (or weighted
    draft slots) it counts; ``weight`` is a mask or per-slot weights of ``values``' shape."""
    return (values * weight).sum() / weight.sum().clamp(min=floor)

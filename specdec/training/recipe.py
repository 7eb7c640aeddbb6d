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

__all__ = ["Recipe", "StepOutput", "as_figures", "load_recipe", "span_positions", "head_rows", "forward_kl", "copy_weights", "draw_anchors",
           "batch_anchors", "masked_mean"]

Metric = float | list[float]  # a recorded figure, as training.json holds it
Figure = Tensor | float | list[float]  # what a loss returns: a 0-d or 1-d tensor kept on the device, or a number


@dataclass
class StepOutput:
    loss: Tensor  # scalar, what the optimiser minimises
    # recorded figures, "accept" the per-position acceptance estimate: tensors stay on the device (the
    # trainer sums them there and reads them once per log interval), so a loss never waits for the device
    metrics: dict[str, Figure]


def as_figures(metrics: dict[str, Figure]) -> dict[str, Metric]:
    """``metrics`` read to the host: numbers and lists, as ``training.json`` records them."""
    return {k: (v.detach().float().tolist() if isinstance(v, Tensor) else v) for k, v in metrics.items()}


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

    def loss_positions(self, lengths: Tensor, response_start: Tensor) -> Tensor | None:
        """Loss positions at draft depth 1 per row (host tensors [B] → [B] int64): how many first
        drafts one pass of the loss trains on rows of these lengths, by the recipe's own definition
        (labels inside the draft vocabulary not required). The trainer reports them against the
        target tokens (``positions_per_token``) and per second; None: the recipe does not say."""
        return None

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
    drawn when the range is empty): the anchors of a single sequence. [≤ n] int64"""
    if hi < lo:
        return torch.zeros(0, dtype=torch.long, device=gen.device)
    return (torch.randperm(hi - lo + 1, generator=gen, device=gen.device)[:n] + lo).sort().values


def span_positions(lo: Tensor, hi: Tensor, n: int) -> Tensor:
    """How many anchors a row with range ``[lo, hi]`` gets: all of them when ``n`` is 0, else up to ``n``. [B]"""
    size = (hi - lo + 1).clamp(min=0)
    return size if n == 0 else size.clamp(max=n)


def batch_anchors(response_start: Tensor, lengths: Tensor, n: int, gen: torch.Generator,
                  span: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]], pad: int = 0,
                  device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """Anchors for every row of a batch in the range ``span(response_start, lengths)`` gives it (the
    recipe's, elementwise on [B] tensors: where a draft has its labels), in one vectorised draw:
    ``n`` distinct positions per row (fewer where the range is smaller), or with ``n = 0`` every
    position of the range (dense). anchors [B, A] sorted, ``pad`` where a row has fewer, and which
    are real [B, A], on ``device``. Random keys come from ``gen`` on its device; nothing is read
    back to the host, whatever the device."""
    host = gen.device
    lo, hi = (t.to(host) for t in span(response_start.to(host), lengths.to(host)))
    size = (hi - lo + 1).clamp(min=0)  # [B]
    width = int(size.max()) if size.numel() else 0  # lengths live on the host: batches are made there
    width = max(width, 0)
    pos = torch.arange(width, device=host)  # offsets into each row's range
    inside = pos.unsqueeze(0) < size.unsqueeze(1)  # [B, W]
    if n and width > n:
        keys = torch.rand(len(size), width, generator=gen, device=host).masked_fill(~inside, 2.0)
        pick = keys.topk(n, dim=1, largest=False).indices.sort(dim=1).values  # n distinct offsets, sorted
        keep = inside.gather(1, pick)
    else:
        pick, keep = pos.expand(len(size), -1), inside
    anchors = torch.where(keep, lo.unsqueeze(1) + pick, torch.full_like(pick, pad))
    return anchors.to(device or host), keep.to(device or host)


def masked_mean(values: Tensor, weight: Tensor, floor: float = 1.0) -> Tensor:
    """``Σ values·weight / max(Σ weight, floor)``: every recipe's loss over the positions (or weighted
    draft slots) it counts; ``weight`` is a mask or per-slot weights of ``values``' shape."""
    return (values * weight).sum() / weight.sum().clamp(min=floor)

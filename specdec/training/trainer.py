"""The one training loop, for every drafter family (each contributes a :class:`~specdec.training.recipe.Recipe`).

    result = train(TrainConfig(recipe="specdec.drafters.eagle3.train.Eagle3Recipe", out="ckpt", ...))

- **Data**: :func:`specdec.training.data.load_data` (one pipeline, one held-out rule), batches drawn
  in seeded epochs.
- **Optimiser**: AdamW over the parameters that require grad; learning rate :func:`lr_at` (linear
  warm-up, then cosine down to ``min_lr · lr``), a pure function of the step; gradient-norm
  clipping; ``accumulate`` micro-batches per step; optional bf16 autocast around the loss.
- **Resumable**: ``work/state.safetensors`` holds the model, the AdamW moments, the step, the
  counters and both random states (the run's generator and torch's global one); safetensors only,
  nothing is ever pickled. A run resumed from it ends bit-identical to one that never stopped.
- **Held-out figures**: the recipe's loss and metrics on the held-out sequences every
  ``eval_every`` steps and at the last step, with a generator of their own (evaluating never
  changes what training draws).
- **One metadata file**, ``training.json`` beside the checkpoint (:class:`TrainingRecord`): git
  revision, the exact command, the resolved config, steps, training tokens, wall time, held-out
  figures, the training log and library versions.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from specdec.provenance import command_line, git_dirty, git_sha, versions
from specdec.target import Target
from specdec.training.config import TrainConfig
from specdec.training.data import TrainData, load_data
from specdec.training.recipe import Metric, Recipe, StepOutput, load_recipe

__all__ = ["lr_at", "train", "TrainResult", "TrainingRecord", "RECORD_FILE", "STATE_FILE"]

RECORD_FILE = "training.json"
STATE_FILE = "state.safetensors"
log = logging.getLogger(__name__)


def lr_at(step: int, steps: int, peak: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    """Linear warm-up over ``warmup · steps`` steps (at least one), then a cosine from ``peak`` down
    to ``floor · peak`` at the last step."""
    w = max(1, int(warmup * steps))
    if step < w:
        return peak * (step + 1) / w
    t = min(1.0, (step - w) / max(1, steps - 1 - w))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


@dataclass
class TrainingRecord:
    """``training.json``: how a checkpoint was made, the same fields for every family."""

    revision: str | None  # git commit the command ran at
    command: str  # the exact command line, from the repository root
    config: dict[str, Any]  # the resolved settings of that command
    steps: int  # optimiser steps run
    tokens: int | None  # training tokens read (every token of every training batch); None: not recorded
    wall_seconds: float | None  # total wall time of the run (all parts)
    held_out: dict[str, Metric]  # the recipe's figures on the held-out sequences at the end
    dirty: bool | None = None  # tracked files differed from `revision` (the revision alone does not reproduce it)
    response_tokens: int | None = None  # of which response tokens (what a drafter is served on)
    extra: dict[str, Any] = field(default_factory=dict)  # figures of the recipe's finish step (calibration ...)
    log: list[dict[str, Any]] = field(default_factory=list)  # training (and periodic held-out) figures by step
    parts: list[dict[str, Any]] = field(default_factory=list)  # the commands of a run done in several parts
    versions: dict[str, str] = field(default_factory=dict)
    equivalent_command: str | None = None  # for checkpoints made before the one trainer: the same recipe with it
    note: str | None = None
    # the draft length that measured fastest with this checkpoint, filled in after measuring (the
    # trainer writes None): {"k": int, "measured": "the command, and the figure it gave"}; the demo's default k
    best_k: dict[str, Any] | None = None

    def write(self, folder: str | Path) -> Path:
        path = Path(folder) / RECORD_FILE
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def read(cls, folder: str | Path) -> TrainingRecord:
        return cls(**json.loads((Path(folder) / RECORD_FILE).read_text()))


@dataclass
class TrainResult:
    model: nn.Module
    record: TrainingRecord
    out: Path


@dataclass
class _Progress:
    """What the run has done so far: the part of the state that is not tensors."""

    step: int = 0
    tokens: int = 0
    response_tokens: int = 0
    wall_seconds: float = 0.0
    log: list[dict[str, Any]] = field(default_factory=list)
    parts: list[dict[str, Any]] = field(default_factory=list)


def _mean(figures: list[dict[str, Metric]]) -> dict[str, Metric]:
    """Per-key mean over batches (element-wise for per-position lists)."""
    out: dict[str, Metric] = {}
    for k in figures[0]:
        vals = [f[k] for f in figures]
        if isinstance(vals[0], list):
            out[k] = [sum(v) / len(v) for v in zip(*vals)]
        else:
            out[k] = sum(vals) / len(vals)
    return out


def _figures(out: StepOutput) -> dict[str, Metric]:
    return {"loss": float(out.loss.detach()), **out.metrics}


def _autocast(cfg: TrainConfig, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.optim.bf16)


def _resumable(cfg: TrainConfig) -> dict[str, Any]:
    """The settings a resumed run must share with the run it continues."""
    d = asdict(cfg)
    d["optim"].pop("stop_after")
    return {k: d[k] for k in ("recipe", "options", "target", "data", "optim", "seed")}


def _save_state(path: Path, model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator,
                progress: _Progress, cfg: TrainConfig) -> None:
    """Model, AdamW moments, both random states and the progress, as one safetensors file."""
    tensors = {f"model.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for key, val in st.items():
            tensors[f"opt.{i}.{key}"] = torch.as_tensor(val).clone().contiguous()
    tensors["rng.gen"], tensors["rng.torch"] = gen.get_state(), torch.get_rng_state()
    meta = {"progress": json.dumps(asdict(progress)), "config": json.dumps(_resumable(cfg))}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)  # an interrupted save leaves the previous state whole


def _load_state(path: Path, model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator,
                cfg: TrainConfig) -> _Progress:
    """Restore what :func:`_save_state` wrote into ``model``, ``opt`` and ``gen``."""
    if not path.exists():
        raise FileNotFoundError(f"no training state to resume at {path} (set work to the earlier run's)")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        data = {k: f.get_tensor(k) for k in f.keys()}
    if json.loads(meta["config"]) != json.loads(json.dumps(_resumable(cfg))):
        raise ValueError(f"{path} was written by a run with other settings; resume it with the same config")
    model.load_state_dict({k[6:]: v for k, v in data.items() if k.startswith("model.")})
    sd = opt.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in data.items():
        if k.startswith("opt."):
            _, i, key = k.split(".", 2)
            state.setdefault(int(i), {})[key] = v
    sd["state"] = state
    opt.load_state_dict(sd)
    gen.set_state(data["rng.gen"])
    torch.set_rng_state(data["rng.torch"])
    return _Progress(**json.loads(meta["progress"]))


@torch.no_grad()
def evaluate(recipe: Recipe, model: nn.Module, data: TrainData, cfg: TrainConfig, device: torch.device
             ) -> dict[str, Metric]:
    """The recipe's figures on the held-out sequences (own generator; the model is left in train mode)."""
    batches = [b.to(device) for b in data.scan("held", cfg.optim.batch, cfg.eval_sequences)]
    if not batches:
        return {}
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    model.eval()
    with _autocast(cfg, device):
        figures = [_figures(recipe.loss(model, b, gen)) for b in batches]
    model.train()
    return _mean(figures)


def _build_target(cfg: TrainConfig) -> Target | None:
    if cfg.target is None:
        return None
    from specdec.eval.runner import build_target

    return build_target(cfg.target)


def train(cfg: TrainConfig, command: str | None = None, target: Target | None = None) -> TrainResult:
    """Run (or resume) ``cfg``; write the checkpoint and ``training.json`` to ``cfg.out``.

    ``target`` overrides ``cfg.target`` (tests pass a tiny one); it is frozen, and cast to
    ``data.feature_dtype`` once the data is made.
    """
    start = time.time()
    torch.set_num_threads(cfg.threads)
    command = command or command_line()
    recipe = load_recipe(cfg.recipe, cfg.options)
    target = target if target is not None else _build_target(cfg)
    if target is not None:
        target.model.requires_grad_(False)
    key = recipe.feature_key(target) if target is not None else None
    featurize = (lambda tokens: recipe.featurize(target, tokens)) if key is not None else None
    show = sys.stdout.isatty() if cfg.progress is None else cfg.progress
    data = load_data(cfg.data, target, featurize, key, show)
    device = target.device if target is not None else torch.device("cpu")

    torch.manual_seed(cfg.seed)
    model = recipe.build(target, data).to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(o.betas[0], o.betas[1]), weight_decay=o.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    state_path = Path(cfg.work) / STATE_FILE
    progress = _load_state(state_path, model, opt, gen, cfg) if cfg.resume else _Progress()
    first, wall_before = progress.step, progress.wall_seconds

    def save_state() -> None:
        progress.wall_seconds = round(wall_before + time.time() - start, 1)
        _save_state(state_path, model, opt, gen, progress, cfg)

    stop = o.stop_after or o.steps
    log.info("%s: %.2fM trainable parameters, %d training / %d held-out sequences; steps %d..%d of %d",
             cfg.recipe.rpartition(".")[2], sum(p.numel() for p in params) / 1e6, len(data.train), len(data.held),
             first, stop, o.steps)

    bar = tqdm(range(first, stop), initial=first, total=stop, desc="train", disable=not show, mininterval=2)
    t_loop, held = time.time(), {}
    for step in bar:
        lr = lr_at(step, o.steps, o.lr, o.warmup, o.min_lr)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        figures = []
        for m in range(o.accumulate):
            idx = data.indices((step * o.accumulate + m) * o.batch, o.batch, cfg.seed)
            batch = data.batch([data.train[i] for i in idx]).to(device)
            with _autocast(cfg, device):
                out = recipe.loss(model, batch, gen)
            (out.loss / o.accumulate).backward()
            progress.tokens += batch.num_tokens
            progress.response_tokens += batch.num_response_tokens
            figures.append(_figures(out))
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, o.clip))
        opt.step()
        progress.step = step + 1
        now = _mean(figures)
        bar.set_postfix({k: (f"{v:.3f}" if isinstance(v, float) else " ".join(f"{x:.2f}" for x in v))
                         for k, v in now.items()})
        if progress.step % cfg.log_every == 0 or progress.step == stop:
            progress.log.append({"step": progress.step, "tokens": progress.tokens, "lr": lr, "grad_norm": grad_norm,
                                 **now})
            log.info("step %d: %s", progress.step, json.dumps(now))
        if progress.step == stop or (cfg.eval_every and progress.step % cfg.eval_every == 0):
            held = evaluate(recipe, model, data, cfg, device)
            progress.log.append({"step": progress.step, "tokens": progress.tokens,
                                 "response_tokens": progress.response_tokens,
                                 "seconds": round(wall_before + time.time() - start, 1), "held_out": held})
            log.info("step %d held-out: %s", progress.step, json.dumps(held))
        if cfg.save_every and progress.step % cfg.save_every == 0 and progress.step < stop:
            save_state()
    bar.close()
    if first == stop:  # resumed at the end: nothing left to train
        held = evaluate(recipe, model, data, cfg, device)
    progress.parts.append({"command": command, "revision": git_sha(), "steps": [first, stop],
                           "loop_seconds": round(time.time() - t_loop, 1)})
    if stop < o.steps:  # stopped early on purpose: keep what a resumed run needs
        save_state()

    extra = recipe.finish(model, data, torch.Generator().manual_seed(cfg.seed + 2))
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    recipe.save(model, out_dir)
    record = TrainingRecord(
        revision=git_sha(), dirty=git_dirty(), command=command, config=asdict(cfg), steps=progress.step,
        tokens=progress.tokens, response_tokens=progress.response_tokens,
        wall_seconds=round(wall_before + time.time() - start, 1),
        held_out=held, extra=extra, log=progress.log, parts=progress.parts if len(progress.parts) > 1 else [],
        versions={**versions(), "torch_threads": str(cfg.threads)})
    record.write(out_dir)
    log.info("saved %s", out_dir)
    return TrainResult(model, record, out_dir)

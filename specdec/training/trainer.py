"""The one training loop, for every drafter family (each contributes a :class:`~specdec.training.recipe.Recipe`).

    result = train(TrainConfig(recipe="specdec.drafters.eagle3.train.Eagle3Recipe", out="ckpt", ...))

- **Data**: :func:`specdec.training.data.load_data` (one pipeline, one held-out rule), batches drawn
  in seeded epochs.
- **Optimiser**: AdamW over the parameters that require grad; learning rate :func:`lr_at` (linear
  warm-up, then cosine down to ``min_lr · lr``), a pure function of the step; gradient-norm
  clipping; ``accumulate`` micro-batches per step; optional bf16 autocast around the loss.
- **Devices**: an :class:`accelerate.Accelerator` places the model and the target, runs the bf16
  autocast (``optim.bf16``) and the gradient accumulation, and data parallelism when launched with
  ``accelerate launch``: ``optim.batch`` is the global micro-batch, each process trains on its own
  slice of it and DDP averages the gradients, so a recipe runs on one CPU, one GPU or several
  without edits. Only the main process logs and writes files.
- **Resumable**: ``work/state.safetensors`` holds the model, the AdamW moments, the step, the
  counters and both random states of every process (its generator and torch's global one);
  safetensors only, nothing is ever pickled. A run resumed from it with as many processes ends
  bit-identical to one that never stopped. ``init`` instead starts a new run (its own schedule,
  fresh AdamW moments) from a checkpoint's weights, the committed ones included: a long training
  is done in parts that way, each on more data, without the state file.
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
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from tqdm import tqdm

from specdec.data.config import build_target
from specdec.kernels.dispatch import use_backend
from specdec.provenance import command_line, git_dirty, git_sha, versions
from specdec.target import Target
from specdec.training.config import TrainConfig
from specdec.training.data import Batch, TrainData, load_data
from specdec.training.profile import profiled
from specdec.training.recipe import Metric, Recipe, StepOutput, load_recipe

__all__ = ["lr_at", "train", "TrainResult", "TrainingRecord", "RECORD_FILE", "STATE_FILE"]

RECORD_FILE = "training.json"
STATE_FILE = "state.safetensors"
_PROCESS_SEED = 1_000_003  # process p's generator is seeded seed + p·this (p = 0: the single-process run's)
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
    positions: int | None = None  # loss positions at draft depth 1 trained on (Recipe.loss_positions)
    positions_per_token: float | None = None  # of the training sequences: loss positions per target token
    extra: dict[str, Any] = field(default_factory=dict)  # figures of the recipe's finish step (calibration ...)
    log: list[dict[str, Any]] = field(default_factory=list)  # training (and periodic held-out) figures by step
    parts: list[dict[str, Any]] = field(default_factory=list)  # the commands of a run done in several parts
    versions: dict[str, str] = field(default_factory=dict)
    equivalent_command: str | None = None  # for checkpoints made before the one trainer: the same recipe with it
    # the commands to run before equivalent_command, in order: earlier parts whose folders its init= reads
    remake_first: list[str] = field(default_factory=list)
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
    part: dict[str, Any]  # this call's part: steps [first, stop], loop_seconds, eval_seconds (within the loop)


@dataclass
class _Progress:
    """What the run has done so far: the part of the state that is not tensors."""

    step: int = 0
    tokens: int = 0
    response_tokens: int = 0
    positions: int = 0  # loss positions at draft depth 1 (Recipe.loss_positions), 0 where the recipe gives none
    wall_seconds: float = 0.0
    log: list[dict[str, Any]] = field(default_factory=list)
    parts: list[dict[str, Any]] = field(default_factory=list)


class _Meter:
    """Running sums of a loss's figures, kept where the figures live (the device): adding one never
    waits for the device; :meth:`read` reads the means to the host once, then starts again."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.count = 0

    def add(self, out: StepOutput) -> None:
        for k, v in {"loss": out.loss, **out.metrics}.items():
            t = v.detach().float() if isinstance(v, Tensor) else torch.tensor(v, dtype=torch.float32)
            self.sums[k] = self.sums[k] + t.to(self.sums[k].device) if k in self.sums else t
        self.count += 1

    def read(self) -> dict[str, Metric]:
        """Per-key means (element-wise for per-position figures) since the last read."""
        out = {k: (v / max(1, self.count)).tolist() for k, v in self.sums.items()}
        self.sums, self.count = {}, 0
        return out


class _Loss(nn.Module):
    """The recipe's loss as the module accelerate prepares: under DDP one forward per backward,
    whatever the recipe calls on its model (its hooks then average the gradients of everything used)."""

    def __init__(self, recipe: Recipe, model: nn.Module):
        super().__init__()
        self.recipe, self.model = recipe, model

    def forward(self, batch: Batch, gen: torch.Generator) -> StepOutput:
        return self.recipe.loss(self.model, batch, gen)


def _across(acc: Accelerator, values: dict[str, Metric], how: str) -> dict[str, Metric]:
    """``values`` reduced (``how``: "sum" or "mean") over the processes, each of which saw its own
    slice of the batch; as they are in a single process."""
    if acc.num_processes == 1:
        return values
    out = acc.reduce({k: torch.tensor(v, dtype=torch.float64, device=acc.device) for k, v in values.items()}, how)
    return {k: v.tolist() for k, v in out.items()}


def _resumable(cfg: TrainConfig) -> dict[str, Any]:
    """The settings a resumed run must share with the run it continues; the recipe's options with
    their defaults filled in, so an option added to a recipe later (at its default) still resumes."""
    d = asdict(cfg)
    d["optim"].pop("stop_after")
    d["options"] = _with_defaults(cfg.recipe, d["options"])
    return {k: d[k] for k in ("recipe", "options", "target", "data", "optim", "seed")}  # not init: the state holds it


def _with_defaults(recipe: str, options: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(load_recipe(recipe, options).options)))


def _rng_keys(process: int) -> tuple[str, str]:
    """Where a process's random states are stored (the first process's keys predate several processes)."""
    suffix = f".{process}" if process else ""
    return f"rng.gen{suffix}", f"rng.torch{suffix}"


def _save_state(path: Path, acc: Accelerator, model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator,
                progress: _Progress, cfg: TrainConfig) -> None:
    """Model, AdamW moments, every process's random states and the progress, as one safetensors
    file written by the main process (every process calls it: the random states are gathered)."""
    rng = acc.gather(torch.stack([gen.get_state(), torch.get_rng_state()]).to(acc.device)).cpu()  # [2·P, S]
    if not acc.is_main_process:
        return
    tensors = {f"model.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for key, val in st.items():
            tensors[f"opt.{i}.{key}"] = torch.as_tensor(val).clone().contiguous()
    for p in range(acc.num_processes):
        tensors.update(zip(_rng_keys(p), rng[2 * p: 2 * p + 2].clone()))
    meta = {"progress": json.dumps(asdict(progress)), "config": json.dumps(_resumable(cfg))}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)  # an interrupted save leaves the previous state whole


def _load_state(path: Path, acc: Accelerator, model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator,
                cfg: TrainConfig) -> _Progress:
    """Restore what :func:`_save_state` wrote into ``model``, ``opt`` and this process's ``gen``."""
    if not path.exists():
        raise FileNotFoundError(f"no training state to resume at {path} (set work to the earlier run's)")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        data = {k: f.get_tensor(k) for k in f.keys()}
    saved = json.loads(meta["config"])
    saved["options"] = _with_defaults(saved["recipe"], saved["options"])
    if saved != json.loads(json.dumps(_resumable(cfg))):
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
    saved = sum(k.startswith("rng.gen") for k in data)
    if saved != acc.num_processes and acc.is_main_process:
        log.warning("%s was saved by %d processes, resumed by %d: the random draws differ from an uninterrupted run",
                    path, saved, acc.num_processes)
    keys = _rng_keys(acc.process_index)
    if keys[0] in data:  # a process the saved run did not have keeps its own seed
        gen.set_state(data[keys[0]])
        torch.set_rng_state(data[keys[1]])
    return _Progress(**json.loads(meta["progress"]))


@torch.no_grad()
def evaluate(recipe: Recipe, model: nn.Module, data: TrainData, cfg: TrainConfig, acc: Accelerator
             ) -> dict[str, Metric]:
    """The recipe's figures on the held-out sequences (own generator; the model is left in train mode).
    Every process computes them all, the same in each (the held-out set is small; no process waits)."""
    batches = [b.to(acc.device) for b in data.scan("held", cfg.optim.batch, cfg.eval_sequences)]
    if not batches:
        return {}
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    model.eval()
    meter = _Meter()
    with acc.autocast():
        for b in batches:
            meter.add(recipe.loss(model, b, gen))
    model.train()
    return meter.read()


def positions_per_token(recipe: Recipe, data: TrainData) -> float | None:
    """Loss positions at draft depth 1 per target token over the training sequences, as one pass of
    the recipe's loss counts them (None: the recipe does not say)."""
    lengths = torch.tensor([s.tokens.numel() for s in data.train])
    counted = recipe.loss_positions(lengths, torch.tensor([s.response_start for s in data.train]))
    return None if counted is None else round(float(counted.sum()) / max(1, int(lengths.sum())), 4)


def _build_target(cfg: TrainConfig) -> Target | None:
    if cfg.target is None:
        return None
    return build_target(cfg.target)


def train(cfg: TrainConfig, command: str | None = None, target: Target | None = None) -> TrainResult:
    """Run (or resume) ``cfg``; write the checkpoint and ``training.json`` to ``cfg.out``.

    Training runs torch code only: the library's Triton kernels (decoding's) are switched off for the
    whole run, so nothing is compiled on the first steps of a timed loop, whatever the device.

    ``target`` overrides ``cfg.target`` (tests pass a tiny one); it is frozen, moved to the
    accelerator's device and cast to ``data.feature_dtype`` once the data is made. Under
    ``accelerate launch`` every process runs this and returns the same model and record.
    """
    with use_backend("torch"):
        return _train(cfg, command, target)


def _train(cfg: TrainConfig, command: str | None, target: Target | None) -> TrainResult:
    start = time.time()
    o = cfg.optim
    AcceleratorState._reset_state()  # the precision is per run (one process may run several, tests do)
    acc = Accelerator(mixed_precision="bf16" if o.bf16 else "no", gradient_accumulation_steps=o.accumulate)
    if o.batch % acc.num_processes:
        raise ValueError(f"optim.batch={o.batch} is the global micro-batch: it must split evenly over "
                         f"{acc.num_processes} processes")
    torch.set_num_threads(cfg.threads)
    command = command or command_line()
    recipe = load_recipe(cfg.recipe, cfg.options)
    if cfg.init and type(recipe).load is Recipe.load:  # before the data and features are made
        raise ValueError(f"{cfg.recipe} cannot start from a checkpoint: it has no Recipe.load (init={cfg.init!r})")
    if cfg.init and not (Path(cfg.init) / "config.json").is_file():  # checked here, not in the config: a
        # recorded two-part command names a folder its first part writes
        raise ValueError(f"init: {cfg.init!r} is not a checkpoint folder (no config.json in it)")
    target = target if target is not None else _build_target(cfg)
    if target is not None:
        target.model.requires_grad_(False).to(acc.device)
    key = recipe.feature_key(target) if target is not None else None
    featurize = (lambda tokens: recipe.featurize(target, tokens)) if key is not None else None
    show = (sys.stdout.isatty() if cfg.progress is None else cfg.progress) and acc.is_main_process
    with acc.main_process_first():  # the main process makes the caches (distilled data, features) the others read
        data = load_data(cfg.data, target, featurize, key, show, store_featurize=recipe.featurize if key else None,
                         needs=recipe.store_needs(target) if target is not None else None)

    torch.manual_seed(cfg.seed)
    model = recipe.build(target, data)
    if cfg.init:
        recipe.load(model, Path(cfg.init))
    model = model.to(acc.device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(o.betas[0], o.betas[1]), weight_decay=o.weight_decay)
    step_loss, opt = acc.prepare(_Loss(recipe, model), opt)
    gen = torch.Generator().manual_seed(cfg.seed + _PROCESS_SEED * acc.process_index)
    state_path = Path(cfg.work) / STATE_FILE
    progress = _load_state(state_path, acc, model, opt, gen, cfg) if cfg.resume else _Progress()
    first, wall_before = progress.step, progress.wall_seconds

    def save_state() -> None:
        progress.wall_seconds = round(wall_before + time.time() - start, 1)
        _save_state(state_path, acc, model, opt, gen, progress, cfg)

    stop = o.stop_after or o.steps
    per_token = positions_per_token(recipe, data)
    if acc.is_main_process:
        log.info("%s: %.2fM trainable parameters, %d training / %d held-out sequences; steps %d..%d of %d on %d %s "
                 "process(es); %s loss positions per target token", cfg.recipe.rpartition(".")[2],
                 sum(p.numel() for p in params) / 1e6, len(data.train), len(data.held), first, stop, o.steps,
                 acc.num_processes, acc.device.type, "–" if per_token is None else f"{per_token:.3f}")

    share = o.batch // acc.num_processes
    mine = slice(acc.process_index * share, (acc.process_index + 1) * share)  # this process's slice of each batch
    bar = tqdm(range(first, stop), initial=first, total=stop, desc="train", disable=not show, mininterval=2)
    t_loop, held, eval_s = time.time(), {}, 0.0
    meter, grad_norm = _Meter(), torch.zeros(())
    pending = {"tokens": 0, "response_tokens": 0, "positions": 0}  # this process's counts since the last flush

    def flush() -> None:
        """Add every process's counts since the last flush to the progress (one reduction, at the
        steps every process reaches together: logging, evaluation, saving, the end)."""
        counts = _across(acc, dict(pending), "sum")
        for k in pending:
            setattr(progress, k, getattr(progress, k) + int(counts[k]))
            pending[k] = 0

    def train_step(step: int, lr: float) -> None:
        nonlocal grad_norm
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        for m in range(o.accumulate):
            idx = data.indices((step * o.accumulate + m) * o.batch, o.batch, cfg.seed)[mine]
            host = data.batch([data.train[i] for i in idx])  # counted here, on the host: no device read
            pending["tokens"] += host.num_tokens
            pending["response_tokens"] += host.num_response_tokens
            counted = recipe.loss_positions(host.lengths, host.response_start)
            pending["positions"] += 0 if counted is None else int(counted.sum())
            batch = host.to(acc.device)
            with acc.accumulate(step_loss):  # gradients are averaged over the processes at the last micro-batch
                out = step_loss(batch, gen)
                acc.backward(out.loss)  # divides by `accumulate`
            meter.add(out)
        grad_norm = acc.clip_grad_norm_(params, o.clip)
        opt.step()

    profile_s = 0.0
    for step in bar:
        lr = lr_at(step, o.steps, o.lr, o.warmup, o.min_lr)
        if step + 1 == cfg.profile_step and acc.is_main_process:
            path = Path(cfg.work) / f"profile-step{step + 1}.txt"
            with profiled(acc.device, path, f"{cfg.recipe} step {step + 1}, batch {o.batch}, {acc.device}") as took:
                train_step(step, lr)
            profile_s += took["seconds"]
            log.info("profiled step %d: %s", step + 1, path)
        else:
            train_step(step, lr)
        progress.step = step + 1
        logging_now = progress.step % cfg.log_every == 0 or progress.step == stop
        evaluating = progress.step == stop or (cfg.eval_every and progress.step % cfg.eval_every == 0)
        saving = cfg.save_every and progress.step % cfg.save_every == 0 and progress.step < stop
        if logging_now or evaluating or saving:
            flush()
        if logging_now:  # the figures' one read from the device: their means over the steps since the last log
            now = _across(acc, meter.read(), "mean")
            bar.set_postfix({k: (f"{v:.3f}" if isinstance(v, float) else " ".join(f"{x:.2f}" for x in v))
                             for k, v in now.items()})
            progress.log.append({"step": progress.step, "tokens": progress.tokens, "positions": progress.positions,
                                 "lr": lr, "grad_norm": float(grad_norm), **now})
            if acc.is_main_process:
                log.info("step %d: %s", progress.step, json.dumps(now))
        if evaluating:
            t_eval = time.time()
            held = evaluate(recipe, model, data, cfg, acc)
            eval_s += time.time() - t_eval
            progress.log.append({"step": progress.step, "tokens": progress.tokens,
                                 "response_tokens": progress.response_tokens,
                                 "seconds": round(wall_before + time.time() - start, 1), "held_out": held})
            if acc.is_main_process:
                log.info("step %d held-out: %s", progress.step, json.dumps(held))
        if saving:
            save_state()
    bar.close()
    if first == stop:  # resumed at the end: nothing left to train
        held = evaluate(recipe, model, data, cfg, acc)
    progress.parts.append({"command": command, "revision": git_sha(), "steps": [first, stop],
                           "loop_seconds": round(time.time() - t_loop, 3), "eval_seconds": round(eval_s, 3),
                           "profile_seconds": round(profile_s, 3)})
    if stop < o.steps:  # stopped early on purpose: keep what a resumed run needs
        save_state()

    extra = recipe.finish(model, data, torch.Generator().manual_seed(cfg.seed + 2))
    out_dir = Path(cfg.out)
    if acc.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        recipe.save(model, out_dir)
    record = TrainingRecord(
        revision=git_sha(), dirty=git_dirty(), command=command, config=asdict(cfg), steps=progress.step,
        tokens=progress.tokens, response_tokens=progress.response_tokens, positions=progress.positions,
        positions_per_token=per_token,
        wall_seconds=round(wall_before + time.time() - start, 1),
        held_out=held, extra=extra, log=progress.log, parts=progress.parts if len(progress.parts) > 1 else [],
        versions={**versions(), "torch_threads": str(cfg.threads), "processes": str(acc.num_processes),
                  "device": acc.device.type})
    if acc.is_main_process:
        record.write(out_dir)
        log.info("saved %s", out_dir)
    acc.wait_for_everyone()  # every process returns once the checkpoint is written
    return TrainResult(model, record, out_dir, progress.parts[-1])

"""Typed configuration of a training run: the one set of settings behind the lab's ``train`` mode.

Hydra composes ``experiments/conf/train/<recipe>.yaml`` onto :class:`TrainConfig` and converts once
with ``OmegaConf.to_object`` (types checked, unknown keys refused); tests build it directly. This
module never imports hydra. ``recipe`` names the drafter family's :class:`~specdec.training.recipe.Recipe`
by dotted path and ``options`` are the fields of that recipe's own ``Options`` dataclass, so the
trainer never names a drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdec.data.config import TargetConfig

__all__ = ["DataConfig", "OptimConfig", "TrainConfig", "SOURCES"]

SOURCES = ("distill", "stdlib", "corpus")


@dataclass
class DataConfig:
    """Which sequences a recipe trains on (:mod:`specdec.training.data`)."""

    source: str = "distill"  # distill: the target's own greedy answers to offline prompts; stdlib: Python's source;
    #                          corpus: the committed corpus folder (specdec.data.corpus), greedy and sampled answers
    path: str | None = None  # distill: a stored data set (save_sequences' format); corpus: the shard folder
    sequences: int = 512  # distill: prompts answered (the cached data set; its first `use` are used)
    max_new_tokens: int = 256  # distill: response length cap
    seed: int = 0  # distill: prompt shuffle
    use: int | None = None  # only the first N sequences (None: all)
    max_len: int | None = None  # cut every sequence to this many tokens (None: whole)
    max_prompt: int | None = None  # keep only the last N prompt tokens (features cost per token; the loss reads responses)
    window: int = 129  # stdlib: tokens per training sequence (the text is cut into windows)
    vocab_size: int = 4096  # stdlib without a target: the BPE tokenizer trained on the training files
    max_files: int | None = None  # stdlib: only the first N training files (None: all)
    held_out_every: int = 20  # the held-out rule: an item whose name hashes to 0 mod this is never trained on
    cache_features: bool = True  # target features computed once and stored (else per batch, on the fly)
    feature_dtype: str = "float32"  # the target runs (and features are kept) in this dtype after the data is made
    store: str | None = None  # a feature store folder (specdec.data.store): sequences and features read from it, the
    #                           target never runs (source, path, max_prompt, cache_features are the store's, unused)
    store_sources: list[str] | None = None  # with a store: only its sequences from these sources (None: all)
    skip: int = 0  # with a store: leave out its first N sequences (of those sources), then take `use`: a training
    #                in parts (init=) reads new data in every part

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"data.source must be one of {SOURCES}, got {self.source!r}")
        if self.feature_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"data.feature_dtype must be float32, bfloat16 or float16, got {self.feature_dtype!r}")
        if self.held_out_every < 2:
            raise ValueError(f"data.held_out_every must be >= 2, got {self.held_out_every}")
        if self.source == "corpus" and not self.path:
            raise ValueError("data.source=corpus needs data.path, the corpus folder (e.g. experiments/data/smollm2-135m)")
        if self.max_prompt is not None and self.max_prompt < 1:
            raise ValueError(f"data.max_prompt must be >= 1 or null, got {self.max_prompt}")
        if self.skip < 0 or (self.skip and not self.store):
            raise ValueError(f"data.skip={self.skip}: a count of a feature store's sequences (needs data.store)")
        if self.window < 2:
            raise ValueError(f"data.window must be >= 2, got {self.window}")


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay (:func:`specdec.training.trainer.lr_at`)."""

    steps: int = 1000  # length of the learning-rate schedule
    stop_after: int | None = None  # stop after this many steps of it (resume later with resume=true)
    batch: int = 8  # sequences per micro-batch
    accumulate: int = 1  # micro-batches per optimiser step
    lr: float = 1e-3  # peak learning rate
    warmup: float = 0.03  # fraction of `steps` spent warming up linearly
    min_lr: float = 0.1  # the cosine ends at min_lr · lr
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    clip: float = 1.0  # gradient-norm clipping
    bf16: bool = False  # bf16 autocast around the loss (faster on CPUs with bf16 instructions, slower on AVX2-only ones)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch < 1 or self.accumulate < 1:
            raise ValueError("optim.steps, optim.batch and optim.accumulate must be >= 1")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"optim.stop_after must lie in [1, steps={self.steps}], got {self.stop_after}")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"optim.warmup is a fraction of the steps in [0, 1), got {self.warmup}")
        if not 0 <= self.min_lr <= 1:
            raise ValueError(f"optim.min_lr is a fraction of lr in [0, 1], got {self.min_lr}")
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas needs two values, got {self.betas}")


@dataclass
class TrainConfig:
    recipe: str = ""  # dotted path of a Recipe class, e.g. specdec.drafters.eagle3.train.Eagle3Recipe
    options: dict[str, Any] = field(default_factory=dict)  # fields of that recipe's Options dataclass
    target: TargetConfig | None = field(default_factory=TargetConfig)  # None: the recipe trains its own model
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    out: str = ""  # the checkpoint folder written at the end (weights, config, training.json)
    work: str = ""  # the resumable state's folder (every preset names one); empty: beside out, "<out>-work"
    seed: int = 0  # model initialisation and every random draw of the run
    threads: int = 1  # torch intra-op threads (small shared CPUs: one is the most stable)
    resume: bool = False  # continue from the state in `work`
    init: str | None = None  # start from this checkpoint folder's weights (e.g. the committed one): a new run, own schedule
    save_every: int = 0  # write the resumable state every N steps (0: only when stopping early)
    eval_every: int = 0  # held-out evaluation every N steps (0: only at the end)
    eval_sequences: int | None = None  # held-out sequences evaluated (None: all)
    log_every: int = 20  # training figures recorded every N steps
    progress: bool | None = None  # tqdm bar; None: only when stdout is a terminal
    profile_step: int = 0  # profile this step of the schedule (1-based; 0: none) into <work>/profile-step<N>.txt

    def __post_init__(self) -> None:
        if not self.recipe:
            raise ValueError("recipe: the dotted path of a Recipe class is required")
        if not self.out:
            raise ValueError("out: the checkpoint folder is required")
        if not self.work:
            self.work = self.out.rstrip("/") + "-work"
        if self.threads < 1 or self.log_every < 1 or self.save_every < 0 or self.eval_every < 0:
            raise ValueError("threads and log_every must be >= 1, save_every and eval_every >= 0")
        if not 0 <= self.profile_step <= self.optim.steps:
            raise ValueError(f"profile_step must lie in [0, optim.steps={self.optim.steps}] (0: none), "
                             f"got {self.profile_step}")

"""Typed configuration shared by training and evaluation: which target, which prompts.

Both :mod:`specdec.training` and :mod:`specdec.eval` read these (the data layer sits below both);
:mod:`specdec.eval.config` composes them into a run's settings. This module never imports hydra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdec.target import Target

__all__ = ["TargetConfig", "DatasetConfig", "DATASETS", "build_target", "data_device"]

DATASETS = ("random", "sharegpt", "mtbench", "humaneval", "specbench", "copy", "stdlib")


@dataclass
class TargetConfig:
    model: str = "smollm2-135m"  # an alias of specdec.models, a local folder, or "tiny" (random weights)
    dtype: str = "float32"
    device_map: str | None = None  # accelerate's device_map (e.g. "auto"); None = CPU
    tiny: dict[str, Any] = field(default_factory=dict)  # specdec.testing.tiny.tiny_model options when model == "tiny"
    pack: bool = True  # CPU: oneDNN-packed copies of fp32 linear weights where measured faster (Target's pack)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"target.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not isinstance(self.pack, bool):
            raise TypeError(f"target.pack must be a bool, got {type(self.pack).__name__}")


def build_target(cfg: TargetConfig) -> Target:
    """The target a config names; ``model: tiny`` builds a random-weight model (tests, CI)."""
    import torch

    from specdec.api import load_target
    from specdec.target import Target

    if cfg.model == "tiny":
        from specdec.testing.tiny import tiny_model

        return Target(tiny_model(**{"vocab_size": 64, **cfg.tiny}).to(getattr(torch, cfg.dtype)), pack=cfg.pack)
    return load_target(cfg.model, dtype=getattr(torch, cfg.dtype), device_map=cfg.device_map, pack=cfg.pack)


def data_device(device: str | None) -> str | None:
    """Where a data job (the corpus generator, the feature store's fill) puts its target, checked
    before any work: None or ``"cpu"``: the CPU (None, the loaders' default); ``"auto"``: this
    process's accelerator as accelerate sees it (under ``accelerate launch``/``torchrun`` each process
    its own GPU), the CPU where there is none; else a torch device such as ``"cuda"`` or ``"cuda:1"``
    (ROCm's GPUs too), which must exist here."""
    import torch

    if device is None:
        return None
    if not isinstance(device, str):
        raise TypeError(f"device must be a string such as 'cpu', 'cuda', 'cuda:1' or 'auto', got {device!r}")
    if device == "auto":
        if not torch.cuda.is_available():
            return None
        from accelerate import PartialState

        device = str(PartialState().device)
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r} is not a torch device: 'cpu', 'cuda', 'cuda:1' or 'auto'") from None
    if dev.type == "cpu":
        return None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this machine has no CUDA or ROCm GPU that torch can use")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return str(dev)


@dataclass
class DatasetConfig:
    name: str = "random"  # one of DATASETS
    path: str | None = None  # sharegpt / specbench file; None = the offline package (sharegpt only)
    num_prompts: int = 8  # first N after filtering (and shuffling, if asked)
    skip: int = 0  # benchmark files (mtbench, specbench, humaneval, copy): leave out the first N, then take num_prompts
    output_len: int | None = 64  # max new tokens per turn; sharegpt: None = the recorded reply's length
    input_len: int = 128  # random and stdlib: prompt tokens
    range_ratio: float = 1.0  # random only: lengths uniform in [ratio * len, len], as SGLang's "random"
    turns: int = 2  # mtbench / specbench: how many user turns per conversation (1 or 2)
    chat: bool = True  # apply the target's chat template where it has one (text datasets)
    shuffle: bool = False  # shuffle (seeded by the run seed) before taking num_prompts
    ignore_eos: bool = False  # generate exactly output_len tokens (the usual throughput setting)
    max_prompt_len: int = 1024  # sharegpt: drop longer prompts (SGLang's filter)
    repeats: int = 1  # the prompts asked this many times, all of them then all again (agents repeating tasks)

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"dataset.name must be one of {DATASETS}, got {self.name!r}")
        if self.num_prompts < 1:
            raise ValueError(f"dataset.num_prompts must be >= 1, got {self.num_prompts}")
        if self.output_len is not None and self.output_len < 1:
            raise ValueError(f"dataset.output_len must be >= 1 or None, got {self.output_len}")
        if not 0 <= self.range_ratio <= 1:
            raise ValueError(f"dataset.range_ratio must lie in [0, 1], got {self.range_ratio}")
        if self.turns < 1:
            raise ValueError(f"dataset.turns must be >= 1, got {self.turns}")
        if self.repeats < 1:
            raise ValueError(f"dataset.repeats must be >= 1, got {self.repeats}")
        if self.skip < 0 or (self.skip and self.name not in ("mtbench", "specbench", "humaneval", "copy")):
            raise ValueError(f"dataset.skip={self.skip}: a count of a benchmark file's items (mtbench, specbench, "
                             f"humaneval, copy), >= 0; {self.name!r} has none")
        if self.output_len is None and self.name != "sharegpt":
            raise ValueError("dataset.output_len=None (the recorded reply's length) exists for sharegpt only")
        if self.name == "specbench" and not self.path:
            raise ValueError("dataset specbench needs dataset.path: a Spec-Bench question.jsonl")

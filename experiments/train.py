"""Train a drafter with the one trainer (:mod:`specdec.training.trainer`): one Hydra config per recipe.

    .venv/bin/python experiments/train.py --config-name smollm2_eagle3
    .venv/bin/python experiments/train.py --config-name smollm2_dflash optim.steps=500 threads=2
    .venv/bin/python experiments/train.py --config-name smollm2_eagle3 optim.stop_after=100   # a first part ...
    .venv/bin/python experiments/train.py --config-name smollm2_eagle3 resume=true            # ... continued
    .venv/bin/accelerate launch experiments/train.py --config-name smollm2_eagle3          # one process per GPU

Configs (``conf/train/``): ``smollm2_eagle3``, ``smollm2_dflash``, ``smollm2_dspark``,
``smollm2_gemma_mtp``, ``smollm2_mtp`` (post-hoc MTP module for SmolLM2) and ``tiny_deepseek_v3_mtp``
(a DeepSeek-V3 trained from scratch with its own MTP modules). Each composes onto
``specdec.training.config.TrainConfig`` (registered as ``train_schema``), converted once with
``OmegaConf.to_object``: types are checked and unknown keys fail, the recipe's ``options`` included.
The checkpoint goes to ``out`` with ``training.json`` (git revision, this command line, the resolved
config, training tokens, wall time, held-out figures); the resumable state and Hydra's log go to
``work`` (``outputs/train/<config>``).

Run it by path from the repository root, never with ``python -m`` (see the README). The same
config runs on one CPU, one GPU or several (``docs/training.md``, "One CPU, one GPU, several").
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from specdec.provenance import command_line
from specdec.training.config import TrainConfig
from specdec.training.trainer import train

CONF_DIR = Path(__file__).resolve().parent / "conf" / "train"


def register_configs() -> None:
    """Store ``TrainConfig`` as the schema ``train_schema`` every ``conf/train/*.yaml`` extends."""
    ConfigStore.instance().store(name="train_schema", node=OmegaConf.structured(TrainConfig))


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The one conversion from Hydra's composed config to the library's typed config."""
    if not cfg.get("recipe"):
        names = ", ".join(sorted(p.stem for p in CONF_DIR.glob("*.yaml")))
        raise SystemExit(f"choose a recipe with --config-name: {names}")
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, TrainConfig)
    return obj


register_configs()


@hydra.main(config_path=str(CONF_DIR), config_name=None, version_base="1.3")
def main(cfg: DictConfig) -> None:
    train(to_train_config(cfg), command=command_line())


if __name__ == "__main__":
    main()

"""The lab's one entry point: every job is a Hydra preset, run with ``experiments/run.py``.

    .venv/bin/python experiments/run.py                                     # conf/config.yaml as is
    .venv/bin/python experiments/run.py drafter=ngram num_speculative_tokens=8 dataset=humaneval
    .venv/bin/python experiments/run.py -m num_speculative_tokens=2,4,8 concurrency=1,2,4,8
    .venv/bin/python experiments/run.py target=tiny dataset=random dataset.num_prompts=4   # seconds
    .venv/bin/python experiments/run.py --config-name eagle3_trees -m       # a question: conf/<question>.yaml
    .venv/bin/python experiments/run.py --config-name roofline              # mode roofline (docs/roofline.md)
    .venv/bin/python experiments/run.py --config-name train/smollm2_eagle3 optim.steps=500   # training
    .venv/bin/python experiments/run.py --config-name lab/acceptance preset=drafters_mtbench out=outputs/acc
    .venv/bin/accelerate launch experiments/run.py --config-name train/smollm2_eagle3   # one process per GPU

Three kinds of preset, told apart by the schema they compose onto:

- ``conf/<question>.yaml`` (and ``conf/config.yaml``): :class:`specdec.eval.config.RunConfig`
  (``run_schema``), its ``mode`` ``decode`` (the decoding question: ``config.yaml``, ``config.json``,
  ``requests.jsonl``, ``summary.json`` and ``summary.md`` in the Hydra run folder, ``outputs/…`` or
  ``multirun/…/<job>``) or ``roofline`` (``roofline.json`` beside ``config.json``; ``roofline.md`` and
  its figures rendered from it by ``experiments/report.py``). Groups: ``target``, ``drafter``,
  ``verifier``, ``dataset``, ``sampling`` (docs/experiments.md).
- ``conf/train/<recipe>.yaml``: :class:`specdec.training.config.TrainConfig` (``train_schema``), mode
  ``train``: the one trainer (docs/training.md); the checkpoint goes to ``out`` with ``training.json``.
- ``conf/lab/<mode>.yaml``: no schema but the function's: ``mode`` names an entry of :data:`LAB_MODES`
  and every other key is one of its keyword parameters, checked against its signature before any work.

Either schema is converted once with ``OmegaConf.to_object``: types are checked and unknown keys fail by
name. Run it by path from the repository root, never with ``python -m`` (see the README).
"""

from __future__ import annotations

import os
import sys

# a dry run chooses Triton's interpreter before the library (and so triton) is first imported
if {"dry_run=true", "smoke=true"} & set(sys.argv[1:]):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402
import inspect  # noqa: E402
import logging  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import hydra  # noqa: E402
import torch  # noqa: E402
from hydra.core.config_store import ConfigStore  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf, open_dict  # noqa: E402

from specdec.eval.config import RunConfig, check_keys  # noqa: E402
from specdec.models import remake_time, unmade_checkpoints  # noqa: E402
from specdec.training.config import TrainConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/: the report and the lab's modules

CONF_DIR = str(Path(__file__).resolve().parent / "conf")
log = logging.getLogger(__name__)

# mode -> "module:function" in experiments/: the lab's jobs beside decode, roofline and train. Each
# function takes its preset's keys as typed keyword parameters; imported only when its mode runs.
LAB_MODES: dict[str, str] = {
    "acceptance": "benchmarks.acceptance:measure",
    "step_anatomy": "benchmarks.step_anatomy:profile_step",
    "peak_memory": "benchmarks.peak_memory:measure",
    "kernels": "benchmarks.kernels:bench",
    "compile_kernels": "benchmarks.compile_kernels:compile_all",
    "gpu": "benchmarks.gpu:kit",
    "token_map": "benchmarks.token_map:build",
    "eagle3_chain_estimate": "benchmarks.eagle3_chain_estimate:estimate",
    "eagle3_serving": "benchmarks.eagle3_serving:serve",
    "curves": "benchmarks.learning_curves:curves",
    "ceiling": "benchmarks.ceiling:ceiling",
    "store": "benchmarks.store_fill:fill",
    "corpus": "generate_corpus:grow",
    "preset_steps": "benchmarks.preset_steps:table",
    "hybrid_choice": "benchmarks.hybrid_choice:choices",
    "train_rates": "benchmarks.train_rates:compare",
    "train_flops": "benchmarks.train_flops:roofline",
    "capture_cpu": "benchmarks.capture_cpu:compare_modes",
    "ar_ratio": "benchmarks.ar_ratio:ratio",
}


def register_configs() -> None:
    """Store ``RunConfig`` as ``run_schema`` (``conf/config.yaml`` extends it) and ``TrainConfig`` as
    ``train/train_schema`` (every ``conf/train/*.yaml`` extends it)."""
    node = OmegaConf.structured(RunConfig)
    OmegaConf.set_readonly(node.sampling, False)  # SamplingParams is frozen; YAML must still fill it
    ConfigStore.instance().store(name="run_schema", node=node)
    ConfigStore.instance().store(group="train", name="train_schema", node=OmegaConf.structured(TrainConfig))


def own_drafter_options(cfg: DictConfig, choice: str | None) -> DictConfig:
    """``drafter.name=mine`` over the drafter group ``choice`` (``ngram`` by default): the group's
    options belong to its drafter, not to ``mine``, so those still at the group's values are dropped;
    options given on the command line (``+drafter.options.x=1``, or a group option set to another
    value) stay."""
    group = Path(CONF_DIR) / "drafter" / f"{choice}.yaml"
    if not choice or not group.is_file() or cfg.drafter.name is None:
        return cfg
    own = OmegaConf.load(group)
    if own.get("name") == cfg.drafter.name:
        return cfg
    defaults = OmegaConf.to_container(own.get("options") or {})
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.drafter.options = {k: v for k, v in OmegaConf.to_container(cfg.drafter.options).items()
                               if k not in defaults or defaults[k] != v}
    return cfg


def _without_hydra(cfg: DictConfig) -> DictConfig:
    """The config less Hydra's own node (present when composed with ``return_hydra_config=True``)."""
    return OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg


def to_run_config(cfg: DictConfig, choices: dict | None = None) -> RunConfig:
    """The one conversion from Hydra's composed config to the library's typed config (``choices``:
    the config groups Hydra picked, ``HydraConfig.get().runtime.choices``)."""
    if "hydra" in cfg:  # composed with return_hydra_config=True (the tests read the sweeper's params)
        choices = choices or dict(cfg.hydra.runtime.choices)
        cfg = cfg.copy()
        with open_dict(cfg):
            del cfg["hydra"]
    cfg = own_drafter_options(cfg, (choices or {}).get("drafter"))
    check_keys(OmegaConf.to_container(cfg))  # a misspelt key fails by name, before the conversion
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, RunConfig)
    return obj


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The one conversion from a composed ``conf/train/*.yaml`` to the trainer's typed config."""
    if not cfg.get("recipe"):
        names = ", ".join(sorted(p.stem for p in (Path(CONF_DIR) / "train").glob("*.yaml")))
        raise SystemExit(f"choose a recipe with --config-name train/<name>: {names}")
    obj = OmegaConf.to_object(_without_hydra(cfg))
    assert isinstance(obj, TrainConfig)
    return obj


def lab_job(cfg: DictConfig) -> tuple[Callable[..., Any], dict[str, Any]]:
    """A ``conf/lab/*.yaml`` preset's function and its keyword parameters, checked by name against
    the function's signature (a misspelt or missing key fails before any work)."""
    cfg = _without_hydra(cfg)
    mode = cfg.get("mode")
    if mode not in LAB_MODES:
        raise SystemExit(f"unknown mode {mode!r}: decode, roofline, train or one of {sorted(LAB_MODES)}")
    module, _, name = LAB_MODES[mode].partition(":")
    fn = getattr(importlib.import_module(module), name)
    params = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True).items()
              if k != "mode"}
    sig = inspect.signature(fn)
    unknown = sorted(set(params) - set(sig.parameters))
    missing = sorted(n for n, p in sig.parameters.items() if p.default is p.empty and n not in params)
    if unknown or missing:
        raise SystemExit(f"mode {mode} ({LAB_MODES[mode]}): unknown keys {unknown}, missing keys {missing}; "
                         f"it takes {list(sig.parameters)}")
    return fn, params


register_configs()


def checkpoints_read(run: RunConfig) -> list[str]:
    """The drafter checkpoints a run reads (its drafter's and every method's), as named."""
    drafters = [run.drafter, *(d for d, _, _ in run.speculative_methods().values())]
    return sorted({str(d.options["checkpoint"]) for d in drafters if d.options.get("checkpoint")})


def check_made(run: RunConfig) -> None:
    """Stop before any work when the run reads a checkpoint recorded but not made here, naming the
    command that makes each (a preset lists them as ``needs_remake``)."""
    unmade = unmade_checkpoints(checkpoints_read(run))
    if len(unmade) == 1:  # one line: the command, runnable as printed, and how long it took when recorded
        (name, cmd), = unmade.items()
        raise SystemExit(f"this run reads checkpoint {name!r}, recorded but not committed; make it first, from the"
                         f" repository root, with: {cmd} ({remake_time(name)})")
    if unmade:
        raise SystemExit("this run reads checkpoints that are recorded but not committed; make them first, from"
                         " the repository root:\n" + "\n".join(f"  {name}: {cmd} ({remake_time(name)})"
                                                             for name, cmd in unmade.items()))


def decode_or_roofline(cfg: DictConfig) -> None:
    """A question's run (mode ``decode``) or the roofline (mode ``roofline``), into the Hydra run folder."""
    from report import roofline_figures, roofline_markdown, summary_markdown
    from specdec.eval.roofline import run_roofline
    from specdec.eval.runner import run_experiment

    run_cfg = to_run_config(cfg, dict(HydraConfig.get().runtime.choices))
    check_made(run_cfg)
    torch.set_num_threads(run_cfg.threads)  # the config's: one by default, stable timings on a small shared CPU
    out = Path(HydraConfig.get().runtime.output_dir)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if run_cfg.mode == "roofline":
        result = run_roofline(run_cfg, out_dir=out)
        (out / "roofline.md").write_text(roofline_markdown(result, run_cfg))
        roofline_figures(result, out)
        log.info("\n%s", (out / "roofline.md").read_text())
    else:
        result = run_experiment(run_cfg, out_dir=out)
        (out / "summary.md").write_text(summary_markdown(result.summary, run_cfg))
        log.info("\n%s", (out / "summary.md").read_text())
    log.info("outputs in %s", out)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> Any:
    schema = OmegaConf.get_type(cfg)
    if schema is RunConfig:
        return decode_or_roofline(cfg)
    if schema is TrainConfig:
        from specdec.provenance import command_line
        from specdec.training.trainer import train

        return train(to_train_config(cfg), command=command_line())
    fn, params = lab_job(cfg)
    return fn(**params)


if __name__ == "__main__":
    main()

"""The Hydra entry point: one run, or a sweep with ``-m``.

    .venv/bin/python experiments/run.py                                     # conf/config.yaml as is
    .venv/bin/python experiments/run.py drafter=ngram num_speculative_tokens=8 dataset=humaneval
    .venv/bin/python experiments/run.py -m num_speculative_tokens=2,4,8 concurrency=1,2,4,8
    .venv/bin/python experiments/run.py target=tiny dataset=random dataset.num_prompts=4   # seconds
    .venv/bin/python experiments/run.py --config-name eagle3_trees -m       # a preset: conf/<preset>.yaml
    .venv/bin/python experiments/run.py --config-name roofline        # mode: roofline (docs/roofline.md)

Config groups (``conf/``): ``target``, ``drafter``, ``verifier``, ``dataset``, ``sampling``; every other
``conf/<question>.yaml`` is a preset: one question, its runs and sweeps (docs/experiments.md). All compose
onto ``specdec.eval.config.RunConfig`` (registered here as ``run_schema``), which is converted once with
``OmegaConf.to_object``: types are checked, unknown keys fail by name (even added with ``+``), and the library sees only its own
dataclasses. Outputs go to the Hydra run folder (``outputs/…``, or ``multirun/…/<job>`` in a sweep):
``config.yaml`` (resolved), ``config.json`` (the same plus git SHA and versions), ``requests.jsonl``,
``summary.json`` and ``summary.md``. Plots and a report of a sweep: ``experiments/report.py``.
``mode: roofline`` runs :func:`specdec.eval.roofline.run_roofline` instead, which writes ``roofline.json``
beside ``config.json``; this runner renders ``roofline.md`` and its figures from it (``experiments/report.py``).

Run it by path from the repository root, never with ``python -m`` (see the README).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from specdec.eval.roofline import run_roofline
from specdec.eval.runner import run_experiment
from specdec.eval.config import RunConfig, check_keys
from specdec.models import remake_time, unmade_checkpoints

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/: the report beside this runner
from report import roofline_figures, roofline_markdown, summary_markdown  # noqa: E402

CONF_DIR = str(Path(__file__).resolve().parent / "conf")
log = logging.getLogger(__name__)


def register_configs() -> None:
    """Store ``RunConfig`` as the schema ``run_schema`` that ``conf/config.yaml`` extends."""
    node = OmegaConf.structured(RunConfig)
    OmegaConf.set_readonly(node.sampling, False)  # SamplingParams is frozen; YAML must still fill it
    ConfigStore.instance().store(name="run_schema", node=node)


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


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
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


if __name__ == "__main__":
    main()

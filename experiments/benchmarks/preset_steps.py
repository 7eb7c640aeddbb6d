"""How much decoding each preset asks for, and about how long that takes: the basis of the run
times in docs/experiments.md, computed from the composed configs without running anything.

    .venv/bin/python experiments/run.py --config-name lab/preset_steps            # every preset, at 53 ms a step
    .venv/bin/python experiments/run.py --config-name lab/preset_steps ms=80      # another machine's step time

Per preset: the jobs its sweep launches (``hydra.sweeper.params``), and over them the target steps
of its decoding: per job, every method (each k of ``methods``, the autoregressive baseline and each
``hf_compare`` peer) decodes every request (prompts x repeats x turns) up to ``output_len`` new
tokens, ``concurrency`` requests a step. One step per new token is plain decoding's count: a
speculative method takes fewer, costlier steps, a request may stop early at EOS, and prefill, model
loading and warm-up are not counted, so the time is an order of magnitude, not a prediction. A
``mode: roofline`` preset is not decoding: its time is in docs/roofline.md.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

CONF = Path(__file__).resolve().parents[1] / "conf"


def _entry():
    spec = importlib.util.spec_from_file_location("specdec_experiments_run_steps", CONF.parent / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def preset_steps(name: str, to_run_config) -> tuple[int, int | None]:
    """(jobs, target steps over all of them; None for a roofline preset) of preset ``name``."""
    params = dict(compose(config_name=name, return_hydra_config=True).hydra.sweeper.params or {})
    combos = list(itertools.product(*(str(v).split(",") for v in params.values()))) or [()]
    steps = 0
    for combo in combos:
        run = to_run_config(compose(config_name=name, overrides=[f"{k}={v}" for k, v in zip(params, combo)]), {})
        if run.mode == "roofline":
            return len(combos), None
        d = run.dataset
        turns = d.turns if d.name in ("mtbench", "specbench") else 1
        methods = len(run.speculative_methods()) + int(run.baseline) + len(run.hf_compare)
        steps += methods * math.ceil(d.num_prompts * d.repeats * turns / run.concurrency) * (d.output_len or 0)
    return len(combos), steps


def table(ms: float = 53.0) -> None:
    """Mode ``preset_steps``: the table of every preset's jobs and target steps, and their time at
    ``ms`` milliseconds a target step (53: SmolLM2-135M, fp32, batch 1, one thread, a quiet machine,
    docs/roofline.md)."""
    to_run_config = _entry().to_run_config
    print("| preset | jobs | target steps | at this step time |\n|---|---|---|---|")
    GlobalHydra.instance().clear()  # the runner's own composition is done: compose each preset afresh
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for path in sorted(CONF.glob("*.yaml")):
            if path.stem == "config":
                continue
            jobs, steps = preset_steps(path.stem, to_run_config)
            when = "see docs/roofline.md" if steps is None else f"{steps * ms / 60e3:.1f} min"
            print(f"| `{path.stem}` | {jobs} | {'-' if steps is None else f'{steps:,}'} | {when} |")

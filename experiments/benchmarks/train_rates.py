"""Training rates before and after, at equal tokens: every SmolLM2 recipe through two checkouts' trainers.

    .venv/bin/python experiments/run.py --config-name lab/train_rates before=/path/to/other/checkout

For each recipe, the ``before`` checkout's trainer (its own venv; a checkout with the one runner's
``conf/train/`` presets or with the older ``train.py`` entry beside ``run.py``) and this one's run
the same config on the same batches (same seed, data and steps), back to back, so a busy machine loads
both alike; each rate is the trainer's own loop time (its held-out evaluation left out). Loss positions at
draft depth 1 are this checkout's :meth:`Recipe.loss_positions` over the batches drawn, under each run's
options (the before run's are read from its ``training.json``). Writes ``rates.json`` and prints a table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RECIPES = {"eagle3": [], "mtp": [], "gemma_mtp": [], "dflash": ["options.layers=1"], "dflash2": ["options.layers=1"],
           "dspark": ["options.layers=1", "options.markov_rank=16"]}


# the checkout's training preset, composed by Hydra's API, trained, and the part's loop time printed (a
# one-part run's training.json keeps no parts); either entry a checkout has: run.py's conf/train/<name>
# or the older train.py entry beside run.py, with conf/train as its config folder
DRIVER = """
import json, sys
from pathlib import Path
sys.path.insert(0, "experiments")
from hydra import compose, initialize_config_dir
from specdec.training.trainer import train
if Path("experiments/train.py").exists():
    import train as T
    name = sys.argv[1]
else:
    import run as T
    name = "train/" + sys.argv[1]
with initialize_config_dir(str(T.CONF_DIR), version_base=None):
    cfg = compose(config_name=name, overrides=sys.argv[2:])
print("PART " + json.dumps(train(T.to_train_config(cfg)).part))
"""


def command(tree: Path, family: str, use: int, bf16: bool, batch: int, steps: int, out: Path) -> list[str]:
    return [str(tree / ".venv/bin/python"), "-c", DRIVER, f"smollm2_{family}",
            f"data.use={use}", "data.cache_features=true", f"optim.bf16={str(bf16).lower()}",
            f"optim.batch={batch}", f"optim.steps={steps}", "eval_sequences=1", "eval_every=0",
            "save_every=0", f"log_every={steps}", "threads=1", "progress=false", *RECIPES[family],
            f"out={out}", f"work={out}-work"]


def positions(record: dict, steps: int, batch: int) -> int:
    """Loss positions at draft depth 1 of the batches the run drew, under its own options."""
    import torch

    from specdec.training.config import DataConfig
    from specdec.training.data import load_data
    from specdec.training.recipe import load_recipe

    cfg = record["config"]
    data = load_data(DataConfig(**cfg["data"]), None)
    recipe = load_recipe(cfg["recipe"], cfg["options"])
    n = 0
    for step in range(steps):
        seqs = [data.train[i] for i in data.indices(step * batch, batch, cfg["seed"])]
        counted = recipe.loss_positions(torch.tensor([s.tokens.numel() for s in seqs]),
                                        torch.tensor([s.response_start for s in seqs]))
        n += int(counted.sum())
    return n


def compare(before: str, out: str = "outputs/train_rates", families: list[str] | None = None, steps: int = 8,
            batch: int = 4, use: int = 48, bf16: bool = True, after_overrides: list[str] | None = None) -> list[dict]:
    """Every recipe of ``families`` trained by the ``before`` checkout and by this one, back to back;
    ``after_overrides`` (Hydra overrides, e.g. ``options.anchors=0``) apply to this side only."""
    families = list(families or RECIPES)
    if unknown := sorted(set(families) - set(RECIPES)):
        raise SystemExit(f"unknown recipes {unknown}: {sorted(RECIPES)}")
    other, folder = Path(before).resolve(), Path(out).resolve()
    if not (other / ".venv/bin/python").exists():
        raise SystemExit(f"{other} has no .venv/bin/python: the before checkout runs with its own venv")
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for family in families:
        row = {"recipe": family}
        for side, tree in (("before", other), ("after", ROOT)):
            side_out = folder / f"{family}-{side}"
            cmd = command(tree, family, use, bf16, batch, steps, side_out) + (list(after_overrides or []) if side == "after" else [])
            corpus = ["data.path=" + str(ROOT / "experiments/data/smollm2-135m")]
            run = subprocess.run(cmd + corpus, cwd=tree, env=env, check=True, capture_output=True, text=True)
            part = json.loads([ln for ln in run.stdout.splitlines() if ln.startswith("PART ")][-1][5:])
            rec = json.loads((side_out / "training.json").read_text())
            seconds = part["loop_seconds"] - part["eval_seconds"]
            pos = positions(rec, steps, batch)
            row[side] = {"seconds": round(seconds, 2), "tokens": rec["tokens"], "response_tokens": rec["response_tokens"],
                         "positions": pos, "tokens_per_s": round(rec["tokens"] / seconds, 1),
                         "positions_per_s": round(pos / seconds, 1),
                         "command": f"{tree}: smollm2_{family} " + " ".join(cmd[4:] + corpus)}
        row["positions_per_s_ratio"] = round(row["after"]["positions_per_s"] / row["before"]["positions_per_s"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
        (folder / "rates.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows

"""Training rates before and after, at equal tokens: every SmolLM2 recipe through two checkouts' trainers.

    python experiments/benchmarks/train_rates.py --before /work/main --steps 8 --out outputs/train_rates

For each recipe, the ``before`` checkout's ``experiments/train.py`` (its own venv) and this one's run the
same config on the same batches (same seed, data and steps), back to back, so a busy machine loads both
alike; each rate is the trainer's own loop time (its held-out evaluation left out). Loss positions at
draft depth 1 are this checkout's :meth:`Recipe.loss_positions` over the batches drawn, under each run's
options (the before run's are read from its ``training.json``). Writes ``rates.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # its kernels.py is not the `kernels` package
RECIPES = {"eagle3": [], "mtp": [], "gemma_mtp": [], "dflash": ["options.layers=1"], "dflash2": ["options.layers=1"],
           "dspark": ["options.layers=1", "options.markov_rank=16"]}


# experiments/train.py's config, composed by Hydra's API, trained, and the part's loop time printed (a
# one-part run's training.json keeps no parts)
DRIVER = """
import json, sys
sys.path.insert(0, "experiments")
from hydra import compose, initialize_config_dir
import train as T
T.register_configs()
with initialize_config_dir(str(T.CONF_DIR), version_base=None):
    cfg = compose(config_name=sys.argv[1], overrides=sys.argv[2:])
print("PART " + json.dumps(T.train(T.to_train_config(cfg)).part))
"""


def command(tree: Path, family: str, args: argparse.Namespace, out: Path) -> list[str]:
    return [str(tree / ".venv/bin/python"), "-c", DRIVER, f"smollm2_{family}",
            f"data.use={args.use}", "data.cache_features=true", f"optim.bf16={str(args.bf16).lower()}",
            f"optim.batch={args.batch}", f"optim.steps={args.steps}", "eval_sequences=1", "eval_every=0",
            "save_every=0", f"log_every={args.steps}", "threads=1", "progress=false", *RECIPES[family],
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="the other checkout (its .venv is used)")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "train_rates")
    ap.add_argument("--families", nargs="+", default=list(RECIPES))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--use", type=int, default=48)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--set", nargs="*", default=[], help="Hydra overrides for the after side only (options.anchors=0)")
    args = ap.parse_args()
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for family in args.families:
        row = {"recipe": family}
        for side, tree in (("before", args.before), ("after", ROOT)):
            out = (args.out / f"{family}-{side}").resolve()
            cmd = command(tree, family, args, out) + (args.set if side == "after" else [])
            corpus = ["data.path=" + str(ROOT / "experiments/data/smollm2-135m")]
            run = subprocess.run(cmd + corpus, cwd=tree, env=env, check=True, capture_output=True, text=True)
            part = json.loads([ln for ln in run.stdout.splitlines() if ln.startswith("PART ")][-1][5:])
            rec = json.loads((out / "training.json").read_text())
            seconds = part["loop_seconds"] - part["eval_seconds"]
            pos = positions(rec, args.steps, args.batch)
            row[side] = {"seconds": round(seconds, 2), "tokens": rec["tokens"], "response_tokens": rec["response_tokens"],
                         "positions": pos, "tokens_per_s": round(rec["tokens"] / seconds, 1),
                         "positions_per_s": round(pos / seconds, 1),
                         "command": f"{tree}: experiments/train.py --config-name " + " ".join(cmd[3:] + corpus)}
        row["positions_per_s_ratio"] = round(row["after"]["positions_per_s"] / row["before"]["positions_per_s"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
        (args.out / "rates.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())

"""FLOPs per trained position of every SmolLM2 recipe, against the measured rate: a training roofline.

    .venv/bin/python experiments/run.py --config-name lab/train_flops rates=outputs/train_rates/rates.json

For each recipe, one training step (loss and backward, bf16 autocast as the rates were measured) on the
first ``--batch`` training sequences, counted by ``torch.utils.flop_counter.FlopCounterMode`` (matmuls
and attention, forward and backward; the no-grad target logits inside the loss included), divided by
the step's loss positions at draft depth 1 (:meth:`Recipe.loss_positions`). The roof is this CPU's
one-thread bf16 matmul rate (a 2048³ product under autocast, best of 5). ``rates.json``'s
``positions_per_s`` (mode ``train_rates``) times FLOPs per position is the rate the step achieves.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402


def matmul_roof(n: int = 2048) -> float:
    """FLOP/s of one bf16 n³ matmul under CPU autocast on one thread (best of 5)."""
    from specdec.timing import measure

    a, b = torch.randn(n, n), torch.randn(n, n)

    def product() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a @ b

    return 2 * n ** 3 / measure(product, repeats=5, warmup=1).min


def step_flops(family: str, overrides: list[str], batch: int) -> tuple[int, int]:
    """(FLOPs of one loss + backward, its loss positions at depth 1) on the first training sequences."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import run as T
    from specdec.data.config import build_target
    from specdec.kernels.dispatch import use_backend
    from specdec.training.data import load_data
    from specdec.training.recipe import load_recipe

    # inside the runner's job Hydra is already set up on conf/; called on its own, it is set up here
    with nullcontext() if GlobalHydra.instance().is_initialized() else initialize_config_dir(T.CONF_DIR, version_base=None):
        cfg = T.to_train_config(compose(config_name=f"train/smollm2_{family}", overrides=overrides))
    recipe = load_recipe(cfg.recipe, cfg.options)
    target = build_target(cfg.target)
    target.model.requires_grad_(False)
    data = load_data(cfg.data, target, lambda t: recipe.featurize(target, t), recipe.feature_key(target),
                     needs=recipe.store_needs(target))
    torch.manual_seed(0)
    model = recipe.build(target, data).train()
    b = data.batch(data.train[:batch])
    counter = FlopCounterMode(display=False)
    with use_backend("torch"), counter, torch.autocast("cpu", dtype=torch.bfloat16):
        recipe.loss(model, b, torch.Generator().manual_seed(0)).loss.backward()
    return counter.get_total_flops(), int(recipe.loss_positions(b.lengths, b.response_start).sum())


def roofline(rates: str = "outputs/train_rates/rates.json", batch: int = 4, use: int = 48) -> list[dict]:
    """FLOPs per trained position of every recipe, the one-thread bf16 matmul roof, and the share of it
    that ``rates`` (mode ``train_rates``) achieved; written beside ``rates`` as ``flops.json``."""
    from benchmarks.train_rates import RECIPES

    torch.set_num_threads(1)
    roof = matmul_roof()
    path = Path(rates)
    measured = {r["recipe"]: r for r in json.loads(path.read_text())} if path.exists() else {}
    rows = []
    for family, extra in RECIPES.items():
        flops, pos = step_flops(family, [f"data.use={use}", "data.cache_features=true",
                                         f"data.path={ROOT / 'experiments/data/smollm2-135m'}", *extra], batch)
        row = {"recipe": family, "flops_per_position": flops / pos, "roof_flops_per_s": roof,
               "roof_positions_per_s": roof / (flops / pos)}
        if family in measured:
            got = measured[family]["after"]["positions_per_s"]
            row.update(measured_positions_per_s=got, achieved_flops_per_s=got * flops / pos,
                       fraction_of_roof=got * flops / pos / roof)
        rows.append(row)
        print(json.dumps(row), flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "flops.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows

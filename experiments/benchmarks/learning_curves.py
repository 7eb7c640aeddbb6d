"""Learning curves of every learned drafter at equal data and equal compute, with the one trainer.

    .venv/bin/python experiments/bench.py learning_curves run                 # train each family (resumes)
    .venv/bin/python experiments/bench.py learning_curves report --out docs/learning_curves

``run`` trains each family's recipe (``experiments/conf/train/smollm2_<family>.yaml``) on the same
data (the committed corpus, its first ``--use`` sequences, prompts cut to their last ``--max-prompt``
tokens) for the same number of sequences (``--steps`` × ``--batch``, so the same training tokens),
with held-out figures every ``--eval-every`` steps. Each run is one ``experiments/train.py``
command, recorded in its ``training.json``; a finished family is skipped and an interrupted one
resumes from its state. ``report`` reads those records and writes the curves (held-out acceptance
at position 1 and the chain mean accepted length it implies at k = 4, against training response
tokens and against wall time) as JSON, a markdown table and a figure. With ``--decoded`` (a
runner sweep folder that decoded the finished checkpoints, e.g. ``drafters_mtbench`` with each
method's ``options.checkpoint=outputs/curves/<family>``) it adds their measured acceptance and
accepted length.

The held-out figures are each recipe's own estimate (:meth:`Recipe.loss` on held-out corpus
sequences: the draft's argmax against the target's, per position, given the true prefix), the same
for every family; decoding measurements of the finished checkpoints belong to the runner.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("eagle3", "dflash", "dspark", "gemma_mtp", "mtp")
# per-family options that keep the checkpoints small (docs/results.md, "Size budget")
OPTIONS = {"eagle3": ["options.draft_vocab=4096"], "dflash": ["options.layers=1"],
           "dspark": ["options.layers=1", "options.markov_rank=16"], "gemma_mtp": [], "mtp": []}


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The training command of each family, from the repository root."""
    common = [f"data.source=corpus", f"data.path={args.corpus}", f"data.use={args.use}",
              f"data.max_prompt={args.max_prompt}", "data.max_len=null", "data.feature_dtype=float32",
              "data.cache_features=true", "optim.bf16=false", f"optim.batch={args.batch}",
              f"optim.steps={args.steps}", f"eval_every={args.eval_every}", "save_every=20", "threads=1",
              "progress=false"]
    return {f: [sys.executable, "experiments/train.py", "--config-name", f"smollm2_{f}", *common, *OPTIONS[f],
                f"out={args.runs}/{f}", f"work={args.runs}/{f}-work"] for f in args.families}


def run(args: argparse.Namespace) -> None:
    for family, cmd in commands(args).items():
        out = ROOT / args.runs / family
        if (out / "training.json").exists():
            print(f"{family}: done", flush=True)
            continue
        if (ROOT / args.runs / f"{family}-work" / "state.safetensors").exists():
            cmd = [*cmd, "resume=true"]
        print("$", shlex.join(cmd), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)


def mal(accept: list[float], k: int) -> float:
    """Chain mean accepted length at draft length ``k`` from per-position acceptance (given the prefix)."""
    total, alive = 1.0, 1.0
    for a in accept[:k]:
        alive *= a
        total += alive
    return total


def curves(runs: Path, families: tuple[str, ...]) -> dict[str, list[dict]]:
    """Per family, the held-out points of its run: tokens, response tokens, seconds, acceptance, MAL@4."""
    out = {}
    for f in families:
        record = runs / f / "training.json"
        if not record.exists():
            continue
        rec = json.loads(record.read_text())
        out[f] = [{"step": e["step"], "tokens": e["tokens"], "response_tokens": e.get("response_tokens"),
                   "seconds": e.get("seconds"), "accept": e["held_out"]["accept"],
                   "mal4": round(mal(e["held_out"]["accept"], 4), 3)}
                  for e in rec["log"] if "held_out" in e and "accept" in e["held_out"]]
        out[f].append({"command": rec["command"], "wall_seconds": rec["wall_seconds"]})
    return out


def report(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = curves(ROOT / args.runs, args.families)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    rows = ["| drafter | response tokens | wall s | accept@1 | accept@2 | accept@3 | accept@4 | MAL k=4 (est.) |",
            "|---|---|---|---|---|---|---|---|"]
    for f, points in data.items():
        pts, meta = points[:-1], points[-1]
        x = [p["response_tokens"] / 1e3 for p in pts]
        axes[0].plot(x, [p["accept"][0] for p in pts], marker="o", label=f)
        axes[1].plot(x, [p["mal4"] for p in pts], marker="o", label=f)
        axes[2].plot([p["seconds"] / 60 for p in pts], [p["mal4"] for p in pts], marker="o", label=f)
        last = pts[-1]
        acc = [f"{a:.3f}" for a in last["accept"][:4]] + ["–"] * (4 - min(4, len(last["accept"])))
        rows.append(f"| {f} | {last['response_tokens']:,} | {meta['wall_seconds']:.0f} | {' | '.join(acc)} "
                    f"| {last['mal4']:.2f} |")
    axes[0].set(xlabel="training response tokens seen (thousands)", ylabel="held-out acceptance, position 1 (recipe's estimate)",
                title="first-position acceptance")
    axes[1].set(xlabel="training response tokens seen (thousands)", ylabel="mean accepted length, chain k=4 (est.)",
                title="accepted length vs data seen")
    axes[2].set(xlabel="training wall time (minutes, one CPU thread)", ylabel="mean accepted length, chain k=4 (est.)",
                title="accepted length vs compute")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    cmds = "\n".join(f"- {f}: `{p[-1]['command']}`" for f, p in data.items())
    text = "\n".join(rows) + "\n\nCommands:\n\n" + cmds + "\n"
    if args.decoded:
        found = decoded(ROOT / args.decoded)
        data["decoded"] = found
        text += "\n" + decoded_table(found)
        out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    out.with_suffix(".md").write_text(text)
    print(text)


def decoded(sweep: Path) -> list[dict]:
    """Every method of every job under ``sweep`` (the runner's ``summary.json`` and ``config.json``):
    sampling temperature, method, mean accepted length, acceptance per drafted position, speedup."""
    found = []
    for summary in sorted(sweep.glob("*/summary.json")):
        temperature = json.loads((summary.parent / "config.json").read_text())["config"]["sampling"]["temperature"]
        for name, r in json.loads(summary.read_text()).items():
            if r.get("drafter") is None:
                continue
            found.append({"temperature": temperature, "method": name, "requests": r["requests"],
                          "new_tokens": r["new_tokens"], "mean_accepted_length": r["mean_accepted_length"],
                          "acceptance_at": r["acceptance_at"], "speedup": r.get("speedup"),
                          "identical_to_baseline": r.get("identical_to_baseline")})
    return found


def decoded_table(found: list[dict]) -> str:
    """Markdown: one row per (temperature, method); acceptance at position i counts the rows that drafted
    that deep (not given that position i - 1 was accepted), so their sum plus one is the accepted length."""
    rows = ["| T | method | mean accepted length | acceptance at positions 1–k | speedup | identical to AR |",
            "|---|---|---:|---|---:|---:|"]
    for r in sorted(found, key=lambda r: (r["temperature"], -r["mean_accepted_length"])):
        same = "–" if r["temperature"] else f"{r['identical_to_baseline']}/{r['requests']}"
        rows.append(f"| {r['temperature']:g} | {r['method']} | {r['mean_accepted_length']:.2f} | "
                    f"{' '.join(f'{a:.2f}' for a in r['acceptance_at'])} | {r['speedup']:.2f}x | {same} |")
    return ("Decoded (the finished checkpoints, held-out MT-bench first turns; the runner's sweep given"
            " as --decoded, whose config.json files record its command):\n\n" + "\n".join(rows) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("run", "report"))
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--corpus", default="experiments/data/smollm2-135m")
    ap.add_argument("--use", type=int, default=384, help="corpus sequences (the first N; held-out ones included)")
    ap.add_argument("--max-prompt", type=int, default=64, help="prompt tokens kept (the last N)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=160, help="optimiser steps (the same for every family)")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--runs", default="outputs/curves", help="run folders, relative to the repository root")
    ap.add_argument("--out", default="docs/learning_curves", help="report path without suffix")
    ap.add_argument("--decoded", default=None, help="a runner sweep folder that decoded the finished checkpoints")
    args = ap.parse_args()
    args.families = tuple(args.families)
    run(args) if args.action == "run" else report(args)


if __name__ == "__main__":
    main()

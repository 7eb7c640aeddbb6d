"""Learning curves from a feature store: every family at equal tokens and equal steps, each point decoded.

    python experiments/run.py --config-name lab/curves store=<store> runs=outputs/curves_store   # resumable
    python experiments/run.py --config-name lab/curves action=report runs=outputs/curves_store
    python experiments/run.py --config-name lab/curves action=package family=mtp part=3 \
        dest=experiments/checkpoints/smollm2-135m-mtp

``run`` cuts the store's sequences (in store order) into consecutive parts that end at the token
counts of ``points`` (tokens seen: every token of every training sequence); part ``i`` trains
each family on its own new sequences, once each, from the checkpoint part ``i-1`` wrote (``init=``:
weights carry over, each part has its own warm-up and cosine schedule). Every family runs the same
command shape (``experiments/run.py --config-name train/smollm2_<family>``, ``data.store``, ``data.skip``,
``data.use``, the same batch and steps), so at each point every family has seen the same tokens in
the same order. A part waits for the store to hold its sequences (the store may still be filling)
and is resumed from its state after an interruption; a finished part is skipped.

After each part the checkpoint is decoded on held-out prompts (greedy, a chain of ``k`` drafts,
through the library's loop): the first turns of held-out MT-bench questions and held-out HumanEval
problems (:data:`specdec.data.datasets.HELD_OUT`), acceptance at each draft position and the mean
accepted length, into ``decoded.json`` beside the checkpoint. Nothing here reads a clock for a
figure: acceptance is exact on a busy machine.

``report`` collects every part into the page's record (``docs/results/learning_curves.json``: each
point's figures and command, with the provenance) and has the one renderer, ``experiments/report.py``,
draw the page and its figure from it; ``package`` makes a point a checkpoint folder.
"""

from __future__ import annotations

import datetime
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from specdec.provenance import command_line

__all__ = ["FAMILIES", "parts", "run_name", "part_command", "decode", "collect", "report", "package", "curves"]

FAMILIES = ("eagle3", "dflash", "dspark", "gemma_mtp", "mtp")
# per family: the label is the target's own distribution where the recipe offers it (forward KL); the
# draft vocabularies keep checkpoints small
OPTIONS: dict[str, list[str]] = {
    "eagle3": ["options.draft_vocab=4096"],
    "dflash": ["options.loss=kl"],
    "dspark": [],
    "gemma_mtp": [],
    "mtp": ["options.loss=kl", "options.token_map=experiments/data/smollm2-135m/token_map.safetensors",
            "options.draft_vocab=8192"],
}
DRAFTER_OPTIONS: dict[str, dict[str, Any]] = {"eagle3": {"tree": "chain"}, "mtp": {"chain_hidden": "normed"},
                                              "dspark": {"scheduler": False}}


def store_rows(store: Path) -> tuple[list[int], list[bool], list[str]]:
    """Tokens, held-out mark and source of every sequence of the store's finished shards, in order."""
    from specdec.data.store import FeatureStore

    s = FeatureStore(store)
    return [int(q.tokens.numel()) for q in s.sequences], list(s.held), list(s.source)


def parts(lengths: list[int], held: list[bool], points: list[int]) -> list[tuple[int, int, int]]:
    """(skip, use, training tokens) of each part: consecutive store ranges whose training (not held-out)
    tokens add up to each point. A point the store cannot reach yet ends the list."""
    out, lo, seen = [], 0, 0
    for p in points:
        hi, tokens = lo, 0
        while hi < len(lengths) and seen + tokens < p:
            if not held[hi]:
                tokens += lengths[hi]
            hi += 1
        if seen + tokens < p:
            break
        out.append((lo, hi - lo, tokens))
        lo, seen = hi, seen + tokens
    return out


def run_name(family: str, variant: str = "") -> str:
    """The folder of a family's curve, or of a lever tried on it (``eagle3@ttt3``)."""
    if variant and not variant.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"a variant is a short name of letters, digits, '-' and '_', got {variant!r}")
    return f"{family}@{variant}" if variant else family


def part_command(family: str, store: str, runs: str, i: int, skip: int, use: int, steps: int, batch: int,
                 eval_sequences: int, threads: int, variant: str = "", overrides: tuple[str, ...] = (),
                 bf16: bool = False) -> list[str]:
    """The one training command of part ``i`` of ``family`` (from the repository root); a ``variant``
    (a lever) adds its Hydra ``overrides`` after the family's own and writes beside the plain curve.
    ``bf16``: autocast the loss to bf16 (for CPUs with bf16 matrix units; the features stay fp32)."""
    name = run_name(family, variant)
    cmd = [sys.executable, "experiments/run.py", "--config-name", f"train/smollm2_{family}", f"data.store={store}",
           f"data.skip={skip}", f"data.use={use}", "data.held_out_every=20", "data.feature_dtype=float32",
           f"optim.bf16={str(bf16).lower()}", f"optim.batch={batch}", f"optim.steps={steps}", "optim.warmup=0.05",
           f"eval_sequences={eval_sequences}", "save_every=5", f"threads={threads}", "progress=false",
           *OPTIONS[family], *overrides, f"out={runs}/{name}/p{i}", f"work={runs}/{name}/p{i}-work"]
    if i > 0:
        cmd.append(f"init={runs}/{name}/p{i - 1}")
    return cmd


def held_out_prompts(target, n: int) -> dict[str, list[list[int]]]:
    """The first ``n`` held-out MT-bench first turns and HumanEval problems, chat-encoded."""
    from specdec.api import encode_messages
    from specdec.data.config import DatasetConfig
    from specdec.data.datasets import HELD_OUT, load_dataset

    out = {}
    for name in ("mtbench", "humaneval"):
        if n > HELD_OUT[name]:
            raise ValueError(f"only {HELD_OUT[name]} {name} items are held out, {n} asked for")
        samples = load_dataset(DatasetConfig(name=name, num_prompts=n, turns=1))
        out[name] = [encode_messages(target, [{"role": "user", "content": s.turns[0]}], chat=True) for s in samples]
    return out


def decode(target, family: str, checkpoint: str | Path, prompts: dict[str, list[list[int]]], k: int,
           max_new_tokens: int) -> dict[str, Any]:
    """Greedy chain decoding of each prompt set with the checkpoint: acceptance per position, mean
    accepted length, and whether every output equals plain greedy decoding's."""
    import specdec
    from specdec.api import make_drafter

    drafter = make_drafter(family, target, checkpoint=str(checkpoint), **DRAFTER_OPTIONS.get(family, {}))
    out: dict[str, Any] = {"k": k, "max_new_tokens": max_new_tokens}
    for name, ps in prompts.items():
        res = specdec.generate(target, ps, drafter, k=k, verifier="greedy", max_new_tokens=max_new_tokens,
                               progress=False)
        s = res.summary
        out[name] = {"prompts": len(ps), "new_tokens": s.new_tokens, "mean_accepted_length": s.mean_accepted_length,
                     "acceptance_at": s.acceptance_at}
    return out


def run(store: str, runs: str, families: list[str], points: list[int], batch: int, eval_sequences: int, prompts: int,
        k: int, max_new_tokens: int, threads: int, bf16: bool, poll: float, variant: str, overrides: list[str]) -> None:
    """Train every part of every family's curve (resuming), each part decoded once it is done."""
    import torch

    from specdec.api import load_target

    folder = Path(runs)
    target = asked = None
    for i, p in enumerate(points):
        while True:
            lengths, held, _ = store_rows(Path(store))  # once per look: it opens every shard
            plan = parts(lengths, held, points)
            if len(plan) > i:
                break
            print(f"point {p:,}: waiting for the store to hold it", flush=True)
            time.sleep(poll)
        skip, use, tokens = plan[i]
        n_train = sum(1 for j in range(skip, skip + use) if not held[j])
        steps = max(1, -(-n_train // batch))
        for family in families:
            name = run_name(family, variant)
            out = folder / name / f"p{i}"
            if not (out / "training.json").is_file():
                cmd = part_command(family, store, runs, i, skip, use, steps, batch, eval_sequences, threads,
                                   variant, tuple(overrides), bf16)
                if (folder / name / f"p{i}-work" / "state.safetensors").is_file():
                    cmd.append("resume=true")
                print("$", shlex.join(cmd), flush=True)
                subprocess.run(cmd, check=True)
            if not (out / "decoded.json").is_file():
                if target is None:
                    torch.set_num_threads(threads)
                    target = load_target("smollm2-135m")
                    asked = held_out_prompts(target, prompts)
                found = decode(target, family, out, asked, k, max_new_tokens)  # type: ignore[arg-type]
                found.update(point=p, part=i, part_tokens=tokens, steps=steps)
                (out / "decoded.json").write_text(json.dumps(found, indent=1))
                print(name, f"p{i}", json.dumps({n: found[n]["mean_accepted_length"] for n in asked}), flush=True)


def collect(runs: Path, families: tuple[str, ...] = FAMILIES) -> dict[str, list[dict[str, Any]]]:
    """Per run (each family's curve, then the levers tried on it, ``family@variant``), its points in
    order: tokens seen, steps, wall seconds, the recipe's held-out estimate, the decoded figures and
    the part's command."""
    out: dict[str, list[dict[str, Any]]] = {}
    names = [n for f in families for n in [f, *sorted(p.name for p in runs.glob(f"{f}@*") if p.is_dir())]]
    for f in names:
        seen, steps, wall = 0, 0, 0.0
        for part in sorted((runs / f).glob("p*/training.json"), key=lambda q: int(q.parent.name[1:])):
            rec = json.loads(part.read_text())
            seen, steps, wall = seen + rec["tokens"], steps + rec["steps"], wall + rec["wall_seconds"]
            dec = part.parent / "decoded.json"
            out.setdefault(f, []).append({"tokens": seen, "steps": steps, "wall_seconds": round(wall, 1),
                                          "held_out": rec["held_out"], "command": rec["command"],
                                          "decoded": json.loads(dec.read_text()) if dec.is_file() else None})
    return out


CURVES_QUESTION = (
    "Every family sees the same store sequences in the same order (equal tokens and equal steps at each point). "
    "MAL: mean accepted length of greedy chain decoding at k = 4 on held-out prompts (the first 8 MT-bench first "
    "turns, the first 8 HumanEval problems, 48 new tokens), through the library's loop; acceptance 1..k: the share "
    "of steps that drafted that deep whose draft at that position was accepted. Each part's training command is in "
    "its `training.json` and in this page's record.")


def report(runs: str, families: list[str], out: str) -> None:
    """The record of the curves found in ``runs`` (``<out>.json``: every point's tokens, steps, wall
    time, held-out figures, decoded figures and command, with the provenance), then its page and figure
    rendered from it by the one renderer (``experiments/report.py``). A curve of the page's earlier
    record that ``runs`` does not hold is kept, named in the provenance with the record it came from:
    a lever rerun beside it does not erase the points it is compared with."""
    from report import write_page  # experiments/: the renderer

    from specdec.provenance import cpu_model, git_sha

    data = collect(Path(runs), tuple(families))
    page = Path(out).with_suffix(".md")
    page.parent.mkdir(parents=True, exist_ok=True)
    earlier = json.loads(page.with_suffix(".json").read_text()) if page.with_suffix(".json").is_file() else None
    kept = {n: pts for n, pts in (earlier or {}).get("curves", {}).items() if n not in data}
    data = _ordered({**kept, **data}, families)
    first = next((p["command"] for pts in data.values() for p in pts), "")
    record = {"title": "Learning curves from the feature store", "question": CURVES_QUESTION,
              "provenance": {"command": command_line(), "git": (git_sha() or "unknown")[:7],
                             "machine": f"{cpu_model()}, one torch thread per job (threads=1), the machine shared "
                                        "with other jobs",
                             "date": datetime.date.today().isoformat(),
                             "settings": f"{_store_dtype(first)}, {_training_precision(data)}, greedy"},
              "curves": data}
    if kept:
        e = earlier["provenance"]
        record["provenance"]["earlier"] = (f"{', '.join(kept)} kept from the earlier record (git {e['git']}, {e['date']},"
                                           f" {e['machine']}; `{e['command']}`)")
    page.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    for path in write_page(page):
        print(path)


def _ordered(data: dict[str, list[dict[str, Any]]], families: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Each family's curve, then its levers by name, families in ``families``' order (others last)."""
    rank = {f: i for i, f in enumerate(families)}

    def key(name: str) -> tuple[int, int, str]:
        family, _, variant = name.partition("@")
        return rank.get(family, len(rank)), bool(variant), variant

    return {n: data[n] for n in sorted(data, key=key)}


def package(runs: Path, family: str, part: int, dest: Path, weights: bool = True,
            best_k: dict[str, Any] | None = None) -> Path:
    """Part ``part`` of ``family``'s curve as a checkpoint folder ``dest``: its weights (unless
    ``weights`` is False: a size budget keeps only the record) and a ``training.json`` whose remake
    chain is the store's own command and every part's, the last one writing to ``dest``, so one
    ``&&``-joined line makes it again where its name finds it. Tokens, steps and wall time add up
    over the parts; the last part's log is kept."""
    import shutil

    from specdec.training.trainer import TrainingRecord

    folders = [runs / family / f"p{i}" for i in range(part + 1)]
    missing = [str(f) for f in folders if not (f / "training.json").is_file()]
    if missing:
        raise FileNotFoundError(f"the curve of {family} has no finished part(s) {missing}: run the curve first")
    recs = [TrainingRecord.read(f) for f in folders]
    store = next((w.split("=", 1)[1] for w in shlex.split(recs[0].command) if w.startswith("data.store=")), None)
    if store is None or not (Path(store) / "manifest.json").is_file():
        raise FileNotFoundError(f"{folders[0]} names no feature store on disk (data.store={store}): its command "
                                "cannot be recorded")
    store_command = json.loads((Path(store) / "manifest.json").read_text())["command"]
    chain = [{"command": r.command, "revision": r.revision, "steps": r.steps, "tokens": r.tokens,
              "wall_seconds": r.wall_seconds, "held_out": r.held_out} for r in recs]
    last = recs[-1]
    last.tokens = sum(r.tokens or 0 for r in recs)
    last.response_tokens = sum(r.response_tokens or 0 for r in recs)
    last.steps = sum(r.steps for r in recs)
    last.wall_seconds = round(sum(r.wall_seconds or 0.0 for r in recs), 1)
    last.parts = chain
    last.remake_first = [store_command, *(r.command for r in recs[:-1])]
    last.equivalent_command = _writing_to(last.command, dest)  # the chain ends in this folder: its name resolves
    decoded = folders[-1] / "decoded.json"
    figures = json.loads(decoded.read_text()) if decoded.is_file() else None
    last.note = (f"Part {part} of the learning curve of {family} from the feature store "
                 f"(docs/results/learning_curves.md): {len(recs)} parts, each from the one before (init=); the "
                 f"store's command, then each part's, remake it (remake_first, then equivalent_command)."
                 + (f" Decoded at k={figures['k']} on the held-out prompts: mean accepted length "
                    f"{figures['mtbench']['mean_accepted_length']:.3f} (MT-bench), "
                    f"{figures['humaneval']['mean_accepted_length']:.3f} (HumanEval)." if figures else "")
                 + ("" if weights else " Weights not committed (the repository's size budget)."))
    last.best_k = best_k
    dest.mkdir(parents=True, exist_ok=True)
    for f in dest.iterdir():
        if f.is_file():
            f.unlink()
    if weights:
        for f in folders[-1].iterdir():
            if f.is_file() and f.name not in ("training.json", "decoded.json"):
                shutil.copy2(f, dest / f.name)
    last.write(dest)
    return dest


def _writing_to(command: str, dest: Path) -> str:
    """``command`` with its ``out=`` pointed at ``dest`` (relative to the working directory, the
    repository root, when inside it), so the remade weights land in the packaged folder."""
    here = Path.cwd().resolve()
    folder = dest.resolve()
    where = str(folder.relative_to(here)) if folder.is_relative_to(here) else str(folder)
    return shlex.join(f"out={where}" if w.startswith("out=") else w for w in shlex.split(command))


def _store_dtype(command: str) -> str:
    """How the store a part read (``data.store=`` of its command) was computed: its manifest's
    compute dtype (a store from before the key ran fp32); rows are stored in bf16 either way."""
    store = next((w.split("=", 1)[1] for w in shlex.split(command) if w.startswith("data.store=")), None)
    manifest = Path(store) / "manifest.json" if store else None
    if manifest is None or not manifest.is_file():
        return "store rows of unknown compute dtype"
    dtype = json.loads(manifest.read_text()).get("compute_dtype", "float32")
    return f"store rows computed by the target in {dtype} (kept in bf16)"


def _training_precision(data: dict[str, list[dict[str, Any]]]) -> str:
    """How the parts trained: fp32, except those whose command turned bf16 autocast on (named, so a
    reader knows which points of a curve changed precision); decoding is fp32 always."""
    bf16 = [f"{name} p{i}" for name, pts in data.items() for i, p in enumerate(pts)
            if "optim.bf16=true" in shlex.split(p["command"])]
    if not bf16:
        return "fp32 training and decoding"
    return f"fp32 training except under bf16 autocast in {', '.join(bf16)} (`optim.bf16=true`), fp32 decoding"


def curves(runs: str, action: str = "run", store: str | None = None,
           families: list[str] = FAMILIES, points: list[int] = (30_000, 100_000, 300_000, 1_000_000, 3_000_000),
           batch: int = 4, eval_sequences: int = 16, prompts: int = 8, k: int = 4, max_new_tokens: int = 48,
           threads: int = 1, bf16: bool = False, poll: float = 60.0, out: str = "docs/results/learning_curves.md",
           variant: str = "", overrides: list[str] = (), family: str | None = None, part: int | None = None,
           dest: str | None = None, record_only: bool = False, best_k: int | None = None,
           best_k_measured: str = "") -> None:
    """Mode ``curves``: ``action`` run (train and decode every part: ``store``, ``runs``, ``points``;
    ``variant`` with its Hydra ``overrides``: a lever tried on the families, beside their curves; a
    variant alone reruns the recipe as it is now beside a curve recorded earlier),
    report (the page ``out`` from ``runs``) or package (part ``part`` of ``family`` as the checkpoint
    folder ``dest``; ``record_only``: no weights; ``best_k`` with ``best_k_measured``: the fastest k and
    what measured it). Every option is checked before any work."""
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"unknown families {unknown}: {list(FAMILIES)}")
    if overrides and not variant:  # they would train into the family's own curve
        raise SystemExit("overrides need a variant: a lever has a name, beside the family's curve")
    if action == "package":
        if family not in FAMILIES or part is None or not dest:
            raise SystemExit(f"package needs family (one of {list(FAMILIES)}), part and dest")
        if part < 0:
            raise SystemExit(f"part must be >= 0, got {part}")
        if (best_k is None) != (not best_k_measured):
            raise SystemExit("best_k and best_k_measured go together: a best k is recorded with what measured it")
        if best_k is not None and best_k < 1:
            raise SystemExit(f"best_k must be >= 1, got {best_k}")
        best = {"k": best_k, "measured": best_k_measured} if best_k is not None else None
        print(package(Path(runs), family, part, Path(dest), not record_only, best))
    elif action == "run":
        if not store:
            raise SystemExit("run needs store, the feature store folder (mode store fills it)")
        run(store, runs, list(families), list(points), batch, eval_sequences, prompts, k, max_new_tokens, threads,
            bf16, poll, variant, list(overrides))
    elif action == "report":
        report(runs, list(families), out)
    else:
        raise SystemExit(f"action must be run, report or package, got {action!r}")

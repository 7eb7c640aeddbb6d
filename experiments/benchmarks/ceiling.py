"""The ceiling study: how high can a learned head go on SmolLM2-135M, and what holds it back?

Each arm trains one head from scratch through the one trainer (the recipe as committed, every arm
with the same batch, schedule shape and precision) and decodes the curves' held-out prompts
(:func:`benchmarks.learning_curves.decode`: the first 8 MT-bench first turns and HumanEval problems,
48 new tokens, greedy chain at k = 4), so every arm is read by the same figure, the mean accepted
length. The arms answer the questions in pairs:

- ``fresh`` / ``fresh_seed1``: the same arm with another seed, the noise floor every pair is read against;
- ``fresh`` / ``epochs``: the store's first ``tokens`` training tokens once, against its first
  ``tokens / epochs`` tokens repeated over the same number of steps (more data or more passes?);
- ``fresh`` / ``anchors``: every response position against 64 sampled anchors a sequence
  (``options.anchors=64``), at equal tokens and steps;
- ``on_policy`` / ``text``: the store's sequences of the target's own answers (source ``corpus``)
  against human text (``sharegpt``), ``tokens`` each; both labelled with the target's distribution;
- ``fresh`` / ``tokens_only``: ``fresh``'s head decoded with its feature projection zeroed (``fc``'s
  weight: the head then reads the tokens and its own outputs alone): does the head use the features?
- ``overfit``: the held-out prompts' own greedy continuations (exactly what decoding them produces),
  trained on for ``overfit_steps`` steps: the bound a head of this shape reaches on text it has
  memorised. ``overfit_mtp``: the same for the post-hoc MTP head.

    .venv/bin/python experiments/run.py --config-name lab/ceiling store=outputs/store/smollm2-135m \\
        runs=outputs/ceiling tokens=300000
    .venv/bin/python experiments/run.py --config-name lab/ceiling action=report runs=outputs/ceiling

Runs resume: an arm whose ``training.json`` and ``decoded.json`` exist is skipped, an interrupted
training resumes from its state.
"""

from __future__ import annotations

import datetime
import json
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.learning_curves import decode, held_out_prompts, part_command, parts, store_rows
from specdec.provenance import command_line

__all__ = ["ARMS", "Arm", "arm_plan", "ceiling", "QUESTION"]

QUESTION = (
    "What holds the learned heads back on SmolLM2-135M? Each arm trains one head from scratch through the one "
    "trainer (the committed recipe; batch 4, bf16 autocast, one thread) and decodes the learning curves' held-out "
    "prompts (the first 8 MT-bench first turns and HumanEval problems, 48 new tokens, greedy chain at k = 4), so "
    "every arm is read by one figure, the mean accepted length (MAL). Pairs: fresh / fresh_seed1 (the noise floor: "
    "another seed), fresh / epochs (more data or more "
    "passes, equal steps), fresh / anchors (every position or 64 sampled anchors), on_policy / text (the target's "
    "own answers or human ShareGPT text, equal tokens, the target's distribution the label in both), fresh / "
    "tokens_only (fresh's head with its feature projection zeroed: does it use the features?), and the over-fit "
    "bound (trained on the held-out prompts' own continuations). Distinct tokens: the data the arm drew from; "
    "tokens trained: what its steps read (repeats counted); held-out acceptance: the trainer's own teacher-forced "
    "figure at depth 1 on the store's held-out rows.")


@dataclass(frozen=True)
class Arm:
    question: str  # what the arm is compared for
    family: str = "eagle3"
    sources: tuple[str, ...] = ()  # the store's sources it trains on (empty: all)
    share: int = 1  # trains on the first tokens/share training tokens, over fresh's number of steps
    overrides: tuple[str, ...] = ()
    from_arm: str = ""  # decoded from that arm's checkpoint with fc's weight zeroed (no training)
    overfit: bool = False  # trains on the held-out prompts' own continuations


ARMS: dict[str, Arm] = {
    "fresh": Arm("every response position, the store's first `tokens` training tokens once (all sources)"),
    "fresh_seed1": Arm("the noise floor: fresh again with another seed (initialisation and batch order)",
                       overrides=("seed=1",)),
    "epochs": Arm("fresh data or more passes: the first tokens/3, three times, in fresh's steps", share=3),
    "anchors": Arm("every position or anchors: 64 sampled anchors a sequence, fresh's data and steps",
                   overrides=("options.anchors=64",)),
    "on_policy": Arm("on-policy data: the target's own answers (store source corpus), `tokens` of them",
                     sources=("corpus",)),
    "text": Arm("text: human ShareGPT answers (store source sharegpt), `tokens` of them, the target's labels",
                sources=("sharegpt",)),
    "tokens_only": Arm("does the head use the features: fresh's head, its feature projection zeroed",
                       from_arm="fresh"),
    "overfit": Arm("the over-fit bound: trained on the held-out prompts' own continuations", overfit=True),
    "overfit_mtp": Arm("the over-fit bound of the post-hoc MTP head", family="mtp", overfit=True),
}


def arm_plan(rows: tuple[list[int], list[bool], list[str]], arm: Arm, tokens: int, batch: int
             ) -> tuple[int, int, int]:
    """(sequences used, steps, training tokens) of a store arm. All sources: the store's first
    sequences whose training tokens reach ``tokens / share``, over the steps that ``tokens`` take
    (fresh's: arms compared at equal steps are). Named sources: the first ``tokens`` of theirs,
    one pass (equal tokens)."""
    lengths, held, source = rows
    keep = [not arm.sources or s in arm.sources for s in source]
    ls, hs = [n for n, k in zip(lengths, keep) if k], [h for h, k in zip(held, keep) if k]

    def first(want: int) -> tuple[int, int, int]:
        plan = parts(ls, hs, [want])
        if not plan:
            raise ValueError(f"the store holds fewer than {want:,} training tokens of "
                             f"{'sources ' + ', '.join(arm.sources) if arm.sources else 'its sources'}")
        _, use, got = plan[0]
        return use, -(-sum(1 for h in hs[:use] if not h) // batch), got

    use, steps, got = first(tokens // arm.share)
    if arm.share > 1:
        steps = first(tokens)[1]
    return use, steps, got


def _overfit_data(target, folder: Path, prompts: dict[str, list[list[int]]], max_new_tokens: int) -> Path:
    """The held-out prompts with the target's own greedy continuations (what decoding them
    produces, token for token), as one data set file (``save_sequences``)."""
    import torch

    import specdec
    from specdec.data.sequences import TokenSeq, save_sequences

    path = folder / "overfit-data.safetensors"
    if path.is_file():
        return path
    seqs = []
    for ps in prompts.values():
        res = specdec.generate(target, ps, None, verifier="greedy", max_new_tokens=max_new_tokens, progress=False)
        seqs += [TokenSeq(torch.tensor(p + t), len(p)) for p, t in zip(ps, res.tokens)]
    folder.mkdir(parents=True, exist_ok=True)
    save_sequences(path, seqs, {"what": "held-out prompts with the target's greedy continuations"})
    return path


def _zero_features(src: Path, dest: Path) -> Path:
    """A copy of an EAGLE-3 checkpoint folder whose ``fc.weight`` is zero: the fused feature input
    is then constant, so the head drafts from the tokens and its own outputs alone."""
    import shutil

    from safetensors.torch import load_file, save_file

    if (dest / "model.safetensors").is_file():
        return dest
    shutil.copytree(src, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("decoded.json"))
    weights = load_file(str(src / "model.safetensors"))
    if "fc.weight" not in weights:
        raise ValueError(f"{src} has no fc.weight: not an EAGLE-3 checkpoint")
    weights["fc.weight"] = weights["fc.weight"].new_zeros(weights["fc.weight"].shape)
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def run(store: str, runs: str, arms: list[str], tokens: int, batch: int, eval_sequences: int, prompts: int, k: int,
        max_new_tokens: int, threads: int, bf16: bool, overfit_steps: int) -> None:
    """Train (resuming) and decode every arm in ``arms``, in order."""
    import torch

    from specdec.api import load_target

    folder = Path(runs)
    torch.set_num_threads(threads)
    target = load_target("smollm2-135m")
    asked = held_out_prompts(target, prompts)
    rows = store_rows(Path(store))
    for name in arms:
        arm = ARMS[name]
        out = folder / name
        meta: dict[str, Any] = {"arm": name, "question": arm.question, "family": arm.family}
        if arm.from_arm:
            checkpoint = _zero_features(folder / arm.from_arm, out)
            meta.update(from_arm=arm.from_arm)
        else:
            checkpoint = out
            if arm.overfit:
                data = _overfit_data(target, folder, asked, max_new_tokens)
                cmd = part_command(arm.family, store, runs, 0, 0, 1, overfit_steps, batch, eval_sequences, threads,
                                   bf16=bf16)
                # whole prompts, as decoded; every sequence trained (none hashes to 0 modulo a large prime)
                cmd += ["data.store=null", "data.source=distill", f"data.path={data}", "data.use=null",
                        "data.max_prompt=null", "data.held_out_every=1000003"]
                meta.update(steps=overfit_steps, data=str(data))
            else:
                use, steps, got = arm_plan(rows, arm, tokens, batch)
                cmd = part_command(arm.family, store, runs, 0, 0, use, steps, batch, eval_sequences, threads,
                                   bf16=bf16)
                cmd += [*arm.overrides, *([f"data.store_sources=[{','.join(arm.sources)}]"] if arm.sources else [])]
                meta.update(sequences=use, steps=steps, training_tokens=got)
            cmd = [a for a in cmd if not a.startswith(("out=", "work="))] + [f"out={out}", f"work={out}-work"]
            if not (out / "training.json").is_file():
                if (Path(f"{out}-work") / "state.safetensors").is_file():
                    cmd.append("resume=true")
                print("$", shlex.join(cmd), flush=True)
                subprocess.run(cmd, check=True)
        if not (out / "decoded.json").is_file():
            found = decode(target, arm.family, checkpoint, asked, k, max_new_tokens)
            found.update(meta)
            (out / "decoded.json").write_text(json.dumps(found, indent=1))
        print(name, json.dumps({n: json.loads((out / "decoded.json").read_text())[n]["mean_accepted_length"]
                                for n in asked}), flush=True)


def report(runs: str, arms: list[str], out: str) -> None:
    """The study's record (``<out>.json``) from the arms decoded in ``runs``, and its page."""
    from report import write_page  # experiments/: the renderer

    from specdec.provenance import cpu_model, git_sha

    from specdec.data.sequences import load_sequences

    rows = []
    for name in arms:
        dec = Path(runs) / name / "decoded.json"
        if not dec.is_file():
            continue
        d = json.loads(dec.read_text())
        rec_path = Path(runs) / (d.get("from_arm") or name) / "training.json"
        rec = json.loads(rec_path.read_text()) if rec_path.is_file() else {}
        distinct = d.get("training_tokens")
        if distinct is None and d.get("data"):
            distinct = sum(int(q.tokens.numel()) for q in load_sequences(d["data"]))
        if distinct is None:
            distinct = json.loads((Path(runs) / d["from_arm"] / "decoded.json").read_text()).get("training_tokens")
        held = (rec.get("held_out") or {}).get("accept")
        cells = [[f"{d[n]['mean_accepted_length']:.2f}", " ".join(f"{x:.2f}" for x in d[n]["acceptance_at"])]
                 for n in ("mtbench", "humaneval")]
        rows.append([f"`{name}`", d["question"], d["family"], f"{distinct:,}" if distinct else "–",
                     f"{rec.get('tokens', 0):,}", str(rec.get("steps", "–")), f"{rec.get('wall_seconds', 0):.0f}",
                     f"{held[0]:.2f}" if held else "–", *cells[0], *cells[1]])
    page = Path(out).with_suffix(".md")
    page.parent.mkdir(parents=True, exist_ok=True)
    record = {"title": "The ceiling study: what holds the learned heads back on SmolLM2-135M",
              "question": QUESTION,
              "provenance": {"command": command_line(), "git": (git_sha() or "unknown")[:7],
                             "machine": f"{cpu_model()}, one torch thread per training process",
                             "date": datetime.date.today().isoformat(),
                             "settings": "each arm's training command is in its training.json (runs folder)"},
              "tables": [{"columns": ["arm", "what it tests", "head", "distinct tokens", "tokens trained", "steps",
                                      "wall s", "held-out acceptance", "MT-bench MAL", "MT-bench acceptance 1..k",
                                      "HumanEval MAL", "HumanEval acceptance 1..k"],
                          "align": "lllrrrrrrlrl", "rows": rows}]}
    page.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    for path in write_page(page):
        print(path)


def ceiling(runs: str, action: str = "run", store: str | None = None, arms: list[str] = tuple(ARMS),
            tokens: int = 300_000, batch: int = 4, eval_sequences: int = 16, prompts: int = 8, k: int = 4,
            max_new_tokens: int = 48, threads: int = 1, bf16: bool = True, overfit_steps: int = 300,
            out: str = "docs/results/ceiling.md") -> None:
    """Mode ``ceiling``: ``action`` run (train and decode ``arms`` from ``store`` into ``runs``) or
    report (the page ``out`` from ``runs``). Every option is checked before any work."""
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"unknown arms {unknown}: {list(ARMS)}")
    for name in arms:
        first = ARMS[name].from_arm
        if first and first not in arms and not (Path(runs) / first / "model.safetensors").is_file():
            raise SystemExit(f"arm {name} decodes {first}'s head: run {first} too (or first)")
    if tokens < 1 or batch < 1 or overfit_steps < 1:
        raise SystemExit("tokens, batch and overfit_steps must be >= 1")
    if action == "run":
        if not store:
            raise SystemExit("run needs store, the feature store folder (mode store fills it)")
        run(store, runs, list(arms), tokens, batch, eval_sequences, prompts, k, max_new_tokens, threads, bf16,
            overfit_steps)
    elif action == "report":
        report(runs, list(arms), out)
    else:
        raise SystemExit(f"action must be run or report, got {action!r}")

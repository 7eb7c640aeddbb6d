"""Acceptance only: a preset's learned drafters on the held-out MT-bench first turns, greedy, no clock.

    python experiments/acceptance.py --preset smollm2_longer --prompts 40 --k 1 4 --out docs/figures/acceptance_longer

For each method of the preset and each ``--k``, all prompts decode as one batch through the library's
loop with greedy verification, and the table gives the mean accepted length and the acceptance at
each draft depth, with whether every output equals autoregressive decoding's. Nothing here reads a
clock, so the figures are exact on a busy machine (timings come from ``run.py`` with nothing else
running); more prompts than a timed run can afford make them steadier. Only held-out prompts are
used: the first ``HELD_OUT["mtbench"]`` questions, never trained on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

import specdec
from specdec.api import load_target, make_drafter
from specdec.data.config import DatasetConfig
from specdec.data.datasets import load_dataset
from specdec.eval.runner import encode_turn
from specdec.provenance import git_sha
from specdec.target import Target
from specdec.data.datasets import HELD_OUT

ROOT = Path(__file__).resolve().parent
Method = tuple[str, dict[str, Any]]  # (registered drafter, its options)


def preset_methods(preset: str) -> dict[str, Method]:
    """The ``methods`` of an experiment preset (experiments/conf/<preset>.yaml), without their k."""
    node = OmegaConf.load(ROOT / "conf" / f"{preset}.yaml").get("methods")
    methods = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    assert isinstance(methods, dict)
    if not methods:
        raise ValueError(f"preset {preset!r} lists no methods")
    return {name: (m["drafter"], dict(m.get("options") or {})) for name, m in methods.items()}


def held_out_prompts(target: Target, n: int) -> list[list[int]]:
    """The first ``n`` MT-bench first turns, chat-encoded: held out from every training run."""
    if not 1 <= n <= HELD_OUT["mtbench"]:
        raise ValueError(f"--prompts must lie in [1, {HELD_OUT['mtbench']}]: only those MT-bench questions are held out")
    samples = load_dataset(DatasetConfig(name="mtbench", num_prompts=n, turns=1), target.tokenizer)
    return [encode_turn(target, s, 0, [], chat=True) for s in samples]


def acceptance(target: Target, methods: dict[str, Method], prompts: list[list[int]], ks: list[int],
               max_new_tokens: int) -> list[dict[str, Any]]:
    """One row per method and k: mean accepted length, acceptance per depth, outputs equal to AR."""
    ar = specdec.generate(target, prompts, None, max_new_tokens=max_new_tokens, verifier="greedy", progress=False)
    rows = []
    for name, (drafter, options) in methods.items():
        for k in ks:
            res = specdec.generate(target, prompts, make_drafter(drafter, target, **options), k=k, verifier="greedy",
                                   max_new_tokens=max_new_tokens, progress=False)
            s = res.summary
            rows.append(dict(method=name, drafter=drafter, k=k, prompts=len(prompts), new_tokens=s.new_tokens,
                             steps=s.steps, mean_accepted_length=s.mean_accepted_length,
                             acceptance_at=s.acceptance_at,
                             identical=sum(a == b for a, b in zip(res.tokens, ar.tokens))))
    return rows


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "", "| method | drafter | k | mean accepted length | acceptance at depths 1..k | identical to AR |",
             "|---|---|---:|---:|---|---:|"]
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_at"])
        lines.append(f"| {r['method']} | {r['drafter']} | {r['k']} | {r['mean_accepted_length']:.2f} | {acc} | "
                     f"{r['identical']}/{r['prompts']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True, help="an experiments/conf preset whose methods to measure")
    ap.add_argument("--methods", nargs="*", default=None, help="only these of its methods")
    ap.add_argument("--prompts", type=int, default=HELD_OUT["mtbench"], help="held-out MT-bench first turns")
    ap.add_argument("--k", type=int, nargs="+", default=[4], help="draft lengths")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True, help="folder for acceptance.json and acceptance.md")
    args = ap.parse_args()
    methods = preset_methods(args.preset)
    unknown = sorted(set(args.methods or []) - methods.keys())
    if unknown:
        raise SystemExit(f"--methods {unknown} are not in preset {args.preset!r} ({sorted(methods)})")
    methods = {n: m for n, m in methods.items() if not args.methods or n in args.methods}
    target = load_target("smollm2-135m", threads=args.threads)
    prompts = held_out_prompts(target, args.prompts)
    rows = acceptance(target, methods, prompts, args.k, args.max_new_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python experiments/acceptance.py " + " ".join(
        [f"--preset {args.preset}", f"--prompts {args.prompts}", "--k " + " ".join(map(str, args.k)),
         f"--max-new-tokens {args.max_new_tokens}"] + (["--methods " + " ".join(args.methods)] if args.methods else []))
    (args.out / "acceptance.json").write_text(json.dumps(dict(command=command, revision=git_sha(), rows=rows), indent=1))
    header = (f"`{command}` (revision {git_sha()[:10]}): smollm2-135m fp32, {len(prompts)} held-out MT-bench first "
              f"turns decoded as one batch, {args.max_new_tokens} new tokens, greedy")
    (args.out / "acceptance.md").write_text(markdown(rows, header))
    print(markdown(rows, header))


if __name__ == "__main__":
    main()

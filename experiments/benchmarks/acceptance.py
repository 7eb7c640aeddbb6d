"""Acceptance only: a preset's learned drafters on the held-out MT-bench first turns, greedy, no clock.

    python experiments/bench.py acceptance --preset drafters_mtbench --prompts 40 --k 1 4 --out <folder>

For each method of the preset and each ``--k``, all prompts decode as one batch through the library's
loop with greedy verification, and the table gives the mean accepted length and the acceptance at
each draft depth, with whether every output equals autoregressive decoding's. Nothing here reads a
clock, so the figures are exact on a busy machine (timings come from ``run.py`` with nothing else
running); more prompts than a timed run can afford make them steadier. Only held-out prompts are
used: the first ``HELD_OUT["mtbench"]`` questions (``--dataset humaneval``: the first
``HELD_OUT["humaneval"]`` prompts), never trained on.

``--temperature T`` samples instead (request i with seed i, the same in every method), verified by
``rejection``; with ``--compare-block`` by ``block`` (:class:`specdec.verifiers.BlockVerifier`), which
also computes, on every step's drafts, the exact expected accepted length of block verification and
of token-wise rejection sampling: a paired comparison of the two verifiers on the same drafts,
without either verifier's sampling noise::

    python experiments/bench.py acceptance --preset block_vs_rejection --dataset humaneval --temperature 1 \
        --compare-block --k 2 4 7 --prompts 16 --out <folder>

``--dataset stdlib --context N [N ...]`` asks how acceptance moves with the prompt's length: held-out
standard-library code cut to each N tokens (continued into the next held-out files where one is
short), one table row per context, method and k::

    python experiments/bench.py acceptance --preset context_length --methods eagle3 eagle3_window dspark \
        --dataset stdlib --context 128 1024 4000 7500 --prompts 2 --k 4 --max-new-tokens 32 --out <folder>
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
from specdec.sampling import SamplingParams
from specdec.target import Target
from specdec.data.datasets import HELD_OUT
from specdec.verifiers import BlockVerifier

ROOT = Path(__file__).resolve().parents[1]  # experiments/
Method = tuple[str, dict[str, Any]]  # (registered drafter, its options)


def preset_methods(preset: str) -> dict[str, Method]:
    """The ``methods`` of an experiment preset (experiments/conf/<preset>.yaml), without their k."""
    node = OmegaConf.load(ROOT / "conf" / f"{preset}.yaml").get("methods")
    methods = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    assert isinstance(methods, dict)
    if not methods:
        raise ValueError(f"preset {preset!r} lists no methods")
    return {name: (m["drafter"], dict(m.get("options") or {})) for name, m in methods.items()}


def held_out_prompts(target: Target, n: int, dataset: str = "mtbench") -> list[list[int]]:
    """The first ``n`` MT-bench first turns (or HumanEval prompts), chat-encoded: held out from every training run."""
    if not 1 <= n <= HELD_OUT[dataset]:
        raise ValueError(f"--prompts must lie in [1, {HELD_OUT[dataset]}]: only those {dataset} prompts are held out")
    samples = load_dataset(DatasetConfig(name=dataset, num_prompts=n, turns=1), target.tokenizer)
    return [encode_turn(target, s, 0, [], chat=True) for s in samples]


def stdlib_prompts(target: Target, n: int, context: int) -> list[list[int]]:
    """``n`` prompts of exactly ``context`` token ids of held-out standard-library code (never trained on)."""
    samples = load_dataset(DatasetConfig(name="stdlib", num_prompts=n, input_len=context), target.tokenizer)
    prompts = [list(s.prompt_ids or []) for s in samples]
    short = [len(p) for p in prompts if len(p) != context]
    if short:
        raise ValueError(f"the held-out standard library gave prompts of {short} tokens, not {context}")
    return prompts


def acceptance(target: Target, methods: dict[str, Method], prompts: list[list[int]], ks: list[int],
               max_new_tokens: int, temperature: float = 0.0, compare_block: bool = False) -> list[dict[str, Any]]:
    """One row per method and k: mean accepted length, acceptance per depth, outputs equal to AR
    (greedy only); sampled with ``temperature`` > 0, and with ``compare_block`` the paired expected
    accepted lengths of block and token-wise verification (bonus token included, as the mean)."""
    greedy = temperature == 0
    sampling = [SamplingParams(temperature=temperature, seed=i) for i in range(len(prompts))]
    ar = specdec.generate(target, prompts, None, max_new_tokens=max_new_tokens, verifier="greedy",
                          progress=False) if greedy else None
    rows = []
    for name, (drafter, options) in methods.items():
        for k in ks:
            verifier = BlockVerifier(compare=True) if compare_block else "greedy" if greedy else "rejection"
            res = specdec.generate(target, prompts, make_drafter(drafter, target, **options), k=k, verifier=verifier,
                                   sampling=sampling, max_new_tokens=max_new_tokens, progress=False)
            s = res.summary
            row = dict(method=name, drafter=drafter, k=k, prompts=len(prompts), new_tokens=s.new_tokens,
                       steps=s.steps, mean_accepted_length=s.mean_accepted_length, acceptance_at=s.acceptance_at,
                       identical=None if ar is None else sum(a == b for a, b in zip(res.tokens, ar.tokens)))
            if isinstance(verifier, BlockVerifier):
                c = verifier.compared
                row.update(compared_rows=c["rows"], expected_block=1 + c["block"] / max(c["rows"], 1),
                           expected_token_wise=1 + c["token_wise"] / max(c["rows"], 1),
                           tree_fallback_steps=verifier.tree_fallback_steps)
            rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    if rows and "expected_block" in rows[0]:  # the paired comparison of the two verifiers
        lines = [header, "", "| method | drafter | k | steps | expected accepted length, token-wise (rejection) | "
                 "expected, block | block − rejection | block's realised mean accepted length |",
                 "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            gain = r["expected_block"] - r["expected_token_wise"]
            lines.append(f"| {r['method']} | {r['drafter']} | {r['k']} | {r['compared_rows']} | "
                         f"{r['expected_token_wise']:.3f} | {r['expected_block']:.3f} | {gain:+.3f} | "
                         f"{r['mean_accepted_length']:.2f} |")
        return "\n".join(lines) + "\n"
    ctx = bool(rows) and "context" in rows[0]
    lines = [header, "", ("| context |" if ctx else "|") + " method | drafter | k | mean accepted length | "
             "acceptance at depths 1..k | identical to AR |", ("|---:|" if ctx else "|") + "---|---|---:|---:|---|---:|"]
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_at"])
        same = "-" if r["identical"] is None else f"{r['identical']}/{r['prompts']}"
        lines.append((f"| {r['context']:,} |" if ctx else "|") + f" {r['method']} | {r['drafter']} | {r['k']} | "
                     f"{r['mean_accepted_length']:.2f} | {acc} | {same} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True, help="an experiments/conf preset whose methods to measure")
    ap.add_argument("--methods", nargs="*", default=None, help="only these of its methods")
    ap.add_argument("--prompts", type=int, default=HELD_OUT["mtbench"], help="held-out prompts")
    ap.add_argument("--dataset", choices=["mtbench", "humaneval", "stdlib"], default="mtbench")
    ap.add_argument("--context", type=int, nargs="+", default=None,
                    help="stdlib only: prompt lengths in tokens, one table row per context, method and k")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled, request i seeded i")
    ap.add_argument("--compare-block", action="store_true",
                    help="verify with block and compare its expected accepted length with rejection's on the same drafts")
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
    if args.compare_block and args.temperature == 0:
        raise SystemExit("--compare-block needs --temperature above 0: at temperature 0 both verifiers are the argmax rule")
    if (args.dataset == "stdlib") != (args.context is not None):
        raise SystemExit("--context goes with --dataset stdlib, and --dataset stdlib needs --context")
    if args.context is not None and min(args.context) < 1:
        raise SystemExit(f"--context must be positive token counts, got {args.context}")
    target = load_target("smollm2-135m", threads=args.threads)
    if args.context is None:
        prompts = held_out_prompts(target, args.prompts, args.dataset)
        rows = acceptance(target, methods, prompts, args.k, args.max_new_tokens, args.temperature, args.compare_block)
    else:
        rows = []
        for n in args.context:
            prompts = stdlib_prompts(target, args.prompts, n)
            for row in acceptance(target, methods, prompts, args.k, args.max_new_tokens, args.temperature,
                                  args.compare_block):
                rows.append(dict(row, context=n))
                print(markdown(rows[-1:], f"context {n}"), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python experiments/bench.py acceptance " + " ".join(
        [f"--preset {args.preset}", f"--prompts {args.prompts}", "--k " + " ".join(map(str, args.k)),
         f"--max-new-tokens {args.max_new_tokens}"] + (["--methods " + " ".join(args.methods)] if args.methods else [])
        + ([f"--dataset {args.dataset}"] if args.dataset != "mtbench" else [])
        + (["--context " + " ".join(map(str, args.context))] if args.context else [])
        + ([f"--temperature {args.temperature:g}"] if args.temperature else [])
        + (["--compare-block"] if args.compare_block else []))
    (args.out / "acceptance.json").write_text(json.dumps(dict(command=command, revision=git_sha(), rows=rows), indent=1))
    what = {"mtbench": "MT-bench first turns", "humaneval": "HumanEval prompts",
            "stdlib": "standard-library code prompts at each context"}[args.dataset]
    how = f"temperature {args.temperature:g}, request i seeded i" if args.temperature else "greedy"
    header = (f"`{command}` (revision {git_sha()[:10]}): smollm2-135m fp32, {len(prompts)} held-out {what} "
              f"decoded as one batch, {args.max_new_tokens} new tokens, {how}")
    (args.out / "acceptance.md").write_text(markdown(rows, header))
    print(markdown(rows, header))


if __name__ == "__main__":
    main()

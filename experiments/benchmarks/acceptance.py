"""Acceptance only: a preset's learned drafters on the held-out MT-bench first turns, greedy, no clock.

    python experiments/run.py --config-name lab/acceptance preset=drafters_mtbench prompts=40 k=[1,4] out=<folder>

For each method of the preset and each ``k``, all prompts decode as one batch through the library's
loop with greedy verification, and the table gives the mean accepted length and the acceptance at
each draft depth, with whether every output equals autoregressive decoding's. Nothing here reads a
clock, so the figures are exact on a busy machine (timings come from ``run.py`` with nothing else
running); more prompts than a timed run can afford make them steadier. Only held-out prompts are
used: the first ``HELD_OUT["mtbench"]`` questions (``dataset=humaneval``: the first
``HELD_OUT["humaneval"]`` prompts), never trained on.

``temperature=T`` samples instead (request i with seed i, the same in every method), verified by
``rejection``; with ``compare_block=true`` by ``block`` (:class:`specdec.verifiers.BlockVerifier`), which
also computes, on every step's drafts, the exact expected accepted length of block verification and
of token-wise rejection sampling: a paired comparison of the two verifiers on the same drafts,
without either verifier's sampling noise::

    python experiments/run.py --config-name lab/acceptance preset=block_vs_rejection dataset=humaneval \
        temperature=1 compare_block=true k=[2,4,7] prompts=16 out=<folder>

``dataset=stdlib context=[N, ...]`` asks how acceptance moves with the prompt's length: held-out
standard-library code cut to each N tokens (continued into the next held-out files where one is
short), one table row per context, method and k::

    python experiments/run.py --config-name lab/acceptance preset=context_length \
        methods=[eagle3,eagle3_window,dspark] dataset=stdlib context=[128,1024,4000,7500] prompts=2 k=[4] \
        max_new_tokens=32 out=<folder>
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

import specdec
from specdec.api import load_target, make_drafter
from specdec.data.config import DatasetConfig
from specdec.data.datasets import load_dataset
from specdec.eval.runner import encode_turn
from specdec.provenance import command_line, git_sha
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


def measure(preset: str, out: str, methods: list[str] | None = None, prompts: int = HELD_OUT["mtbench"],
            dataset: str = "mtbench", context: list[int] | None = None, temperature: float = 0.0,
            compare_block: bool = False, k: list[int] = (4,), max_new_tokens: int = 48, threads: int = 1) -> None:
    """Mode ``acceptance``: each of ``preset``'s methods (or only ``methods``) at each ``k`` on the held-out
    prompts of ``dataset``; ``acceptance.json`` and ``acceptance.md`` into ``out``."""
    ks = list(k)
    found = preset_methods(preset)
    unknown = sorted(set(methods or []) - found.keys())
    if unknown:
        raise SystemExit(f"methods {unknown} are not in preset {preset!r} ({sorted(found)})")
    chosen = {n: m for n, m in found.items() if not methods or n in methods}
    if dataset not in ("mtbench", "humaneval", "stdlib"):
        raise SystemExit(f"dataset must be mtbench, humaneval or stdlib, got {dataset!r}")
    if compare_block and temperature == 0:
        raise SystemExit("compare_block needs temperature above 0: at temperature 0 both verifiers are the argmax rule")
    if (dataset == "stdlib") != (context is not None):
        raise SystemExit("context goes with dataset=stdlib, and dataset=stdlib needs context")
    if context is not None and min(context) < 1:
        raise SystemExit(f"context must be positive token counts, got {context}")
    target = load_target("smollm2-135m", threads=threads)
    if context is None:
        asked = held_out_prompts(target, prompts, dataset)
        rows = acceptance(target, chosen, asked, ks, max_new_tokens, temperature, compare_block)
    else:
        rows = []
        for n in context:
            asked = stdlib_prompts(target, prompts, n)
            for row in acceptance(target, chosen, asked, ks, max_new_tokens, temperature, compare_block):
                rows.append(dict(row, context=n))
                print(markdown(rows[-1:], f"context {n}"), flush=True)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    command = command_line()
    (folder / "acceptance.json").write_text(json.dumps(dict(command=command, revision=git_sha(), rows=rows), indent=1))
    what = {"mtbench": "MT-bench first turns", "humaneval": "HumanEval prompts",
            "stdlib": "standard-library code prompts at each context"}[dataset]
    how = f"temperature {temperature:g}, request i seeded i" if temperature else "greedy"
    header = (f"`{command}` (revision {(git_sha() or '')[:10]}): smollm2-135m fp32, {len(asked)} held-out {what} "
              f"decoded as one batch, {max_new_tokens} new tokens, {how}")
    (folder / "acceptance.md").write_text(markdown(rows, header))
    print(markdown(rows, header))

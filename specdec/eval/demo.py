"""Speculative decoding on the offline SmolLM2-135M-Instruct against plain autoregressive decoding,
both measured by the same loop in the same process, interleaved, with the costs that decide which
one wins.

    specdec-demo                                  # ngram drafter, a code-editing prompt
    specdec-demo --drafter suffix                 # another model-free drafter
    specdec-demo --drafter eagle3 --k 2           # a committed SmolLM2 drafter, found by name
    specdec-demo --prompt "Explain KV caches." --json

After a warm-up of both, the demo runs autoregressive and speculative decoding in turns over
``--repeats`` rounds (the order alternating, so that a machine that slows down or speeds up weighs
on both alike), and prints the median tokens/s of each, the speedup of every round, their median and
spread, and a verdict: faster or slower only when every round agrees, otherwise that the spread is
larger than the difference. Timings taken while other work shares the cores measure that work, so
the demo reads the load average before and after the rounds and gives no verdict while other load
leaves fewer free cores than the threads it decodes with. Verifying k+1 tokens is not free, so a
drafter must be accepted often to pay for it: the demo splits the median round's time per step into the
measured draft and verify costs and the rest, the same round the verdict's median speedup is, so
the two never disagree, and says the accepted length speculation needs to pay.

The drafters offered are those that run from a fresh clone: the model-free ones (``ngram``,
``suffix``) and every drafter whose SmolLM2 checkpoint is committed (read from
``specdec.checkpoints``: a checkpoint recorded without weights is not offered).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

PROMPT = """Add type hints to this function and return the whole function, unchanged otherwise.

def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
"""

TARGET = "smollm2-135m"
TARGET_CONTEXT = 8192
"""SmolLM2-135M-Instruct's context window (``max_position_embeddings``), so that a ``--k`` or
``--max-new-tokens`` that cannot fit is refused before the model loads (tests/test_smollm2.py checks
it against the loaded model)."""
MODEL_FREE_K = {"ngram": 8, "suffix": 8}
"""The model-free drafters' draft length: long, since drafts cost next to nothing to make and a code
edit copies long spans (both were benchmarked at k = 8: docs/results.md, "Adaptive draft length and
suffix decoding")."""
TRAINED_K = 1
"""A trained drafter whose checkpoint records no best k: the committed heads are accepted at the first
position mostly (docs/results.md, "All drafters on the same prompts")."""
REPEATS = 3


def _recipe_drafter(record: dict) -> str | None:
    """The drafter a ``training.json`` trained (its recipe lives in ``specdec.drafters.<name>.train``)."""
    recipe = str(record.get("config", {}).get("recipe", ""))
    parts = recipe.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["specdec", "drafters"] else None


def _checkpoint_records() -> list[tuple[str, dict, bool]]:
    """(name, training.json, committed) of every SmolLM2 checkpoint shipped with specdec
    (``specdec.checkpoints``): committed when its weights are there (``config.json``), else recorded only."""
    from importlib.resources import files

    try:
        root = Path(str(files("specdec.checkpoints")))
    except ModuleNotFoundError:
        return []
    out = []
    for folder in sorted(p for p in root.iterdir() if (p / "training.json").is_file()):
        record = json.loads((folder / "training.json").read_text())
        if record.get("config", {}).get("target", {}).get("model") == TARGET:
            out.append((folder.name, record, (folder / "config.json").is_file()))
    return out


def smollm2_checkpoints(committed: bool = True) -> dict[str, str]:
    """Drafter name → the checkpoint that names it, for every SmolLM2 checkpoint committed with
    specdec (``committed=False``: recorded without weights, made by their command). Where a drafter
    has several, the one named ``smollm2-135m-<drafter>`` wins, else the first by name."""
    from specdec.registry import DRAFTERS

    out: dict[str, str] = {}
    for name, record, is_committed in _checkpoint_records():
        drafter = _recipe_drafter(record)
        if is_committed != committed or drafter is None or drafter not in DRAFTERS.names():
            continue
        if drafter not in out or name == f"{TARGET}-{drafter.replace('_', '-')}":
            out[drafter] = name
    return out


def offered() -> list[str]:
    """The drafters the demo runs from a fresh clone: the model-free ones, then every drafter with a
    committed SmolLM2 checkpoint."""
    return [*MODEL_FREE_K, *sorted(smollm2_checkpoints())]


def drafter_options(name: str) -> dict:
    """The options that point ``name`` at its committed SmolLM2 checkpoint (none for a model-free one)."""
    ckpt = smollm2_checkpoints().get(name)
    return {"checkpoint": ckpt} if ckpt else {}


def recorded_best_k(folder: Path) -> dict | None:
    """The best measured draft length recorded with a checkpoint: ``best_k`` of its
    ``training.json`` (``{"k": int, "measured": "command and figure"}``), or None when absent."""
    meta = folder / "training.json"
    best = json.loads(meta.read_text()).get("best_k") if meta.is_file() else None
    if best is None:
        return None
    if not (isinstance(best, dict) and isinstance(best.get("k"), int) and not isinstance(best["k"], bool)
            and best["k"] >= 1 and best.get("measured")):
        raise ValueError(f"{meta}: best_k must be {{\"k\": int >= 1, \"measured\": \"command and figure\"}},"
                         f" got {best!r}")
    return best


def default_k(name: str) -> tuple[int, str]:
    """The demo's draft length and where it comes from: :data:`MODEL_FREE_K` for a model-free
    drafter; for a trained one the best k recorded with its checkpoint, else :data:`TRAINED_K`."""
    if name in MODEL_FREE_K:
        return MODEL_FREE_K[name], "the model-free drafters' default (long drafts cost next to nothing)"
    from specdec.models import resolve_checkpoint  # transformers: not for --help

    best = recorded_best_k(resolve_checkpoint(drafter_options(name)["checkpoint"]))
    if best is None:
        return TRAINED_K, "no best k recorded with the checkpoint; position-2 acceptance is near zero"
    return best["k"], f"best measured, recorded with the checkpoint: {best['measured']}"


def median_round(speedups: list[float]) -> int:
    """The round whose speedup is the median (the lower of the middle two for an even count): the
    verdict's median and the cost breakdown both come from it."""
    return sorted(range(len(speedups)), key=lambda i: speedups[i])[(len(speedups) - 1) // 2]


def verdict(speedups: list[float]) -> tuple[str, str]:
    """("faster" | "slower" | "undecided", why) from the speedup of every round: a direction only
    when every round agrees; otherwise the spread is larger than the difference from 1.00x. The
    median is :func:`median_round`'s."""
    lo, hi, med = min(speedups), max(speedups), speedups[median_round(speedups)]
    spread = f"median {med:.2f}x, spread {lo:.2f}x-{hi:.2f}x over {len(speedups)} rounds"
    if lo > 1:
        return "faster", f"speculation is faster in every round ({spread})"
    if hi < 1:
        return "slower", f"speculation is slower in every round ({spread})"
    return "undecided", (f"the spread ({lo:.2f}x-{hi:.2f}x) is larger than the difference from 1.00x"
                         f" (median {med:.2f}x): no verdict on this machine now; rerun with more --repeats"
                         " or when the machine is quieter")


def load_verdict(before: float, after: float, threads: int, cores: int) -> tuple[str, str] | None:
    """("busy", why) when other load (:func:`specdec.few_rows.other_load`) before or after the rounds
    leaves fewer free cores than the demo's threads (:func:`specdec.few_rows.busy`): the rounds then
    measure the contention and no verdict is given. None on a quiet machine."""
    from specdec.few_rows import busy

    worst = max((x for x in (before, after) if math.isfinite(x)), default=float("nan"))
    if not busy(threads, worst, cores):
        return None
    return "busy", (f"no verdict: the machine is busy (other load {before:.1f} before the rounds, {after:.1f} after,"
                    f" on {cores} cores; the demo decodes with {threads} thread{'s' if threads > 1 else ''}), so the rounds"
                    " timed the other work as much as decoding; rerun when the machine is quieter")


def costs(spec, base, outcome: str) -> list[str]:
    """Why speculation won or lost, from one round's two GenerationSummary (:func:`median_round`'s,
    the round the verdict's median is): its time per step split into draft, verify and the rest
    (prefill's share, sampling, the loop), against that round's autoregressive time per token. The
    speedup this implies is that round's, so it agrees with ``outcome`` (the verdict)."""
    if not (spec.tokens_per_s > 0 and base.tokens_per_s > 0):
        return ["no cost breakdown: a run produced no tokens"]
    tau = spec.mean_accepted_length
    ar_ms = 1e3 / base.tokens_per_s  # one autoregressive token, everything included
    step_ms = tau * 1e3 / spec.tokens_per_s  # one speculative step, everything included
    rest = step_ms - spec.draft_ms_per_step - spec.verify_ms_per_step
    need = step_ms / ar_ms
    lines = [f"median round: one autoregressive token {ar_ms:.1f} ms (forward {base.verify_ms_per_step:.1f} + rest"
             f" {ar_ms - base.verify_ms_per_step:.1f}); one speculative step {step_ms:.1f} ms (draft"
             f" {spec.draft_ms_per_step:.1f} + verify {spec.verify_ms_per_step:.1f} + rest {rest:.1f}) = {need:.2f}"
             f" autoregressive tokens"]
    if outcome == "busy":
        tail = " (on a busy machine: not a verdict)"
    elif outcome == "undecided":
        tail = " in this round, but the rounds disagree (see the verdict)"
    else:
        tail = ""
    if tau > need:
        lines.append(f"each step yields {tau:.2f} tokens > {need:.2f}: speculation pays{tail}")
    else:
        lines.append(f"each step yields {tau:.2f} tokens <= {need:.2f}: speculation loses{tail}; it would pay at a mean"
                     f" accepted length above {need:.2f} (more acceptance, a cheaper draft, or a smaller k)")
    return lines


def _threads_help() -> str:
    import os

    return f"torch threads (default: chosen from this machine's {os.cpu_count()} CPUs and its CPU quota)"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec-demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="ngram",
                    help="a model-free drafter (ngram, suffix) or one with a committed SmolLM2 checkpoint;"
                         " the list is printed by a wrong name (default: ngram)")
    ap.add_argument("--k", type=int, default=None,
                    help=f"draft tokens per step (default: ngram and suffix {MODEL_FREE_K['ngram']}; a trained"
                         " drafter the best k measured with its checkpoint, recorded as best_k in its"
                         f" training.json, else {TRAINED_K}, as acceptance beyond the first position is near zero)")
    ap.add_argument("--prompt", default=PROMPT, help="the user message (default: a code-editing request)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="tokens to generate per run (default: 96)")
    ap.add_argument("--repeats", type=int, default=REPEATS,
                    help=f"rounds of autoregressive and speculative runs, interleaved (default: {REPEATS})")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    ap.add_argument("--threads", type=int, default=None, help=_threads_help())
    ap.add_argument("--json", action="store_true", help="print the rounds, the verdict and the summaries as JSON only")
    return ap


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad arguments before anything loads (``ap.error``: a usage line, exit status 2)."""
    for name, value in (("--k", args.k), ("--max-new-tokens", args.max_new_tokens), ("--repeats", args.repeats),
                        ("--threads", args.threads)):
        if value is not None and value < 1:
            ap.error(f"{name} must be at least 1, got {value}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        ap.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.seed < 0:
        ap.error(f"--seed must be >= 0, got {args.seed}")
    if not args.prompt.strip():
        ap.error("--prompt is empty")
    if (args.k or 1) + args.max_new_tokens >= TARGET_CONTEXT:
        asked = f"--k {args.k} with --max-new-tokens" if args.k is not None else "--max-new-tokens"
        ap.error(f"{asked} {args.max_new_tokens} cannot fit SmolLM2-135M's context window of {TARGET_CONTEXT} tokens"
                 " (the prompt, the new tokens and a draft must fit in it together)")
    names = offered()
    if args.drafter not in names:
        recorded = smollm2_checkpoints(committed=False)
        if args.drafter in recorded:
            from specdec.models import remake_time, uncommitted_checkpoints

            command, out = uncommitted_checkpoints()[recorded[args.drafter]]
            ap.error(f"--drafter {args.drafter}: its SmolLM2 checkpoint {recorded[args.drafter]!r} is not committed"
                     f" (size budget); make it, from the repository root, with: {command} (it writes {out};"
                     f" {remake_time(recorded[args.drafter])}); the demo offers: {', '.join(names)}")
        ap.error(f"--drafter {args.drafter!r} is not offered; the demo offers: {', '.join(names)}")


def _rounds(specdec, target, prompt: str, drafter, k: int, repeats: int, common: dict) -> tuple[list, list]:
    """``repeats`` autoregressive and speculative runs, interleaved, each round's order the other's
    reverse: (autoregressive results, speculative results)."""
    base, spec = [], []
    for r in range(repeats):
        order = ("ar", "spec") if r % 2 == 0 else ("spec", "ar")
        for which in order:
            if which == "ar":
                base.append(specdec.generate(target, prompt, None, **common))
            else:
                spec.append(specdec.generate(target, prompt, drafter, k=k, **common))
    return base, spec


def _load(specdec, threads: int | None, say):
    """The target, with its few-row plan tuned (said only when it is measured now: not when it is
    read from the cache, nor on a busy machine, where it is not tuned)."""
    import torch

    from specdec.few_rows import busy, cached_plan, other_load

    target = specdec.load_target(TARGET, dtype=torch.float32, threads=threads, autotune=False)
    if (target.takes_row_plan() and cached_plan(target.model, packed=target.pack) is None
            and not busy(torch.get_num_threads(), other_load())):  # a busy machine is not tuned on
        say("tuning the few-row plan for this machine (once: it is cached for the next runs)")
    target.tune()
    return target


def main(argv: list[str] | None = None) -> None:
    from specdec.timing import now

    started = now()
    ap = parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    k, k_source = (args.k, "--k") if args.k is not None else default_k(args.drafter)

    import torch

    import specdec
    from specdec.few_rows import cores_available, describe, other_load

    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    say(f"loading {TARGET}")
    target = _load(specdec, args.threads, say)
    threads = torch.get_num_threads()
    sampling = specdec.SamplingParams(temperature=args.temperature, seed=args.seed)
    common = dict(sampling=sampling, max_new_tokens=args.max_new_tokens, chat=True, progress=False)
    try:
        drafter = specdec.make_drafter(args.drafter, target, **drafter_options(args.drafter))
        say("warm-up")
        for d in (None, drafter, None, drafter):  # first calls pay for allocation and lazy initialisation
            specdec.generate(target, args.prompt, d, k=k, max_new_tokens=8, chat=True, progress=False)
    except ValueError as e:  # a k the drafter cannot draft, a prompt too long for the target ...
        raise SystemExit(f"specdec-demo: {e}") from None
    say(f"{args.repeats} rounds of autoregressive and speculative decoding, interleaved")
    load_before = other_load(threads, now() - started)  # less our own share so far
    base, spec = _rounds(specdec, target, args.prompt, drafter, k, args.repeats, common)
    load_after = other_load(threads, now() - started)
    cores = cores_available()
    speedups = [s.summary.tokens_per_s / b.summary.tokens_per_s if b.summary.tokens_per_s else float("nan")
                for b, s in zip(base, spec)]
    ar_tps = [b.summary.tokens_per_s for b in base]
    sp_tps = [s.summary.tokens_per_s for s in spec]
    outcome, why = load_verdict(load_before, load_after, threads, cores) or verdict(speedups)
    mid = median_round(speedups)
    identical = (all(s.tokens == base[0].tokens for s in spec) and all(b.tokens == base[0].tokens for b in base)
                 if args.temperature == 0 else None)
    s, b = spec[mid].summary, base[mid].summary
    load = {"before": load_before, "after": load_after, "cores": cores, "threads": threads}

    if args.json:
        baseline = {key: v for key, v in b.to_dict().items() if key not in ("k", "drafter", "policy")}
        print(json.dumps({
            "verdict": outcome, "why": why, "speedup_median": speedups[mid], "speedups": speedups, "median_round": mid,
            "rounds": args.repeats, "identical_to_autoregressive": identical, "threads": threads, "load": load,
            "costs": costs(s, b, outcome), "drafter": args.drafter, "k": k, "k_source": k_source,
            "few_rows": s.few_rows,
            "speculative": {"tokens_per_s": sp_tps, "tokens_per_s_median": statistics.median(sp_tps),
                            "median_round": s.to_dict()},
            "autoregressive": {"tokens_per_s": ar_tps, "tokens_per_s_median": statistics.median(ar_tps),
                               "median_round": baseline}}, indent=2))
        return
    print(spec[mid].texts[0] if spec[mid].texts else spec[mid].tokens[0])
    print("-" * 72)
    print(f"target: SmolLM2-135M-Instruct (fp32, CPU, {threads} thread{'s' if threads > 1 else ''})   drafter: {args.drafter}"
          f"   temperature={args.temperature}")
    print(f"k={k}: {k_source}")
    plan = s.few_rows
    if plan is not None:
        rows = ", ".join(f"{r}: {how}" for r, how in plan["plan"].items()) or "F.linear at every row count"
        print(f"few-row plan: {rows}")
        print(f"  ({describe(plan)})")
    print(f"load: other load {load_before:.1f} before the rounds, {load_after:.1f} after, on {cores} cores")
    print(f"{args.repeats} rounds, interleaved (median, and min-max over rounds):")
    print(f"autoregressive : {statistics.median(ar_tps):7.1f} tokens/s  ({min(ar_tps):.1f}-{max(ar_tps):.1f};"
          f" {b.new_tokens} tokens a run)")
    print(f"speculative    : {statistics.median(sp_tps):7.1f} tokens/s  ({min(sp_tps):.1f}-{max(sp_tps):.1f};"
          f" {s.new_tokens} tokens a run)")
    print(f"speedup        : {speedups[mid]:.2f}x median; per round "
          + " ".join(f"{x:.2f}x" for x in speedups))
    print(f"verdict        : {outcome}: {why}")
    print(f"mean accepted length (bonus included): {s.mean_accepted_length:.2f} tokens/step"
          f"   acceptance by position: " + " ".join(f"{a:.2f}" for a in s.acceptance_at))
    for line in costs(s, b, outcome):
        print(line)
    if identical is not None:
        print(f"identical to autoregressive output: {identical}")


if __name__ == "__main__":
    main()

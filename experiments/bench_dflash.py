"""DFlash and DSpark drafting for SmolLM2-135M-Instruct: acceptance and wall-clock speedup.

On the first ``--prompts`` MT-bench first turns and HumanEval prompts (both held out from the
drafters' training data, :data:`specdec.training.data.HELD_OUT`), greedy and at temperature 1, batch
size 1, in one process, it runs autoregressive decoding (the same loop, no drafter) and:

- ``dflash b=4/8/16``: the committed DFlash drafter (trained at block 8) at ``k = b − 1`` drafts
  (block 16 runs positions it was never trained on);
- ``dspark γ=4/8``: the committed DSpark drafter at ``k = γ`` drafts, without and with the prefix
  scheduler (``+sched``; its step-cost table is profiled once at start-up and cached).

Methods are interleaved per prompt after one warm-up each, so drift of the shared machine hits
all alike. It prints, per dataset and temperature, mean accepted length (bonus included),
acceptance per position (the rate at which a draft at that depth survived, given it was
verified), tokens/s and speedup over autoregressive decoding in the same run. Then the scheduler
at batch sizes ``--batches`` (MT-bench prompts, greedy) against autoregressive decoding at the
same batch size. Greedy outputs are checked identical to autoregressive decoding.

    .venv/bin/python experiments/bench_dflash.py --prompts 5 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

torch.set_num_threads(1)  # the 2 cores are shared; 2 threads under contention are much slower

import specdec  # noqa: E402
from specdec.eval.runner import encode_turn  # noqa: E402
from specdec.eval.config import DatasetConfig  # noqa: E402
from specdec.eval.datasets import load_dataset  # noqa: E402
from specdec.drafters.dflash.drafter import DFlashDrafter  # noqa: E402
from specdec.drafters.dspark.drafter import DSparkDrafter  # noqa: E402
from specdec.loop import Request, run  # noqa: E402
from specdec.metrics import summarize  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.verifiers import GreedyVerifier, RejectionVerifier  # noqa: E402

CKPT = Path(__file__).parent / "checkpoints"


def prompts(target, name: str, n: int) -> list[list[int]]:
    samples = load_dataset(DatasetConfig(name=name, num_prompts=n, turns=1))
    return [encode_turn(target, s, 0, [], chat=True) for s in samples]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dflash", default=str(CKPT / "smollm2-135m-dflash"))
    ap.add_argument("--dspark", default=str(CKPT / "smollm2-135m-dspark"))
    ap.add_argument("--prompts", type=int, default=5, help="first N of each dataset")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16, 32])
    ap.add_argument("--batch-new-tokens", type=int, default=32)
    args = ap.parse_args()

    target = specdec.load_target("smollm2-135m")
    eos = target.eos_token_ids
    t_prof = time.perf_counter()
    methods: dict[str, tuple[object | None, int]] = {"autoregressive": (None, 1)}
    for b in (4, 8, 16):
        methods[f"dflash b={b}"] = (DFlashDrafter.create(target, checkpoint=args.dflash), b - 1)
    for g in (4, 8):
        methods[f"dspark γ={g}"] = (DSparkDrafter.create(target, checkpoint=args.dspark), g)
    for g in (4, 8):
        d = DSparkDrafter.create(target, checkpoint=args.dspark)
        d.scheduler, d.costs = True, d.profile(target, gamma=g)
        methods[f"dspark γ={g} +sched"] = (d, g)
    print(f"drafters loaded, step costs profiled in {time.perf_counter() - t_prof:.0f}s", flush=True)

    def once(name: str, batch: list[list[int]], n: int, temp: float, seed: int):
        drafter, k = methods[name]
        verifier = GreedyVerifier() if temp == 0 else RejectionVerifier()
        reqs = [Request(p, n, SamplingParams(temperature=temp, seed=seed + i)) for i, p in enumerate(batch)]
        with torch.inference_mode():
            return run(target, drafter, verifier, reqs, k=k, eos_token_ids=eos)

    data = {name: prompts(target, name, args.prompts) for name in ("mtbench", "humaneval")}
    for name in methods:  # warm-up
        once(name, [data["mtbench"][0]], 8, 0.0, 0)

    print(f"\nSmolLM2-135M-Instruct, first {args.prompts} MT-bench first turns and HumanEval prompts (held out),"
          f" {args.max_new_tokens} new tokens, batch 1, torch threads {torch.get_num_threads()}\n")
    for ds, ps in data.items():
        for temp in args.temperatures:
            wall = {m: 0.0 for m in methods}
            metrics = {m: [] for m in methods}
            outputs = {m: [] for m in methods}
            for i, p in enumerate(ps):
                for m in methods:
                    t0 = time.perf_counter()
                    res = once(m, [p], args.max_new_tokens, temp, 1000 * i)
                    wall[m] += time.perf_counter() - t0
                    metrics[m] += [r.metrics for r in res.requests]
                    outputs[m] += [r.tokens for r in res.requests]
            ar_rate = sum(len(t) for t in outputs["autoregressive"]) / wall["autoregressive"]
            print(f"**{ds}, temperature {temp:g}**\n")
            print("| method | mean accepted len | acceptance per position | tok/s | speedup vs AR |"
                  + (" identical to AR |" if temp == 0 else ""))
            print("|---|---:|---|---:|---:|" + ("---:|" if temp == 0 else ""))
            for m in methods:
                s = summarize(metrics[m])
                rate = sum(len(t) for t in outputs[m]) / wall[m]
                acc = " ".join(f"{a:.2f}" for a in s["acceptance_at"]) or "-"
                same = sum(a == b for a, b in zip(outputs[m], outputs["autoregressive"]))
                print(f"| {m} | {s['mean_accepted_length']:.2f} | {acc} | {rate:.1f} | {rate / ar_rate:.2f}x |"
                      + (f" {same}/{len(ps)} |" if temp == 0 else ""))
            print(flush=True)

    if not args.batches:
        return
    pool = prompts(target, "mtbench", max(args.batches))
    print(f"**Batch sizes, MT-bench, greedy, {args.batch_new_tokens} new tokens: tokens/s**\n")
    sweep = ["autoregressive", "dspark γ=4", "dspark γ=4 +sched", "dspark γ=8 +sched"]
    print("| batch | " + " | ".join(sweep) + " | sched γ=4 vs AR | sched γ=8 vs AR |")
    print("|---:|" + "---:|" * (len(sweep) + 2))
    for B in args.batches:
        rate = {}
        for m in sweep:
            t0 = time.perf_counter()
            res = once(m, pool[:B], args.batch_new_tokens, 0.0, 0)
            rate[m] = res.metrics.new_tokens / (time.perf_counter() - t0)
        ar = rate["autoregressive"]
        print(f"| {B} | " + " | ".join(f"{rate[m]:.1f}" for m in sweep)
              + f" | {rate['dspark γ=4 +sched'] / ar:.2f}x | {rate['dspark γ=8 +sched'] / ar:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

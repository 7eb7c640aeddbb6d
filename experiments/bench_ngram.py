"""Prompt-lookup speculative decoding vs autoregressive decoding, specdec vs transformers.

On SmolLM2-135M-Instruct (the offline alias ``smollm2-135m``) and the copy-heavy prompts of
``prompts_copy.py``, in one process, greedy, batch size 1 (one prompt at a time), it times:

  (a) ``specdec AR``      specdec's own loop with no drafter (``specdec.generate(..., drafter=None)``)
  (b) ``specdec ngram``   specdec's ``ngram`` drafter, ``k`` tokens per step
  (c) ``HF greedy``       ``model.generate(do_sample=False)``
  (d) ``HF prompt lookup`` ``model.generate(do_sample=False, prompt_lookup_num_tokens=k)``

Every method gets one warm-up run first; then the prompts are run in turn, all four methods per
prompt (interleaved, so slow drift of the machine hits every method alike). Wall time is measured
around each call with ``time.perf_counter``. All use the chat template and the same EOS ids (those
of the target's generation config).

It prints a markdown table: new tokens, seconds, tokens/s, speedup over the matching
autoregressive baseline and over HF greedy, specdec's mean accepted length (bonus token
included), and how many prompts produced exactly HF greedy's tokens; then specdec's time split
(loop overhead = ``RunMetrics.other_s / wall_s``), and, for any output that differs from HF
greedy, the first differing position with the target's top-2 logits there (a tiny gap means a
numerical near-tie, not a bug).

Run from the repository root::

    .venv/bin/python experiments/bench_ngram.py [--k 8] [--max-new-tokens 128] [--prompts N] [--dtype float32]

``--threads`` (default 1) sets torch's intra-op threads: on a small shared CPU, two OpenMP threads
competing with any other busy process slow decoding about 3x and make the numbers noise, while
one thread decodes this 135M model about as fast as two on an idle machine.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

import specdec
from specdec.api import GenerationResult
from specdec.sampling import SamplingParams
from specdec.target import Target

from prompts_copy import PROMPTS

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class MethodStats:
    name: str
    baseline: str  # the autoregressive method it is compared with
    tokens: list[list[int]] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    results: list[GenerationResult] = field(default_factory=list)  # specdec methods only

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / sum(self.wall_s)

    def mean_accepted_length(self) -> float | None:
        if not self.results:
            return None
        reqs = [r.metrics for res in self.results for r in res.run.requests]
        steps, accepted = sum(m.steps for m in reqs), sum(m.accepted for m in reqs)
        return (steps + accepted) / steps if steps else 1.0


def chat_ids(target: Target, prompt: str) -> torch.Tensor:
    """[1, T] prompt ids from the chat template (transformers 5 returns a BatchEncoding here)."""
    enc = target.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt")
    ids = enc["input_ids"] if isinstance(enc, Mapping) else enc
    return ids.to(target.device)


def make_methods(target: Target, k: int, max_new: int, eos: list[int], max_ngram: int = 3
                 ) -> dict[str, tuple[str, Callable[[str, int], tuple[list[int], GenerationResult | None]]]]:
    """name -> (baseline name, fn(prompt, max_new_tokens) -> (new tokens, specdec result or None))."""
    model, pad = target.model, target.model.generation_config.pad_token_id
    ngram = specdec.make_drafter("ngram", target, max_ngram=max_ngram)

    def spec(drafter):
        def fn(prompt: str, n: int) -> tuple[list[int], GenerationResult | None]:
            res = specdec.generate(target, prompt, drafter=drafter, k=k, sampling=GREEDY, max_new_tokens=n,
                                   chat=True, eos_token_ids=set(eos))
            return res.tokens[0], res
        return fn

    def hf(**extra):
        @torch.inference_mode()
        def fn(prompt: str, n: int) -> tuple[list[int], GenerationResult | None]:
            ids = chat_ids(target, prompt)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 eos_token_id=eos, pad_token_id=pad, **extra)
            return out[0, ids.shape[1]:].tolist(), None
        return fn

    return {
        "specdec AR": ("specdec AR", spec(None)),
        f"specdec ngram (k={k})": ("specdec AR", spec(ngram)),
        "HF greedy": ("HF greedy", hf()),
        f"HF prompt lookup (k={k})": ("HF greedy", hf(prompt_lookup_num_tokens=k)),
    }


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def top2_at(target: Target, prompt: str, prefix: list[int]) -> tuple[list[int], list[float]]:
    """The target's top-2 next tokens and logits after prompt + prefix (one plain HF forward)."""
    ids = torch.cat([chat_ids(target, prompt), torch.tensor([prefix], dtype=torch.long, device=target.device)], 1)
    top = target.model(ids).logits[0, -1].float().topk(2)
    return top.indices.tolist(), top.values.tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=8, help="draft tokens per step (both n-gram methods)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=None, help="use only the first N prompts")
    ap.add_argument("--max-ngram", type=int, default=3, help="longest suffix the ngram drafter matches")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads; 1 keeps timings stable when other jobs share the CPU")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target = specdec.load_target("smollm2-135m", dtype=getattr(torch, args.dtype))
    eos_cfg = target.model.generation_config.eos_token_id
    eos = list(eos_cfg) if isinstance(eos_cfg, (list, tuple)) else [eos_cfg]
    prompts = PROMPTS[: args.prompts]
    for p in prompts:  # specdec's chat encoding must be the very prompt HF gets
        assert specdec.api._encode(target, p, chat=True) == chat_ids(target, p)[0].tolist()
    methods = make_methods(target, args.k, args.max_new_tokens, eos, args.max_ngram)
    stats = {name: MethodStats(name, base) for name, (base, _) in methods.items()}

    for _, fn in methods.values():  # warm-up
        fn(prompts[0], min(16, args.max_new_tokens))
    for p in tqdm(prompts, desc="prompts"):
        for name, (_, fn) in methods.items():
            t0 = time.perf_counter()
            toks, res = fn(p, args.max_new_tokens)
            stats[name].wall_s.append(time.perf_counter() - t0)
            stats[name].tokens.append(toks)
            if res is not None:
                stats[name].results.append(res)

    ref = stats["HF greedy"]
    print(f"\nSmolLM2-135M-Instruct, {args.dtype}, device {target.device}, torch threads {torch.get_num_threads()},"
          f" {len(prompts)} prompts, max_new_tokens {args.max_new_tokens}, k {args.k}, greedy, batch 1\n")
    print("| method | new tokens | wall s | tok/s | speedup vs own AR | speedup vs HF greedy"
          " | mean accepted len | identical to HF greedy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for s in stats.values():
        mal = s.mean_accepted_length()
        same = sum(a == b for a, b in zip(s.tokens, ref.tokens))
        print(f"| {s.name} | {s.new_tokens} | {sum(s.wall_s):.2f} | {s.tokens_per_s:.1f}"
              f" | {s.tokens_per_s / stats[s.baseline].tokens_per_s:.2f}x | {s.tokens_per_s / ref.tokens_per_s:.2f}x"
              f" | {'-' if mal is None else f'{mal:.2f}'} | {same}/{len(prompts)} |")

    print("\nspecdec time split (share of RunMetrics.wall_s, summed over prompts):\n")
    print("| method | run wall s | prefill | draft | target | verify | other (loop overhead) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for s in stats.values():
        if not s.results:
            continue
        ms = [r.run.metrics for r in s.results]
        wall = sum(m.wall_s for m in ms)
        parts = [sum(getattr(m, f) for m in ms) / wall for f in ("prefill_s", "draft_s", "target_s", "verify_s",
                                                                  "other_s")]
        print(f"| {s.name} | {wall:.2f} | " + " | ".join(f"{x:.1%}" for x in parts) + " |")

    print("\nper prompt (tok/s; specdec ngram mean accepted length):\n")
    print("| prompt | prompt tokens | HF greedy new tokens | " + " | ".join(stats) + " | ngram MAL |")
    print("|---:|---:|---:|" + "---:|" * (len(stats) + 1))
    ngram = next(s for s in stats.values() if s.name.startswith("specdec ngram"))
    for i, p in enumerate(prompts):
        mal = ngram.results[i].summary["mean_accepted_length"]
        rates = " | ".join(f"{len(s.tokens[i]) / s.wall_s[i]:.1f}" for s in stats.values())
        print(f"| {i} | {chat_ids(target, p).shape[1]} | {len(ref.tokens[i])} | {rates} | {mal:.2f} |")

    diffs = [(s.name, i, j) for s in stats.values() if s is not ref
             for i in range(len(prompts)) if (j := first_diff(s.tokens[i], ref.tokens[i])) is not None]
    if diffs:
        print("\noutputs differing from HF greedy (first differing position; target top-2 logits there):\n")
        for name, i, j in diffs:
            got, want = stats[name].tokens[i], ref.tokens[i]
            if j >= min(len(got), len(want)):
                print(f"- {name}, prompt {i}: lengths {len(got)} vs {len(want)}, one is a prefix of the other")
                continue
            ids, vals = top2_at(target, prompts[i], want[:j])
            print(f"- {name}, prompt {i}, position {j}: got {got[j]}, HF greedy {want[j]};"
                  f" top-2 {ids} logits {vals[0]:.5f} / {vals[1]:.5f} (gap {vals[0] - vals[1]:.2e})")


if __name__ == "__main__":
    main()

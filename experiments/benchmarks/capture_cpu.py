"""Which capture mode is fastest on this CPU (what ``capture="auto"`` picks there): the library's
autoregressive tokens/s in each mode, as a ratio to transformers' ``generate`` timed in the same
run, and one verify block's forward time; compile time reported apart from the timed runs.

    OMP_NUM_THREADS=2 .venv/bin/python experiments/run.py --config-name lab/capture_cpu model=smollm2-135m new=64 reps=3

Modes are interleaved within each repetition, so a change of the machine's load hits them alike;
medians are reported. Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics

import torch

import specdec
from benchmarks.ar_ratio import fixed_prompt, generate_tokens_per_s, library_tokens_per_s
from specdec.target import Target
from specdec.timing import now

MODES = ("eager", "graphs", "compile")


def compare_modes(model: str = "smollm2-135m", prompt_tokens: int = 64, new: int = 64, reps: int = 3,
                  block: int = 5, modes: list[str] | None = None) -> dict:
    """Each capture mode of ``modes`` (all by default) against ``generate()``; ``block``: the verify
    block length timed as one forward."""
    if unknown := sorted(set(modes or MODES) - set(MODES)):
        raise SystemExit(f"unknown capture modes {unknown}: {list(MODES)}")
    base = specdec.load_target(model, capture="eager")
    modes = list(modes or MODES)
    targets = {m: base if m == "eager" else Target(base.model, base.tokenizer, capture=m) for m in modes}
    prompt = fixed_prompt(prompt_tokens)

    def library(t: Target) -> float:
        return library_tokens_per_s(t, prompt, new)

    def hf() -> float:
        return generate_tokens_per_s(base.model, prompt, new)

    def block_ms(t: Target, reps: int = 10) -> float:
        s = t.new_session(1, reserve=len(prompt) + block * (reps + 2))
        t.prefill(s, [prompt])
        ids = torch.tensor([prompt[: block]])
        times = []
        for _ in range(reps + 1):
            start = now()
            t.forward(s, ids)
            times.append(now() - start)
            t.commit(s, None)
        return 1e3 * statistics.median(times[1:])

    warm = {}
    for m, t in targets.items():  # first use records (graphs) or compiles (compile): timed apart
        start = now()
        library(t)
        block_ms(t, reps=1)
        warm[m] = now() - start
    hf()
    tps: dict[str, list[float]] = {m: [] for m in [*modes, "hf_generate"]}
    blocks: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(reps):
        tps["hf_generate"].append(hf())
        for m, t in targets.items():
            tps[m].append(library(t))
            blocks[m].append(block_ms(t))
    med = {m: statistics.median(v) for m, v in tps.items()}
    result = {
        "model": model, "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
        "prompt_tokens": prompt_tokens, "new_tokens": new, "reps": reps,
        "tokens_per_s": {m: round(v, 2) for m, v in med.items()},
        "ratio_to_hf_generate": {m: round(med[m] / med["hf_generate"], 3) for m in modes},
        f"block{block}_forward_ms": {m: round(statistics.median(v), 2) for m, v in blocks.items()},
        "first_use_s": {m: round(v, 1) for m, v in warm.items()},
        "loadavg": open("/proc/loadavg").read().split()[:3],
    }
    print(json.dumps(result, indent=1))
    return result


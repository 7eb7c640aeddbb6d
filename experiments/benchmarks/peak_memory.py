"""Peak memory of one generation at a long context, each method in a process of its own (a
process's peak resident set never goes down, so methods cannot share one): transformers'
``generate()``, the library's autoregressive decoding, and speculative methods, on one held-out
standard-library prompt of ``context`` tokens, greedy, ``new`` new tokens. Each line of the
output (JSON) gives the peak RSS, the RSS after the model loaded and tuned, the bytes the packed
weights and the KV store hold, the packing budget, and for the library's loop its time split and
acceptance per position.

    .venv/bin/python experiments/run.py --config-name lab/peak_memory context=7500 new=8 threads=1 \\
        'methods=[hf, ar, "eagle3 k=2 checkpoint=smollm2-135m-eagle3"]'
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path


def _mib_peak() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def one(method: str, context: int, new: int, threads: int, options: dict[str, str]) -> dict:
    """One method in this process: ``hf`` (transformers' generate), ``ar`` or a drafter's name."""
    import torch

    import specdec
    from specdec.data.config import DatasetConfig
    from specdec.data.datasets import load_dataset
    from specdec.few_rows import linear_bytes, packed_bytes, pack_budget, set_pack_budget
    from specdec.loop import Request, run
    from specdec.timing import Stopwatch

    options = dict(options)
    pack = options.pop("pack", "false" if method == "hf" else "true") == "true"  # generate() never reads packed copies
    target = specdec.load_target("smollm2-135m", threads=threads, pack=pack)
    if "pack_budget" in options:
        set_pack_budget(target.model, float(options.pop("pack_budget")))
        target.tune()
    ids = load_dataset(DatasetConfig(name="stdlib", num_prompts=1, input_len=context, output_len=new),
                       target.tokenizer)[0].prompt_ids
    loaded = _mib_peak()
    out: dict = {"method": method, "options": options, "context": len(ids), "new": new, "threads": threads}
    with Stopwatch() as sw:
        if method == "hf":
            with torch.inference_mode():
                gen = target.model.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
            tokens = gen[0, len(ids):].tolist()
        else:
            k = int(options.pop("k", 2))
            policy = options.pop("policy", None)
            drafter = None if method == "ar" else specdec.make_drafter(method, target, **_typed(options))
            res = run(target, drafter, specdec.make_verifier("greedy"), [Request(ids, new)], k=k,
                      eos_token_ids=set(), policy=policy)
            tokens, rm, m = res.requests[0].tokens, res.metrics, res.requests[0].metrics
            out.update(k=k if drafter else 0, policy=policy, acceptance_at=[round(a, 3) for a in m.acceptance_at],
                       mean_accepted_length=round(m.mean_accepted_length, 3), steps=m.steps,
                       prefill_s=rm.prefill_s, draft_s=rm.draft_s, target_s=rm.target_s, verify_s=rm.verify_s)
    slots = len(ids) + new + (out.get("k") or 0) + 1
    layers = target.num_layers
    kv = slots * layers * 2 * target.layer_specs()[0].num_kv_heads * (target.layer_specs()[0].head_dim or 0) * 4
    out.update(wall_s=sw.seconds, peak_mib=round(_mib_peak(), 1), after_load_mib=round(loaded, 1),
               packed_mib=round(packed_bytes(target.model) / 2**20, 1), pack_budget=pack_budget(target.model) if pack else 0.0,
               linear_mib=round(linear_bytes(target.model) / 2**20, 1), kv_store_mib=round(kv / 2**20, 1),
               first_tokens=tokens[:8])
    return out


def _typed(options: dict[str, str]) -> dict:
    """``key=value`` options as the drafter's config takes them (ints where they parse)."""
    return {k: int(v) if v.lstrip("-").isdigit() else v for k, v in options.items()}


def measure(context: int = 7500, new: int = 8, threads: int = 1, methods: list[str] = ("hf", "ar"),
            child: bool = False) -> None:
    """Mode ``peak_memory``: each of ``methods`` (``hf``, ``ar`` or ``<drafter> key=value ...``) in a
    process of its own, one JSON line each; ``child``: run the first method here (the processes' job)."""
    if child:
        name, *rest = methods[0].split()
        print(json.dumps(one(name, context, new, threads, dict(r.split("=", 1) for r in rest))))
        return
    from hydra.core.hydra_config import HydraConfig

    runner = Path(__file__).resolve().parents[1] / "run.py"
    out = Path(HydraConfig.get().runtime.output_dir)
    for i, m in enumerate(methods):
        cmd = [sys.executable, str(runner), "--config-name", "lab/peak_memory", f"context={context}", f"new={new}",
               f"threads={threads}", f"methods=[{json.dumps(m)}]", "child=true", f"hydra.run.dir={out / f'method-{i}'}"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        line = res.stdout.strip().splitlines()[-1] if res.returncode == 0 and res.stdout.strip() else None
        print(line or json.dumps({"method": m, "error": res.stderr.strip().splitlines()[-1:]}), flush=True)

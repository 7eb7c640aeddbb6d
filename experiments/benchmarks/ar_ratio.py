"""The library's autoregressive tokens/s over transformers' ``generate()``, timed in one process:
interleaved repetitions, the best of each (the shortest time is the least disturbed by other load
on a shared machine). Runs on any specdec version (put its source first on ``PYTHONPATH`` to time
another checkout) and prints one JSON object.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench.py ar_ratio --reps 9
    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench.py ar_ratio --reps 9 --capture graphs
"""

from __future__ import annotations

import argparse
import json

import torch

import specdec
from specdec.loop import Request, run
from specdec.timing import now
from specdec.verifiers import GreedyVerifier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--capture", default=None, help="load_target's capture= (default: the library's own default)")
    args = ap.parse_args()
    t = specdec.load_target(args.model, **({} if args.capture is None else {"capture": args.capture}))
    prompt = [(7 * i + 11) % 5000 + 100 for i in range(args.prompt_tokens)]
    n = args.new

    def library() -> float:
        start = now()
        res = run(t, None, GreedyVerifier(), [Request(list(prompt), n)], eos_token_ids=set())
        assert len(res.requests[0].tokens) == n
        return n / (now() - start)

    def hf() -> float:
        ids = torch.tensor([prompt])
        start = now()
        with torch.inference_mode():
            t.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return n / (now() - start)

    library(), hf()  # warm-up
    lib, ref = [], []
    for _ in range(args.reps):
        ref.append(hf())
        lib.append(library())
    print(json.dumps({"specdec": specdec.__file__, "capture": getattr(t, "capture_mode", "n/a (no switch)"),
                      "threads": torch.get_num_threads(), "lib_best": round(max(lib), 2), "hf_best": round(max(ref), 2),
                      "ratio_best": round(max(lib) / max(ref), 4), "lib": [round(x, 1) for x in lib],
                      "hf": [round(x, 1) for x in ref], "loadavg": open("/proc/loadavg").read().split()[:3]}))


if __name__ == "__main__":
    main()

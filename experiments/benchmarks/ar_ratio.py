"""The library's autoregressive tokens/s over transformers' ``generate()``, timed in one process:
interleaved repetitions, the best of each (the shortest time is the least disturbed by other load
on a shared machine). Runs on any specdec version (put its source first on ``PYTHONPATH`` to time
another checkout) and prints one JSON object.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/run.py --config-name lab/ar_ratio reps=9
    OMP_NUM_THREADS=1 .venv/bin/python experiments/run.py --config-name lab/ar_ratio reps=9 capture=graphs
"""

from __future__ import annotations

import json

import torch

import specdec
from specdec.loop import Request, run
from specdec.timing import now
from specdec.verifiers import GreedyVerifier


def ratio(model: str = "smollm2-135m", prompt_tokens: int = 64, new: int = 24, reps: int = 9,
          capture: str | None = None) -> dict:
    """Best-of-``reps`` tokens/s of the library's autoregressive decoding and of ``generate()``;
    ``capture``: load_target's switch (None: the library's own default)."""
    t = specdec.load_target(model, **({} if capture is None else {"capture": capture}))
    prompt = [(7 * i + 11) % 5000 + 100 for i in range(prompt_tokens)]
    n = new

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
    for _ in range(reps):
        ref.append(hf())
        lib.append(library())
    result = {"specdec": specdec.__file__, "capture": getattr(t, "capture_mode", "n/a (no switch)"),
                      "threads": torch.get_num_threads(), "lib_best": round(max(lib), 2), "hf_best": round(max(ref), 2),
                      "ratio_best": round(max(lib) / max(ref), 4), "lib": [round(x, 1) for x in lib],
                      "hf": [round(x, 1) for x in ref], "loadavg": open("/proc/loadavg").read().split()[:3]}
    print(json.dumps(result))
    return result

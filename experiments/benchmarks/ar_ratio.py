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


def fixed_prompt(tokens: int) -> list[int]:
    """The same ``tokens``-token prompt for every run and checkout (no tokenizer involved)."""
    return [(7 * i + 11) % 5000 + 100 for i in range(tokens)]


def library_tokens_per_s(target, prompt: list[int], new: int) -> float:
    """Tokens/s of one autoregressive run of ``new`` tokens through the library's loop."""
    start = now()
    res = run(target, None, GreedyVerifier(), [Request(list(prompt), new)], eos_token_ids=set())
    assert len(res.requests[0].tokens) == new
    return new / (now() - start)


def generate_tokens_per_s(model, prompt: list[int], new: int) -> float:
    """Tokens/s of one greedy ``generate()`` of exactly ``new`` tokens."""
    ids = torch.tensor([prompt])
    start = now()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False)
    assert out.shape[1] == len(prompt) + new
    return new / (now() - start)


def ratio(model: str = "smollm2-135m", prompt_tokens: int = 64, new: int = 24, reps: int = 9,
          capture: str | None = None) -> dict:
    """Best-of-``reps`` tokens/s of the library's autoregressive decoding and of ``generate()``;
    ``capture``: load_target's switch (None: the library's own default)."""
    t = specdec.load_target(model, **({} if capture is None else {"capture": capture}))
    prompt = fixed_prompt(prompt_tokens)
    library_tokens_per_s(t, prompt, new), generate_tokens_per_s(t.model, prompt, new)  # warm-up
    lib, ref = [], []
    for _ in range(reps):
        ref.append(generate_tokens_per_s(t.model, prompt, new))
        lib.append(library_tokens_per_s(t, prompt, new))
    result = {"specdec": specdec.__file__, "capture": getattr(t, "capture_mode", "n/a (no switch)"),
              "threads": torch.get_num_threads(), "lib_best": round(max(lib), 2), "hf_best": round(max(ref), 2),
              "ratio_best": round(max(lib) / max(ref), 4), "lib": [round(x, 1) for x in lib],
              "hf": [round(x, 1) for x in ref], "loadavg": open("/proc/loadavg").read().split()[:3]}
    print(json.dumps(result))
    return result

"""Grow the training corpus: the target's own greedy and sampled answers (specdec.data.corpus).

    .venv/bin/python experiments/run.py --config-name lab/corpus num_prompts=8192 threads=1
    # on-policy greedy answers at scale (docs/training.md), resumable:
    .venv/bin/python experiments/run.py --config-name lab/corpus out=outputs/corpus/smollm2-135m-greedy \
        greedy=true dtype=bfloat16 batch=64 shard_size=256 num_prompts=60000
    # what a corpus folder holds, and how much of its answers repeat themselves, by answer position:
    .venv/bin/python experiments/run.py --config-name lab/corpus out=outputs/corpus/smollm2-135m-greedy report=true
    # tokens/s of these settings against the committed corpus's (fp32, batch 32, mixed temperatures):
    .venv/bin/python experiments/run.py --config-name lab/corpus compare=128 greedy=true dtype=bfloat16 batch=64 \
        shard_size=256 threads=2

Resumes at the first missing shard, so it can run in several parts; each shard is written whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import specdec
from specdec.data.config import data_device
from specdec.data.corpus import corpus_repetition, corpus_stats, generate_corpus
from specdec.host_memory import minor_faults, retain_freed_memory
from specdec.timing import now

ROOT = Path(__file__).resolve().parent


def grow(model: str = "smollm2-135m", out: str = "experiments/data/smollm2-135m", num_prompts: int = 8192,
         shard_size: int = 64, batch: int = 32, max_new_tokens: int = 256, drafter: str | None = None, k: int = 4,
         threads: int = 1, seed: int = 0, greedy: bool = False, dtype: str = "float32", compare: int = 0,
         retain_memory: bool = True, report: bool = False, stop_repeat: int = 0, continuous: bool = False,
         device: str | None = None) -> dict:
    """Mode ``corpus``: answer ``num_prompts`` prompts in total with ``model`` (an alias or folder,
    computed in ``dtype``: bf16 is ~3x faster on CPUs with AMX or AVX512-BF16) into ``out``,
    ``shard_size`` prompts a file, ``batch`` requests decoded together (with ``drafter``, a lossless
    drafter at ``k``, e.g. ngram on a GPU); ``greedy``: every answer greedy (else mixed temperatures);
    ``seed``: prompt order and sampling seeds; ``stop_repeat`` = N > 0: an answer ends at the token
    that completes an N-gram it already wrote (a loop; :func:`generate_corpus`); ``continuous``: continuous
    batching (a finished answer's row takes the next prompt; without a drafter). ``compare`` = N > 0
    writes nothing: it measures new answer tokens/s of the committed corpus's settings and of these
    on the first N prompts.
    ``retain_memory``: keep freed activations mapped (:mod:`specdec.host_memory`; in ``compare``,
    from the second run on, so the first is the generator as it ran before). ``report``: generate
    nothing; print what ``out`` holds (:func:`corpus_stats`) and the share of its answer tokens, by
    answer position, that repeat an 8-gram of the same answer (:func:`corpus_repetition`).
    ``device``: where the target decodes (:func:`~specdec.data.config.data_device`: None = the CPU,
    ``"cuda"``, ``"auto"``), checked before the target loads."""
    if report:
        if not sorted(Path(out).glob("shard-*.safetensors")):
            raise SystemExit(f"{out}: no corpus shards to report on")
        stats = {**corpus_stats(Path(out)), "repetition_8gram": corpus_repetition(Path(out))}
        print(json.dumps(stats))
        return stats
    if dtype not in ("float32", "bfloat16"):
        raise SystemExit(f"dtype {dtype!r}: float32 or bfloat16")
    where = data_device(device)
    torch.set_num_threads(threads)
    target = specdec.load_target(model, dtype=getattr(torch, dtype), threads=threads, device_map=where)
    if compare:
        return _compare(model, target, compare, batch, shard_size, greedy, dtype, max_new_tokens, seed, threads,
                        retain_memory, stop_repeat, continuous)
    if retain_memory:
        retain_freed_memory()
    start = now()
    generate_corpus(target, Path(out), num_prompts, shard_size=shard_size, batch=batch,
                    max_new_tokens=max_new_tokens, drafter=drafter, k=k, seed=seed, greedy=greedy,
                    stop_repeat=stop_repeat, continuous=continuous)
    stats = {**corpus_stats(Path(out)), "seconds_this_run": round(now() - start, 1)}
    print(json.dumps(stats))
    return stats


def _compare(model: str, target, n: int, batch: int, shard_size: int, greedy: bool, dtype: str, max_new_tokens: int,
             seed: int, threads: int, retain_memory: bool, stop_repeat: int = 0, continuous: bool = False) -> dict:
    """The committed corpus's settings (fp32, batch 32, shards of 64, mixed temperatures, malloc as it
    comes, batches decoded to their longest answer) then these (shards of ``shard_size`` at most ``n``), on the
    same first ``n`` prompts, into
    temporary folders: new answer tokens per second of each, the same for the answer tokens that
    repeat no earlier 8-gram of their answer (a loop's tokens teach little), and the page faults
    each took."""
    import tempfile

    old = specdec.load_target(model, dtype=torch.float32, threads=threads)
    after = (f"after ({dtype}, batch {batch}, shards of {min(shard_size, n)}, "
             f"{'greedy' if greedy else 'mixed temperatures'}{', freed memory kept' if retain_memory else ''}"
             f"{f', stop at a repeated {stop_repeat}-gram' if stop_repeat else ''}"
             f"{', continuous batching' if continuous else ''})")
    runs = {"before (fp32, batch 32, shards of 64, mixed temperatures)":
                (old, dict(batch=32, shard_size=64, greedy=False, continuous=False)),
            after: (target, dict(batch=batch, shard_size=min(shard_size, n), greedy=greedy, stop_repeat=stop_repeat,
                                 continuous=continuous))}
    out = {}
    for name, (t, settings) in runs.items():
        if t is target and retain_memory:
            retain_freed_memory()
        with tempfile.TemporaryDirectory() as d:
            faults, start = minor_faults(), now()
            generate_corpus(t, d, n, max_new_tokens=max_new_tokens, seed=seed, progress=False, **settings)
            seconds, faults = now() - start, minor_faults() - faults
            stats = corpus_stats(d)
            whole = corpus_repetition(d, edges=(0, max_new_tokens))[0]
        fresh = round(whole["tokens"] * (1 - whole["repeated"]))
        out[name] = {"response_tokens": stats["response_tokens"], "seconds": round(seconds, 1),
                     "tokens_per_s": round(stats["response_tokens"] / seconds, 1),
                     "unrepeated_tokens": fresh, "unrepeated_tokens_per_s": round(fresh / seconds, 1),
                     "minor_page_faults": faults}
    print(json.dumps(out, indent=1))
    return out

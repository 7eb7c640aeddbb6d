"""Fill (or resume) a target feature store (:mod:`specdec.data.store`) from the recorded sources.

    python experiments/run.py --config-name lab/store out=outputs/store/smollm2-135m \
        sources=[corpus,sharegpt,stdlib] tokens=1100000 compute_dtype=bfloat16
    ACCELERATE_USE_CPU=1 .venv/bin/torchrun --nproc_per_node 2 experiments/run.py --config-name lab/store ...

Several processes (``accelerate``/``torchrun``) share the shards of one store. ``throughput=N``
measures instead: a shard of the stream's first N tokens filled in fp32 and in bf16, interleaved.
"""

from __future__ import annotations

import json

import torch

from specdec.data.config import TargetConfig, build_target, data_device
from specdec.data.sources import SOURCE_NAMES, store_items
from specdec.data.store import (DEFAULT_RECIPES, StoreNeeds, recipe_needs, store_bytes_per_token, throughput as measure,
                                weights_hash, write_store)
from specdec.provenance import command_line, machine


def fill(out: str, target: str = "smollm2-135m", sources: list[str] = ("corpus",),
         corpus: str = "experiments/data/smollm2-135m", max_prompt: int = 64, max_len: int = 512,
         tokens: int | None = None, held_out_every: int = 20, recipes: list[str] = DEFAULT_RECIPES,
         layers: list[int] | None = None, kv_layers: list[int] | None = None, compute_dtype: str = "float32",
         shard_sequences: int = 64, batch_tokens: int = 2048, threads: int | None = None,
         throughput: int = 0, device: str | None = None) -> None:
    """Mode ``store``: the store ``out`` for ``target`` (an alias or a folder) from ``sources``
    interleaved by tokens (``corpus``: the corpus folder, its prompts cut to the last ``max_prompt``
    tokens), every sequence cut into windows of ``max_len``, until about ``tokens``; the hidden states
    and K/V layers ``recipes`` read (or ``layers`` / ``kv_layers``), computed in ``compute_dtype``
    (stored in bf16 either way), on ``device`` (:func:`~specdec.data.config.data_device`: None = the
    CPU; ``"auto"`` under ``accelerate launch`` or ``torchrun``: each process its own GPU and shards)."""
    unknown = sorted(set(sources) - set(SOURCE_NAMES))
    if unknown:
        raise SystemExit(f"unknown sources {unknown}: {list(SOURCE_NAMES)}")
    if compute_dtype not in ("float32", "bfloat16"):
        raise SystemExit(f"compute_dtype must be float32 or bfloat16, got {compute_dtype!r}")
    where = data_device(device)
    if threads:
        torch.set_num_threads(threads)
    model = build_target(TargetConfig(model=target, dtype="float32", device_map=where, pack=False))
    checkpoint_hash = weights_hash(model)  # the weights as loaded, whatever dtype computes the rows
    needs = recipe_needs(model, list(recipes))
    needs = StoreNeeds(tuple(layers) if layers is not None else needs.layers,
                       tuple(kv_layers) if kv_layers is not None else needs.kv)
    model.model.to(getattr(torch, compute_dtype))
    items, found = store_items(model, list(sources), corpus=corpus, max_prompt=max_prompt, max_len=max_len,
                               held_out_every=held_out_every)
    command = command_line()
    if throughput:
        first, n = [], 0
        for it in items:
            first.append(it)
            n += int(it.seq.tokens.numel())
            if n >= throughput:
                break
        rows = measure(model, first, needs, batch_tokens=batch_tokens)
        info = {"command": command, "machine": machine(), "layers": list(needs.layers),
                "kv_layers": list(needs.kv), "bytes_per_token": store_bytes_per_token(model, needs), "rows": rows}
        print(json.dumps(info, indent=1))
        return
    store = write_store(model, target, items, out, needs, found, held_out_every, shard_sequences, batch_tokens,
                        command=command, max_tokens=tokens, progress=True, target_hash=checkpoint_hash)
    print(f"{store.path}: {store.num_tokens:,} tokens, {len(store.sequences):,} sequences, hidden states "
          f"{list(store.layers)}, K/V layers {list(store.kv_layers)}")

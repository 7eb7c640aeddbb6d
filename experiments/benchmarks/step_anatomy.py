"""Where one target forward over m new tokens spends its time, and what each fp32 product costs per row count.

    .venv/bin/python experiments/run.py --config-name lab/step_anatomy     # SmolLM2-135M, one thread
    .venv/bin/python experiments/run.py --config-name lab/step_anatomy context=4096 new_tokens=[1,5,9]

Two tables (markdown, on stdout; ``out`` also writes them with the raw numbers as JSON):

1. **Products**: one pass over every ``nn.Linear`` of the model (the LM head included) with each
   product a float32 linear layer can take here, at each row count: ``F.linear``, ``(W @ xᵀ)ᵀ``,
   oneDNN's inner product on weights packed for several batch-size hints, and ``F.linear`` on bf16
   copies for contrast. Best of ``reps`` passes; the bytes of the weights set the floor.
2. **Anatomy**: ``Target.forward`` over m new tokens after ``context`` committed ones, as the
   loop verifies a chain (the block dropped after each timing), wall time per forward and a
   ``torch.profiler`` split of the same forwards into the linear products, attention and every
   other op; what the profiler does not see is Python between the ops. Last, the wall time of
   the same forward over a context with holes (a rejected block's slots), which attention masks.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import profile

import specdec
from specdec.timing import measure

LINEAR_OPS = ("aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise")


def products(weights: list[torch.Tensor], row_counts: list[int], reps: int) -> dict[str, list[float]]:
    """ms of one pass over ``weights`` per row count, for each product."""
    def timed(fn: Callable[[int, torch.Tensor], torch.Tensor], rows: int) -> float:
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

        def one_pass() -> None:
            for i, w in enumerate(weights):
                fn(i, xs[w.shape[1]])

        return measure(one_pass, reps, warmup=0).min * 1e3  # best of reps

    out = {"F.linear": [timed(lambda i, x: F.linear(x, weights[i]), m) for m in row_counts],
           "(W @ xT)T": [timed(lambda i, x: (weights[i] @ x.T).T, m) for m in row_counts]}
    if torch.backends.mkldnn.is_available():
        for hint in (1, 4, 8, 16):
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, hint) for w in weights]
            out[f"oneDNN packed (hint {hint})"] = [
                timed(lambda i, x: torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], ""), m)
                for m in row_counts]
            del packed
    bf16 = [w.bfloat16() for w in weights]
    out["F.linear, bf16 copies"] = [timed(lambda i, x: F.linear(x.bfloat16(), bf16[i]), m) for m in row_counts]
    return out


def anatomy(target, context: int, m: int, reps: int, masked: bool = False) -> dict[str, float]:
    """ms per forward of m chain tokens after ``context`` committed ones: wall, and a profile's split.
    ``masked``: the context holds a rejected block's holes (rows that accepted differently, or a
    tree), so attention reads a mask; otherwise the store is dense, as at batch 1 with chains."""
    session = target.new_session(1, reserve=context + 2 * m)
    target.prefill(session, [list(range(100, 100 + context))])
    block = torch.arange(5, 5 + m).unsqueeze(0)
    if masked:
        target.forward(session, block)
        target.commit(session, torch.zeros(1, m, dtype=torch.bool))  # m holes: the store is no longer dense

    def step() -> None:
        target.forward(session, block)
        target.commit(session, 0)  # the block dropped outright: the same context every time

    walls = measure(step, reps, warmup=3).samples
    with profile() as prof:
        for _ in range(reps):
            step()
    ops = {e.key: e.self_cpu_time_total / reps / 1e3 for e in prof.key_averages()}
    linear = sum(v for k, v in ops.items() if k in LINEAR_OPS)
    attention = sum(v for k, v in ops.items() if "scaled_dot_product" in k)
    return {"wall_ms": statistics.median(walls) * 1e3, "profiled_ms": sum(ops.values()), "linear_ms": linear,
            "attention_ms": attention, "other_ops_ms": sum(ops.values()) - linear - attention}


def profile_step(model: str = "smollm2-135m", threads: int = 1, context: int = 128,
                 new_tokens: list[int] = (1, 2, 3, 4, 5, 9), reps: int = 5, out: str | None = None) -> None:
    """Mode ``step_anatomy``: both tables for ``model`` (an alias or folder, loaded in fp32), printed,
    and with ``out`` written there as ``anatomy.md`` and ``anatomy.json``."""
    torch.set_num_threads(threads)
    target = specdec.load_target(model, dtype=torch.float32)
    weights = [m.weight.detach() for m in target.model.modules() if isinstance(m, torch.nn.Linear)]
    mb = sum(w.numel() * w.element_size() for w in weights) / 1e6
    ms = list(new_tokens)
    with torch.inference_mode():
        table = products(weights, ms, reps)
        parts = {m: anatomy(target, context, m, reps) for m in ms}
        masked = {m: anatomy(target, context, m, reps, masked=True)["wall_ms"] for m in ms}
    lines = [f"{model}, {len(weights)} linear layers ({mb:.0f} MB fp32), {threads} thread(s); "
             f"ms per pass over all of them, best of {reps}", "",
             "| product | " + " | ".join(f"{m} rows" for m in ms) + " |", "|---|" + "---:|" * len(ms)]
    lines += [f"| {name} | " + " | ".join(f"{t:.1f}" for t in row) + " |" for name, row in table.items()]
    lines += ["", f"`Target.forward` over m chain tokens after {context} committed ones (ms per forward; "
              "`outside ops`: wall minus everything the profiler timed)", "",
              "| m | wall | t(m)/t(1) | linear products | attention | other ops | outside ops | wall, context with holes (masked) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    first = parts[ms[0]]["wall_ms"]
    for m, p in parts.items():
        lines.append(f"| {m} | {p['wall_ms']:.1f} | {p['wall_ms'] / first:.2f} | {p['linear_ms']:.1f} | "
                     f"{p['attention_ms']:.1f} | {p['other_ops_ms']:.1f} | {p['wall_ms'] - p['profiled_ms']:.1f} | "
                     f"{masked[m]:.1f} |")
    text = "\n".join(lines)
    print(text)
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        args = dict(model=model, threads=threads, context=context, new_tokens=ms, reps=reps, out=out)
        (folder / "anatomy.md").write_text(text + "\n")
        (folder / "anatomy.json").write_text(json.dumps({"args": {k: str(v) for k, v in args.items()},
                                                         "products": table, "anatomy": parts,
                                                         "masked_wall_ms": masked}, indent=2) + "\n")

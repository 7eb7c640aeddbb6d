"""One experiment run: a dataset through speculative and autoregressive decoding (and, side by side,
transformers' ``generate()`` peers) in one process, with every measurement the issue tracker asks for.

    result = run_experiment(RunConfig(...), out_dir="runs/x")
    result.summary["spec"]["speedup"], result.summary["spec"]["predicted_speedup"]

Methods (keys of ``summary`` and the ``method`` field of every JSONL record):

- ``ar``: this library's loop with no drafter, the baseline (``baseline=True`` or no drafter);
- ``spec``: the configured drafter and verifier, ``k = num_speculative_tokens``;
- ``hf_generate``, ``hf_prompt_lookup``, ``hf_assistant``: ``model.generate()`` plain, with
  ``prompt_lookup_num_tokens=k``, with ``assistant_model=`` (the draft_model drafter's own weights);
  batch 1, as transformers' candidate generators support no more.

Requests run in batches of ``concurrency`` (static batching: a batch runs until its last row
finishes; finished rows leave the batch at once). Batches of the methods are interleaved, so slow
drift of the machine hits every method alike. Multi-turn datasets run turn by turn: turn 2 of a
conversation is encoded with the method's own answer to turn 1.

Measured speedup and predicted speedup (``SpeedupModel``) sit side by side: the prediction uses the
measured mean accepted length, the measured per-step draft and verify costs of the speculative run
and the measured per-token target cost of the autoregressive run; the loop's own overhead is what
separates it from the measured decode speedup.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdec.api import encode_messages, load_target, make_drafter, make_verifier
from specdec.eval.config import HF_METHODS, RunConfig, TargetConfig
from specdec.eval.datasets import Sample, load_dataset
from specdec.drafter import Drafter
from specdec.loop import Request, run
from specdec.metrics import RequestMetrics, RunMetrics, summarize
from specdec.provenance import git_sha
from specdec.sampling import SamplingParams
from specdec.target import Target
from specdec.verifier import Verifier

__all__ = ["build_target", "build_drafter", "run_experiment", "ExperimentResult", "predicted_speedup",
           "summary_markdown", "git_sha"]


def build_target(cfg: TargetConfig) -> Target:
    """The target a config names; ``model: tiny`` builds a random-weight model (tests, CI)."""
    if cfg.model == "tiny":
        from specdec.testing.tiny import tiny_model

        return Target(tiny_model(**{"vocab_size": 64, **cfg.tiny}).to(getattr(torch, cfg.dtype)))
    return load_target(cfg.model, dtype=getattr(torch, cfg.dtype), device_map=cfg.device_map)


def build_drafter(cfg: RunConfig, target: Target) -> Drafter | None:
    """The configured drafter; on the tiny target, the drafter's own random-weight ``tiny()``."""
    name, options = cfg.drafter.name, dict(cfg.drafter.options)
    if not name:
        return None
    if cfg.target.model == "tiny":
        from specdec.drafters import DRAFTERS

        if name not in DRAFTERS:
            raise ValueError(f"unknown drafter {name!r}; registered: {sorted(DRAFTERS)}")
        return DRAFTERS[name].tiny(target, **options)
    return make_drafter(name, target, **options)


# ------------------------------------------------------------------------------------------------
# prompts

def encode_turn(target: Target, sample: Sample, turn: int, answers: list[str], chat: bool) -> list[int]:
    """Token ids of ``sample``'s turn ``turn``, after the earlier turns and this method's answers."""
    if sample.prompt_ids is not None:
        return list(sample.prompt_ids)
    if target.tokenizer is None:
        raise ValueError("text datasets need a target with a tokenizer (the tiny target has none: use random)")
    messages: list[dict[str, str]] = []
    for t in range(turn):
        messages += [{"role": "user", "content": sample.turns[t]}, {"role": "assistant", "content": answers[t]}]
    return encode_messages(target, messages + [{"role": "user", "content": sample.turns[turn]}], chat)


# ------------------------------------------------------------------------------------------------
# methods: each runs one batch of requests and returns one record per request plus the batch's RunMetrics

@dataclass
class Job:
    """One request of one turn."""

    index: int  # request index: turn * num_samples + sample index (its seed offset)
    sample: int
    turn: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams


BatchFn = Callable[[list[Job]], tuple[list[dict], RunMetrics | None]]


def _loop_method(target: Target, drafter: Drafter | None, verifier: Verifier, k: int, eos: set[int]) -> BatchFn:
    def fn(jobs: list[Job]) -> tuple[list[dict], RunMetrics | None]:
        res = run(target, drafter, verifier, [Request(j.prompt, j.max_new_tokens, j.sampling) for j in jobs], k=k,
                  eos_token_ids=eos)
        records = []
        for r in res.requests:
            m = r.metrics
            records.append({"tokens": r.tokens, **m.to_dict(), "tpot_s": _tpot(m.latency_s, m.ttft_s, m.new_tokens)})
        return records, res.metrics
    return fn


class _FirstTokenTimer:
    """A transformers streamer that only notes when the first new token arrives."""

    def __init__(self) -> None:
        self.calls, self.first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # the first put is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _hf_method(target: Target, kind: str, k: int, eos: set[int], drafter: Drafter | None,
               drafter_name: str | None, drafter_options: dict[str, Any]) -> BatchFn:
    model = target.model
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = next(iter(eos), 0)
    extra: dict[str, Any] = {}
    if kind == "prompt_lookup":
        extra = {"prompt_lookup_num_tokens": k}
        if drafter_name == "ngram" and "max_ngram" in drafter_options:
            extra["max_matching_ngram_size"] = int(drafter_options["max_ngram"])
    elif kind == "assistant":
        if drafter_name != "draft_model" or drafter is None:
            raise ValueError("hf_compare 'assistant' runs the draft_model drafter's weights: use drafter=draft_model")
        extra = {"assistant_model": drafter.draft.model, "num_assistant_tokens": k,  # type: ignore[attr-defined]
                 "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
    elif kind == "mtp":
        if drafter_name != "mtp" or drafter is None:
            raise ValueError("hf_compare 'mtp' runs the mtp drafter's checkpoint: use drafter=mtp")
        # transformers finds MTP weights through `_keys_to_ignore_on_load_unexpected`, which
        # DeepSeek-V3 hard-codes to the 671B layout (model.layers.61): point it at this target's.
        L, D = target.num_layers, drafter.depth  # type: ignore[attr-defined]
        model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{L + i}\..*" for i in range(D)]
        extra = {"use_mtp": True}
    elif kind == "dflash":
        if drafter_name != "dflash" or drafter is None:
            raise ValueError("hf_compare 'dflash' runs the dflash drafter's weights: use drafter=dflash")
        from specdec.drafters.dflash.peer import to_transformers

        # transformers' DFlashTokenCandidateGenerator drafts a whole block (block_size - 1 tokens)
        extra = {"assistant_model": to_transformers(drafter), "speculation_type": "dflash"}  # type: ignore[arg-type]
    # ignore_eos: an id the model never produces (transformers needs some eos or pad to be set)
    eos_ids = sorted(eos) if eos else None

    @torch.inference_mode()
    def fn(jobs: list[Job]) -> tuple[list[dict], RunMetrics | None]:
        records = []
        for j in jobs:
            ids = torch.tensor([j.prompt], device=target.device)
            s = j.sampling
            sampling: dict[str, Any] = {"do_sample": False}
            if not s.greedy:
                sampling = {"do_sample": True, "temperature": s.temperature, "top_k": s.top_k or None, "top_p": s.top_p}
                torch.manual_seed(s.seed if s.seed is not None else 0)
            timer = _FirstTokenTimer()
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=j.max_new_tokens,
                                 eos_token_id=eos_ids, pad_token_id=pad, streamer=timer, **sampling, **extra)
            t1 = time.perf_counter()
            new = out[0, ids.shape[1]:].tolist()
            if eos_ids is None:
                finish = "length"
            else:  # generate pads nothing at batch 1, but cut at the first EOS to be safe
                cut = next((i for i, t in enumerate(new) if t in eos), None)
                new = new if cut is None else new[: cut + 1]
                finish = "eos" if cut is not None else "length"
            ttft = (timer.first or t1) - t0
            records.append({"tokens": new, "prompt_tokens": len(j.prompt), "new_tokens": len(new),
                            "finish_reason": finish, "ttft_s": ttft, "latency_s": t1 - t0,
                            "tpot_s": _tpot(t1 - t0, ttft, len(new))})
        return records, None
    return fn


def _tpot(latency: float, ttft: float, n: int) -> float:
    return (latency - ttft) / (n - 1) if n > 1 else 0.0


# ------------------------------------------------------------------------------------------------
# the run

@dataclass
class ExperimentResult:
    config: RunConfig
    records: list[dict]  # one per (method, request), in run order
    summary: dict[str, dict]  # method -> measurements
    out_dir: Path | None = None
    runs: dict[str, list[RunMetrics]] = field(default_factory=dict)  # method -> one per batch

    def tokens(self, method: str) -> list[list[int]]:
        """New tokens per request of ``method``, by request index."""
        recs = sorted((r for r in self.records if r["method"] == method), key=lambda r: r["request"])
        return [r["tokens"] for r in recs]


def run_experiment(cfg: RunConfig, out_dir: str | Path | None = None, target: Target | None = None
                   ) -> ExperimentResult:
    """Run ``cfg``; with ``out_dir``, write config.json, requests.jsonl, summary.json and summary.md."""
    target = target if target is not None else build_target(cfg.target)
    samples = load_dataset(cfg.dataset, target.tokenizer, target.vocab_size, cfg.seed)
    if not samples:
        raise ValueError(f"dataset {cfg.dataset.name!r} gave no prompts")
    k = cfg.num_speculative_tokens
    eos = set() if cfg.dataset.ignore_eos else target.eos_token_ids
    verifier = make_verifier(cfg.verifier.name, **cfg.verifier.options)
    drafter = build_drafter(cfg, target)

    methods: dict[str, BatchFn] = {}
    baselines: dict[str, str] = {}
    if cfg.baseline or drafter is None:
        methods["ar"] = _loop_method(target, None, verifier, k, eos)
    if drafter is not None:
        methods["spec"] = _loop_method(target, drafter, verifier, k, eos)
        baselines["spec"] = "ar"
    for kind in cfg.hf_compare:
        methods[f"hf_{kind}"] = _hf_method(target, kind, k, eos, drafter, cfg.drafter.name, cfg.drafter.options)
        if kind != "generate":
            baselines[f"hf_{kind}"] = "hf_generate" if "generate" in cfg.hf_compare else "ar"
    if "hf_generate" in methods:
        baselines["hf_generate"] = "ar"

    base_seed = cfg.request_seed_base
    num_turns = max(len(s.turns) for s in samples) if samples[0].prompt_ids is None else 1
    if cfg.warmup:
        s0 = samples[0]
        warm = Job(-1, 0, 0, encode_turn(target, s0, 0, [], cfg.dataset.chat), min(4, s0.output_len),
                   _sampling(cfg.sampling, base_seed))
        for fn in methods.values():
            fn([warm])

    answers: dict[str, list[list[str]]] = {m: [[] for _ in samples] for m in methods}
    records: list[dict] = []
    runs: dict[str, list[RunMetrics]] = {m: [] for m in methods}
    total = sum(min(len(s.turns), num_turns) if s.prompt_ids is None else 1 for s in samples)
    bar = tqdm(total=total * len(methods), desc="requests", unit="req", disable=not cfg.progress)
    for turn in range(num_turns):
        todo = [i for i, s in enumerate(samples) if s.prompt_ids is not None or turn < len(s.turns)]
        for b0 in range(0, len(todo), cfg.concurrency):
            batch = todo[b0: b0 + cfg.concurrency]
            for name, fn in methods.items():  # interleaved: every method runs this batch in turn
                jobs = [Job(turn * len(samples) + i, i, turn,
                            encode_turn(target, samples[i], turn, answers[name][i], cfg.dataset.chat),
                            samples[i].output_len, _sampling(cfg.sampling, base_seed + turn * len(samples) + i))
                        for i in batch]
                recs, rm = fn(jobs)
                if rm is not None:
                    runs[name].append(rm)
                for j, rec in zip(jobs, recs):
                    tok = target.tokenizer
                    text = tok.decode(rec["tokens"], skip_special_tokens=True) if tok is not None else None
                    answers[name][j.sample].append(text or "")
                    records.append({"method": name, "request": j.index, "sample": j.sample, "turn": turn,
                                    "id": samples[j.sample].id, "category": samples[j.sample].category,
                                    "batch": b0 // cfg.concurrency, "seed": j.sampling.seed, **rec, "text": text})
                bar.update(len(jobs))
    bar.close()

    summary = summarize_methods(records, runs, baselines, cfg)
    result = ExperimentResult(cfg, records, summary, Path(out_dir) if out_dir else None, runs)
    if out_dir is not None:
        write_outputs(result, Path(out_dir))
    return result


def _sampling(base: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(base.temperature, base.top_k, base.top_p, seed)


# ------------------------------------------------------------------------------------------------
# measurements

def predicted_speedup(mean_accepted_length: float, draft_s_per_step: float, verify_s_per_step: float,
                      ar_s_per_token: float) -> float:
    """Speedup of decoding if the loop cost nothing: tokens per step over the step's cost, against
    the autoregressive cost per token. ``verify`` = target forward + verifier."""
    step = draft_s_per_step + verify_s_per_step
    return mean_accepted_length * ar_s_per_token / step if step > 0 else 0.0


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summarize_methods(records: list[dict], runs: dict[str, list[RunMetrics]], baselines: dict[str, str],
                      cfg: RunConfig) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for name in runs:
        recs = [r for r in records if r["method"] == name]
        lat, ttft = [r["latency_s"] for r in recs], [r["ttft_s"] for r in recs]
        tpot = [r["tpot_s"] for r in recs if r["new_tokens"] > 1]
        new_tokens = sum(r["new_tokens"] for r in recs)
        s: dict[str, Any] = {"method": name, "requests": len(recs), "new_tokens": new_tokens,
                             "k": cfg.num_speculative_tokens if name != "ar" else 0,
                             "concurrency": cfg.concurrency if name in ("ar", "spec") else 1,
                             "ttft_mean_s": statistics.fmean(ttft),
                             "tpot_mean_s": statistics.fmean(tpot) if tpot else 0.0,
                             "latency_mean_s": statistics.fmean(lat), "latency_p50_s": _pct(lat, 0.5),
                             "latency_p90_s": _pct(lat, 0.9)}
        if runs[name]:  # this library's loop: the time split and acceptance
            tot = RunMetrics()
            for m in runs[name]:
                for f in ("wall_s", "prefill_s", "draft_s", "target_s", "verify_s", "batch_steps", "new_tokens"):
                    setattr(tot, f, getattr(tot, f) + getattr(m, f))
            acc = summarize([RequestMetrics(**{f: r[f] for f in (
                "prompt_tokens", "new_tokens", "steps", "drafted", "accepted", "drafted_at", "accepted_at")})
                for r in recs])
            row_steps = acc["steps"]
            s.update({"wall_s": tot.wall_s, "prefill_s": tot.prefill_s, "draft_s": tot.draft_s,
                      "target_s": tot.target_s, "verify_s": tot.verify_s, "other_s": tot.other_s,
                      "overhead_frac": tot.other_s / tot.wall_s if tot.wall_s else 0.0, "batch_steps": tot.batch_steps,
                      "row_steps": row_steps, "mean_accepted_length": acc["mean_accepted_length"],
                      "acceptance_rate": acc["acceptance_rate"], "acceptance_at": acc["acceptance_at"],
                      "draft_s_per_step": tot.draft_s / row_steps if row_steps else 0.0,
                      "verify_s_per_step": (tot.target_s + tot.verify_s) / row_steps if row_steps else 0.0,
                      "decode_s_per_token": (tot.wall_s - tot.prefill_s) / max(new_tokens - len(recs), 1)})
        else:  # transformers: wall time is the sum of request latencies (batch 1)
            s["wall_s"] = sum(lat)
        s["tokens_per_s"] = new_tokens / s["wall_s"] if s["wall_s"] else 0.0
        out[name] = s
    for name, base in baselines.items():
        s, b = out[name], out.get(base)
        if b is None:
            continue
        s["baseline"] = base
        s["speedup"] = s["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else 0.0
        if "decode_s_per_token" in s and "decode_s_per_token" in b:
            s["decode_speedup"] = b["decode_s_per_token"] / s["decode_s_per_token"] if s["decode_s_per_token"] else 0.0
            ar_token = (b["draft_s"] + b["target_s"] + b["verify_s"]) / b["row_steps"] if b["row_steps"] else 0.0
            s["predicted_speedup"] = predicted_speedup(s["mean_accepted_length"], s["draft_s_per_step"],
                                                       s["verify_s_per_step"], ar_token)
        mine = {r["request"]: r["tokens"] for r in records if r["method"] == name}
        ref = {r["request"]: r["tokens"] for r in records if r["method"] == base}
        s["identical_to_baseline"] = sum(mine[i] == ref.get(i) for i in mine)
    if "hf_generate" in out:  # every method's outputs against plain transformers generate()
        ref = {r["request"]: r["tokens"] for r in records if r["method"] == "hf_generate"}
        for name, s in out.items():
            mine = {r["request"]: r["tokens"] for r in records if r["method"] == name}
            s["identical_to_hf_generate"] = sum(mine[i] == ref.get(i) for i in mine)
    return out


# ------------------------------------------------------------------------------------------------
# output files

def write_outputs(result: ExperimentResult, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    meta = {"config": asdict(result.config), "git_sha": git_sha(), "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_threads": torch.get_num_threads()}
    (out / "config.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    with open(out / "requests.jsonl", "w") as f:
        for r in result.records:
            f.write(json.dumps(r) + "\n")
    (out / "summary.json").write_text(json.dumps(result.summary, indent=2) + "\n")
    (out / "summary.md").write_text(summary_markdown(result.summary, result.config))


def summary_markdown(summary: dict[str, dict], cfg: RunConfig | None = None) -> str:
    """The summary as markdown tables: throughput and latency, speedups, acceptance, time split."""
    lines = []
    if cfg is not None:
        d, t = cfg.dataset, cfg.target
        opts = f" {cfg.drafter.options}" if cfg.drafter.options else ""
        lines += [f"target `{t.model}` ({t.dtype}), drafter `{cfg.drafter.name or 'none'}`{opts},"
                  f" verifier `{cfg.verifier.name}`, k = {cfg.num_speculative_tokens}, concurrency = {cfg.concurrency},"
                  f" dataset `{d.name}` ({d.num_prompts} prompts), temperature {cfg.sampling.temperature},"
                  f" seed {cfg.seed}", ""]
    hf = any("identical_to_hf_generate" in s for s in summary.values())
    lines += ["| method | requests | new tokens | wall s | tok/s | TTFT ms | TPOT ms | latency mean s | latency p90 s"
              " | speedup | decode speedup | predicted | mean acc. len | identical to baseline |"
              + (" identical to hf_generate |" if hf else ""),
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if hf else "")]

    def f(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for name, s in summary.items():
        ident = f"{s['identical_to_baseline']}/{s['requests']} ({s['baseline']})" if "baseline" in s else "-"
        lines.append(
            f"| {name} | {s['requests']} | {s['new_tokens']} | {s['wall_s']:.2f} | {s['tokens_per_s']:.1f}"
            f" | {s['ttft_mean_s'] * 1e3:.1f} | {s['tpot_mean_s'] * 1e3:.1f} | {s['latency_mean_s']:.2f}"
            f" | {s['latency_p90_s']:.2f} | {f(s.get('speedup'), '.2f')} | {f(s.get('decode_speedup'), '.2f')}"
            f" | {f(s.get('predicted_speedup'), '.2f')} | {f(s.get('mean_accepted_length'), '.2f')} | {ident} |"
            + (f" {s['identical_to_hf_generate']}/{s['requests']} |" if hf else ""))
    loop = {n: s for n, s in summary.items() if "prefill_s" in s}
    if loop:
        lines += ["", "Time split of this library's loop (share of wall time):", "",
                  "| method | prefill | draft | target | verify | loop overhead | draft ms/step | verify ms/step |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name, s in loop.items():
            w = s["wall_s"] or 1.0
            lines.append(f"| {name} | {s['prefill_s'] / w:.1%} | {s['draft_s'] / w:.1%} | {s['target_s'] / w:.1%}"
                         f" | {s['verify_s'] / w:.1%} | {s['other_s'] / w:.1%} | {s['draft_s_per_step'] * 1e3:.2f}"
                         f" | {s['verify_s_per_step'] * 1e3:.2f} |")
    spec = {n: s for n, s in loop.items() if s.get("acceptance_at")}
    if spec:
        lines += ["", "Acceptance per draft position:", ""]
        for name, s in spec.items():
            lines.append(f"- {name}: " + " ".join(f"{a:.2f}" for a in s["acceptance_at"])
                         + f" (acceptance rate {s['acceptance_rate']:.2f})")
    return "\n".join(lines) + "\n"

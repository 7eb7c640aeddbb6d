"""One experiment run: a dataset through speculative and autoregressive decoding (and, side by side,
transformers' ``generate()`` peers) in one process, with every measurement a results table reports.

    result = run_experiment(RunConfig(...), out_dir="runs/x")
    result.summary["spec"]["speedup"], result.summary["spec"]["predicted_speedup"]

Methods (keys of ``summary`` and the ``method`` field of every JSONL record):

- ``ar``: this library's loop with no drafter, the baseline (``baseline=True`` or no drafter);
- ``spec``: the configured drafter and verifier, ``k = num_speculative_tokens``; or, with ``methods``,
  one method per entry and k (``<key>`` or ``<key> k=<k>``), each its own drafter, options and
  draft-length policy (``policy: adaptive``: one :class:`~specdec.policy.AdaptivePolicy` per method,
  which keeps what it measured from batch to batch);
- ``hf_generate`` and the peers ``hf_<name>`` of ``hf_compare``: ``model.generate()`` plain, or with
  the keyword arguments the peer's hook returns (:func:`specdec.registry.transformers_peer`: an
  entry point in the mirrored drafter's room, given the first speculative method's drafter and k);
  batch 1, as transformers' candidate generators support no more.

Requests run in batches of ``concurrency`` (static batching: a batch runs until its last row
finishes; finished rows leave the batch at once). Batches of the methods are interleaved, so slow
drift of the machine hits every method alike. Multi-turn datasets run turn by turn: turn 2 of a
conversation is encoded with the method's own answer to turn 1.

Measured speedup and predicted speedup (:func:`predicted_speedup`) sit side by side: the prediction uses the
measured mean accepted length, the measured per-step draft and verify costs of the speculative run
and the measured per-token target cost of the autoregressive run; the loop's own overhead is what
separates it from the measured decode speedup.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdec.api import encode_messages, make_drafter, make_verifier
from specdec.eval.config import DrafterConfig, RunConfig, TargetConfig
from specdec.data.config import build_target
from specdec.data.datasets import Sample, load_dataset
from specdec.drafter import Drafter
from specdec.loop import Request, run
from specdec.metrics import RequestMetrics, RunMetrics, summarize
from specdec.registry import transformers_peer
from specdec.timing import now
from specdec.policy import make_policy
from specdec.provenance import git_sha, record
from specdec.registry import drafter_class
from specdec.sampling import SamplingParams
from specdec.target import Target
from specdec.verifier import Verifier

__all__ = ["build_target", "build_drafter", "check_checkpoints", "run_experiment", "ExperimentResult", "peer_kwargs", "divergences",
           "predicted_speedup", "lossy_mark", "k_label", "by_group", "git_sha", "write_config"]


def build_drafter(cfg: DrafterConfig, target_cfg: TargetConfig, target: Target) -> Drafter | None:
    """The configured drafter; on the tiny target, the drafter's own random-weight ``tiny()`` (a
    configured ``checkpoint`` or ``token_map`` with its ``draft_vocab`` holds weights or ids for the
    real target: they are left out)."""
    name, options = cfg.name, dict(cfg.options)
    if not name:
        return None
    if target_cfg.model == "tiny":
        for real in ("checkpoint", "token_map", "draft_vocab"):
            options.pop(real, None)
        return drafter_class(name).tiny(target, **options)
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


def _loop_method(target: Target, drafter: Drafter | None, verifier: Verifier, k: int, eos: set[int],
                 policy: str = "fixed") -> BatchFn:
    chooser = make_policy(policy)  # one per method: it learns costs and acceptance over the batches

    def fn(jobs: list[Job]) -> tuple[list[dict], RunMetrics | None]:
        res = run(target, drafter, verifier, [Request(j.prompt, j.max_new_tokens, j.sampling) for j in jobs], k=k,
                  eos_token_ids=eos, policy=chooser)
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
            self.first = now()

    def end(self) -> None:
        pass


def peer_kwargs(kind: str, target: Target, drafter: Drafter | None, k: int) -> dict[str, Any]:
    """Extra ``generate()`` arguments of the transformers peer ``kind``: none for plain
    ``generate``, else from the hook the mirrored drafter's room declares
    (:func:`specdec.registry.transformers_peer`)."""
    return {} if kind == "generate" else transformers_peer(kind)(target, drafter, k)


def _hf_method(target: Target, extra: dict[str, Any], eos: set[int]) -> BatchFn:
    """``model.generate()`` one request at a time, with the peer's ``extra`` arguments."""
    model = target.model
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = next(iter(eos), 0)
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
            t0 = now(target.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=j.max_new_tokens,
                                 eos_token_id=eos_ids, pad_token_id=pad, streamer=timer, **sampling, **extra)
            t1 = now(target.device)
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


def check_checkpoints(cfg: RunConfig) -> None:
    """Every drafter checkpoint ``cfg`` names, found before the target loads: one that is recorded
    but not committed raises :class:`specdec.models.CheckpointNotCommitted` (the command that makes
    it) now, not after minutes of loading (the tiny target takes none: its drafters are random)."""
    if cfg.target.model == "tiny":
        return
    from specdec.models import resolve_checkpoint

    for dcfg, _, _ in cfg.speculative_methods().values():
        if dcfg.options.get("checkpoint"):
            resolve_checkpoint(dcfg.options["checkpoint"])


def run_experiment(cfg: RunConfig, out_dir: str | Path | None = None, target: Target | None = None
                   ) -> ExperimentResult:
    """Run ``cfg``; with ``out_dir``, write config.json, requests.jsonl and summary.json (the lab renders
    them: experiments/report.py)."""
    check_checkpoints(cfg)
    target = target if target is not None else build_target(cfg.target)
    samples = load_dataset(cfg.dataset, target.tokenizer, target.vocab_size, cfg.seed)
    if not samples:
        raise ValueError(f"dataset {cfg.dataset.name!r} gave no prompts")
    eos = set() if cfg.dataset.ignore_eos else target.eos_token_ids
    verifier = make_verifier(cfg.verifier.name, **cfg.verifier.options)
    built: dict[int, Drafter | None] = {}  # one drafter per methods entry, shared by its k values
    spec: dict[str, tuple[DrafterConfig, Drafter | None, int, str]] = {}
    for name, (dcfg, k, policy) in cfg.speculative_methods().items():
        if id(dcfg) not in built:
            built[id(dcfg)] = build_drafter(dcfg, cfg.target, target)
        spec[name] = (dcfg, built[id(dcfg)], k, policy)

    methods: dict[str, BatchFn] = {}
    info: dict[str, tuple[str | None, int, bool, str | None]] = {}  # method -> (drafter name, k, lossless, policy)
    baselines: dict[str, str] = {}
    if cfg.baseline or not spec:
        methods["ar"] = _loop_method(target, None, verifier, cfg.num_speculative_tokens, eos)
        info["ar"] = (None, 0, verifier.lossless, None)
    for name, (dcfg, drafter, k, policy) in spec.items():
        methods[name] = _loop_method(target, drafter, verifier, k, eos, policy)
        info[name] = (dcfg.name, k, verifier.lossless, policy)
        baselines[name] = "ar"
    peer_cfg, peer, peer_k, _ = next(iter(spec.values()), (DrafterConfig(), None, cfg.num_speculative_tokens, None))
    for kind in cfg.hf_compare:
        name = f"hf_{kind}"
        methods[name] = _hf_method(target, peer_kwargs(kind, target, peer, peer_k), eos)
        info[name] = (None, 0, True, None) if kind == "generate" else (peer_cfg.name, peer_k, True, None)  # exact
        baselines[name] = "hf_generate" if kind != "generate" and "generate" in cfg.hf_compare else "ar"

    base_seed = cfg.request_seed_base
    num_turns = max(len(s.turns) for s in samples) if samples[0].prompt_ids is None else 1
    if cfg.warmup:
        s0 = samples[0]
        warm = Job(-1, 0, 0, encode_turn(target, s0, 0, [], cfg.dataset.chat), min(4, s0.output_len),
                   _sampling(cfg.sampling, base_seed))
        for fn in methods.values():
            fn([warm])

    answers: dict[str, list[list[str]]] = {m: [[] for _ in samples] for m in methods}
    prompts: dict[tuple[str, int], list[int]] = {}  # (method, request) -> prompt ids
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
                    prompts[name, j.index] = j.prompt
                    records.append({"method": name, "request": j.index, "sample": j.sample, "turn": turn,
                                    "id": samples[j.sample].id, "category": samples[j.sample].category,
                                    "repeat": samples[j.sample].repeat,
                                    "batch": b0 // cfg.concurrency, "seed": j.sampling.seed, **rec, "text": text})
                bar.update(len(jobs))
    bar.close()

    summary = summarize_methods(records, runs, baselines, info, cfg.concurrency)
    plan = target.row_plan_record()  # which few-row plan the loop's target forwards followed
    for name in ["ar", *spec]:
        if name in summary:
            summary[name]["few_rows"] = plan
    for name, base in baselines.items():
        if base in summary:
            summary[name]["divergences"] = divergences(target, records, prompts, name, base)
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
                      info: dict[str, tuple[str | None, int, bool, str | None]], concurrency: int) -> dict[str, dict]:
    """Per method (``info``: its drafter name, k, whether its verifier keeps the target's
    distribution, and its draft-length policy) the measurements of ``summary.json``."""
    out: dict[str, dict] = {}
    for name in runs:
        recs = [r for r in records if r["method"] == name]
        lat, ttft = [r["latency_s"] for r in recs], [r["ttft_s"] for r in recs]
        tpot = [r["tpot_s"] for r in recs if r["new_tokens"] > 1]
        new_tokens = sum(r["new_tokens"] for r in recs)
        s: dict[str, Any] = {"method": name, "drafter": info[name][0], "k": info[name][1], "lossless": info[name][2],
                             "policy": info[name][3], "requests": len(recs),
                             "new_tokens": new_tokens, "concurrency": concurrency if runs[name] else 1,
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
            row_steps, drafted = acc["steps"], sum(r["drafted"] for r in recs)
            s.update({"wall_s": tot.wall_s, "prefill_s": tot.prefill_s, "draft_s": tot.draft_s,
                      "target_s": tot.target_s, "verify_s": tot.verify_s, "other_s": tot.other_s,
                      "overhead_frac": tot.other_s / tot.wall_s if tot.wall_s else 0.0, "batch_steps": tot.batch_steps,
                      "row_steps": row_steps, "mean_accepted_length": acc["mean_accepted_length"],
                      "acceptance_rate": acc["acceptance_rate"], "acceptance_at": acc["acceptance_at"],
                      "drafted_per_step": drafted / row_steps if row_steps else 0.0,
                      "draft_s_per_step": tot.draft_s / row_steps if row_steps else 0.0,
                      "draft_s_per_token": tot.draft_s / drafted if drafted else 0.0,
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
            target_step = b["target_s"] / b["batch_steps"] if b["batch_steps"] else 0.0  # one plain decoding step
            s["draft_cost_vs_target_step"] = s["draft_s_per_token"] / target_step if target_step else 0.0
        s["identical_to_baseline"] = _identical(records, name, base)
    if len({_group(r) for r in records}) > 1:
        for name, s in out.items():
            s["by_group"] = by_group(records, name, baselines.get(name))
    if "hf_generate" in out:  # every method against plain transformers generate()
        ref = out["hf_generate"]
        for name, s in out.items():
            s["identical_to_hf_generate"] = _identical(records, name, "hf_generate")
            s["speedup_vs_hf_generate"] = s["tokens_per_s"] / ref["tokens_per_s"] if ref["tokens_per_s"] else 0.0
    return out


def _group(record: dict) -> str:
    """A request's group: its category, and which pass it is when the dataset repeats its prompts."""
    label = record.get("category") or "-"
    return f"{label}, pass {record['repeat'] + 1}" if record.get("repeat") else label


def by_group(records: list[dict], method: str, base: str | None) -> dict[str, dict]:
    """Per group of requests (:func:`_group`): mean accepted length and, against ``base``, the
    latency speedup (the group's summed baseline latencies over its summed latencies)."""
    mine = [r for r in records if r["method"] == method]
    ref = {r["request"]: r for r in records if r["method"] == base}
    out: dict[str, dict] = {}
    for g in sorted({_group(r) for r in mine}):
        rs = [r for r in mine if _group(r) == g]
        d: dict[str, Any] = {"requests": len(rs), "new_tokens": sum(r["new_tokens"] for r in rs)}
        steps = sum(r.get("steps", 0) for r in rs)
        if steps:
            d["mean_accepted_length"] = (sum(r["accepted"] for r in rs) + steps) / steps
        lat = sum(r["latency_s"] for r in rs)
        if ref and lat:
            d["latency_speedup"] = sum(ref[r["request"]]["latency_s"] for r in rs) / lat
        out[g] = d
    return out


def _tokens(records: list[dict], method: str) -> dict[int, list[int]]:
    return {r["request"]: r["tokens"] for r in records if r["method"] == method}


def _identical(records: list[dict], method: str, ref: str) -> int:
    mine, theirs = _tokens(records, method), _tokens(records, ref)
    return sum(t == theirs.get(i) for i, t in mine.items())


@torch.inference_mode()
def divergences(target: Target, records: list[dict], prompts: dict[tuple[str, int], list[int]], method: str,
                ref: str) -> list[dict]:
    """Where ``method``'s outputs first differ from ``ref``'s, with the target's top-2 logits there
    (after ``ref``'s prompt and tokens): a tiny gap is a numerical near-tie, not a bug."""
    mine, theirs = _tokens(records, method), _tokens(records, ref)
    out = []
    for i, got in sorted(mine.items()):
        want = theirs.get(i)
        if want is None or got == want:
            continue
        pos = next((p for p, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
        d: dict[str, Any] = {"request": i, "position": pos, "got": got[pos] if pos < len(got) else None,
                             "want": want[pos] if pos < len(want) else None}
        if d["got"] is not None and d["want"] is not None:
            ids = torch.tensor([prompts[ref, i] + want[:pos]], device=target.device)
            top = target.model(ids).logits[0, -1].float().topk(2)
            d.update({"top2_ids": top.indices.tolist(), "top2_logits": top.values.tolist()})
        out.append(d)
    return out


# ------------------------------------------------------------------------------------------------
# output files

def write_config(cfg: RunConfig, out: Path) -> None:
    """``config.json``: what ran (the config and its :func:`specdec.provenance.record`: the command,
    git SHA and dirty flag, versions, the machine: CPU model and extensions, GPU, torch threads,
    dtype, and the date), in every run folder: what a results table is rendered with."""
    out.mkdir(parents=True, exist_ok=True)
    on_gpu = bool(cfg.target.device_map) and torch.cuda.is_available()
    meta = {"config": asdict(cfg), **record(cfg.target.dtype, on_gpu=on_gpu), "torch_threads": torch.get_num_threads()}
    (out / "config.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")


def write_outputs(result: ExperimentResult, out: Path) -> None:
    write_config(result.config, out)
    with open(out / "requests.jsonl", "w") as f:
        for r in result.records:
            f.write(json.dumps(r) + "\n")
    (out / "summary.json").write_text(json.dumps(result.summary, indent=2) + "\n")


def k_label(s: dict) -> str:
    """The k column: k, or "≤k (adaptive)" when a policy chose how many of the k drafts to verify."""
    if not s.get("k"):
        return "-"
    return f"≤{s['k']} ({s['policy']})" if s.get("policy") not in (None, "fixed") else str(s["k"])


def lossy_mark(s: dict) -> str:
    """" (lossy)" after a method whose verifier changes the target's distribution, wherever results
    are read (tables, plot legends); summaries written before the field existed count as lossless."""
    return "" if s.get("lossless", True) else " (lossy)"

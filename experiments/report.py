"""Figures and a markdown report for a sweep (a Hydra multirun folder) or a single run folder, and
each question's current table for docs/results/ (``--table``).

    .venv/bin/python experiments/report.py multirun/<date>/<time> [--out DIR] [--title TEXT] [--per-request]
    .venv/bin/python experiments/report.py multirun/<question> --table docs/results/<question>.md
    .venv/bin/python experiments/report.py --page docs/results/*.md

Every page of docs/results/ is rendered from its record, ``docs/results/<name>.json`` (:func:`render_page`):
the title, the question, the header (command, git SHA, machine, date), the figures and the tables;
the page's prose follows its notes line and is kept when it is rendered again. ``--table`` makes a
question's record from its run alone (:func:`question_record`: the question its preset asks, the
provenance its ``config.json`` recorded, every method of every job) and renders the page from it;
``--page`` renders pages again from their committed records; ``docs/results.md`` links them.

The runner's own renderings come from here too (the library writes records, not pages): each run's
``summary.md`` (:func:`summary_markdown`) and a roofline run's ``roofline.md`` and figures
(:func:`roofline_markdown`, :func:`roofline_figures`), from its ``roofline.json``.

Reads every ``summary.json`` below the folder (with the ``config.json`` beside it) and writes to
``--out`` (default: the folder itself):

- ``throughput_latency.png``: throughput (tokens/s) against mean end-to-end latency, one point per
  concurrency, one line for autoregressive decoding (per dataset / temperature, averaged over the
  jobs that measured it) and one per speculative method (drafter and k);
- ``acceptance.png``: acceptance per draft position, one line per speculative method (lowest concurrency);
- ``speedup_k.png``: speedup over autoregressive decoding against k: measured end to end, measured
  decode only, and predicted from measured acceptance and costs (hollow markers; the gap is loop
  overhead);
- ``speedup_context.png`` (jobs that differ in prompt length, the ``context_length`` question): decode
  speedup against the prompt's length, one line per method, transformers' ``generate()`` end to end.

Readable by construction: a figure with nothing to show is not written (no acceptance figure for
autoregressive-only jobs); a method keeps its colour in every figure of every report (its drafter
family's hue, a shade per k, a marker per variant: :func:`method_style`), and series that share x
values sit side by side (a small offset), so a line never hides another; legends sit beside the axes.
- ``report.md``: the figures, a table of every method of every run, and each run's own tables
  (:func:`summary_markdown` of its ``summary.json``, what ``run.py`` writes as its ``summary.md``); with
  ``--per-request``, tokens/s of every method and mean accepted length per request too.

Methods from several runs that share a name (a sweep over temperature or dataset) are told apart
by what differs between the runs, e.g. ``spec k=4 (mtbench, T=0.7)``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import textwrap
from collections import defaultdict
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from specdec.eval.config import RunConfig  # noqa: E402
from specdec.eval.runner import k_label, lossy_mark  # noqa: E402
from specdec.provenance import with_kept_notes  # noqa: E402

__all__ = ["FIGURES", "describe", "summary_markdown", "roofline_markdown", "roofline_figures", "load_runs",
           "write_figures", "write_report", "question_record", "question_table", "method_style", "render_page",
           "write_page", "learning_curves_tables", "learning_curves_figure"]


def load_runs(folder: Path) -> list[dict]:
    """One entry per run folder: its config (``config.json``), summary and folder name."""
    runs = []
    for summary in sorted(folder.rglob("summary.json")):
        meta = json.loads((summary.parent / "config.json").read_text())
        runs.append({"dir": summary.parent, "config": meta["config"], "meta": meta,
                     "summary": json.loads(summary.read_text())})
    if not runs:
        raise FileNotFoundError(f"no summary.json below {folder}")
    return runs


def _speculative(run: dict) -> dict[str, dict]:
    """The run's speculative methods (this library's loop with a drafter): method -> summary."""
    return {m: s for m, s in run["summary"].items() if m != "ar" and "prefill_s" in s}


def _family(run: dict, method: str) -> str:
    """A method's name without its k: the drafter for the plain ``spec``, the methods key otherwise."""
    return (run["config"]["drafter"]["name"] or method) if method == "spec" else method.rsplit(" k=", 1)[0]


def _context(runs: list[dict]):
    """A function run -> what sets it apart from the other runs (dataset, temperature), or ""."""
    def key(r: dict) -> tuple[str, float]:
        return r["config"]["dataset"]["name"], r["config"]["sampling"]["temperature"]

    varies = [len({key(r)[i] for r in runs}) > 1 for i in range(2)]

    def context(r: dict) -> str:
        parts = [p for p, v in zip((key(r)[0], f"T={key(r)[1]:g}"), varies) if v]
        return f" ({', '.join(parts)})" if parts else ""
    return context


def _series(runs: list[dict]) -> dict[str, dict[int, dict]]:
    """label -> concurrency -> summary (autoregressive runs of several jobs are averaged)."""
    ar: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    out: dict[tuple[str, int, str], dict[int, dict]] = defaultdict(dict)
    context = _context(runs)
    for r in runs:
        c = r["config"]["concurrency"]
        if "ar" in r["summary"]:
            ar[lossy_mark(r["summary"]["ar"]) + context(r)][c].append(r["summary"]["ar"])
        for m, s in _speculative(r).items():
            out[_family(r, m) + lossy_mark(s), k_label(s), context(r)][c] = s
    series = {f"autoregressive{ctx}": {c: {"tokens_per_s": statistics.fmean(s["tokens_per_s"] for s in ss),
                                           "latency_mean_s": statistics.fmean(s["latency_mean_s"] for s in ss)}
                                       for c, ss in by_c.items()} for ctx, by_c in ar.items()}
    series.update({f"{fam} k={k}{ctx}": by_c for (fam, k, ctx), by_c in sorted(out.items())})
    return series


# Colours are fixed per method, the same in every figure and every report: each drafter family has
# its own hue (a colormap), k its shade (darker for longer drafts), and the variant (the methods key,
# dataset, temperature, lossy mark) its marker. Autoregressive decoding is black.
MARKERS = ("o", "s", "D", "^", "v", "P", "X", "<", ">", "*", "h")
FAMILY_CMAPS = {"ngram": "Blues", "suffix": "Oranges", "draft_model": "Greys", "mtp": "Purples", "gemma_mtp": "RdPu",
                "eagle3": "Greens", "dflash": "Reds", "dflash2": "YlOrBr", "dspark": "PuBu"}
_OTHER_CMAPS = ("BuGn", "YlGn", "OrRd", "GnBu", "PuRd")  # a drafter of one's own: picked by its name


def method_style(drafter: str | None, k: int | None = None, variant: str = "") -> dict:
    """The colour and marker of a method, from what it is alone (never from its place in a figure):
    ``drafter`` picks the hue (:data:`FAMILY_CMAPS`), ``k`` the shade (None: the family's middle
    shade, for a line across k), ``variant`` the marker."""
    import zlib

    if drafter is None:
        return {"color": "black", "marker": MARKERS[zlib.crc32(variant.encode()) % len(MARKERS)]}
    cmap = FAMILY_CMAPS.get(drafter) or _OTHER_CMAPS[zlib.crc32(drafter.encode()) % len(_OTHER_CMAPS)]
    shade = 0.7 if k is None else 0.35 + 0.6 * min(math.log2(max(k, 1)), 4) / 4  # k = 1 lightest, 16+ darkest
    rgba = matplotlib.colormaps[cmap](shade)
    return {"color": matplotlib.colors.to_hex(rgba), "marker": MARKERS[zlib.crc32(variant.encode()) % len(MARKERS)]}


def _series_style(label: str, summary: dict) -> dict:
    """:func:`method_style` of a series of :func:`_series` (its label names the variant and k)."""
    variant = re.sub(r" k=\S+", "", label)
    k = summary.get("k") if isinstance(summary.get("k"), int) else None
    return method_style(summary.get("drafter") or _drafter_of(variant), k, variant)


def _drafter_of(label: str) -> str:
    """A label's drafter where its summary names none: the method's name, without marks or context."""
    return label.split(" (")[0].split(",")[0]


def _offsets(n: int, width: float) -> list[float]:
    """``n`` offsets centred on 0, at most ``width`` apart in all: series that share x values sit
    side by side instead of on top of each other."""
    step = width / max(n - 1, 1)
    return [(i - (n - 1) / 2) * step for i in range(n)]


def _concentric(series: list[list[tuple[float, float]]]) -> list[float]:
    """Marker sizes: a series drawn on exactly the points of earlier ones gets a smaller marker
    than each of them, so coinciding series show as concentric markers, none hidden."""
    key = [tuple((float(f"{x:.4g}"), float(f"{y:.4g}")) for x, y in pts) for pts in series]
    total = {k: key.count(k) for k in key}
    return [6.0 + 3.5 * (total[k] - 1 - key[:i].count(k)) for i, k in enumerate(key)]


def _new_figure(title: str, wide: bool = False):
    fig, ax = plt.subplots(figsize=(8.5 if wide else 6.5, 4.2), dpi=100)
    ax.set_title("\n".join(textwrap.wrap(title, 95 if wide else 75)), fontsize=9)
    return fig, ax


def _finish(fig, ax, legend_size: int = 7):
    """Grid, the legend under the axes (it never covers a line; the figure grows to hold it), tight
    layout: the same last lines of every figure."""
    ax.grid(alpha=0.3)
    entries = len(ax.get_legend_handles_labels()[1])
    ncol = 3 if fig.get_figwidth() > 7 else 2
    fig.set_figheight(4.2 + 0.17 * -(-entries // ncol))
    legend = ax.legend(fontsize=legend_size, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=ncol, frameon=False)
    for handle in legend.legend_handles:  # one marker size in the legend, whatever the plot's
        handle.set_markersize(min(handle.get_markersize(), 7))
    fig.tight_layout()
    return fig


def figure_throughput_latency(runs: list[dict], title: str):
    """Throughput against latency: one autoregressive line per job context (averaged over the jobs
    that share it, not one per drafter) and one line per speculative method."""
    series = _series(runs)
    points = {label: [(by_c[c]["latency_mean_s"], by_c[c]["tokens_per_s"]) for c in sorted(by_c)]
              for label, by_c in series.items()}
    fig, ax = _new_figure(title + " (labels: concurrency)")
    for (label, pts), size in zip(points.items(), _concentric(list(points.values()))):
        cs, (xs, ys) = sorted(series[label]), zip(*pts)
        first = series[label][min(series[label])]
        style = _series_style(label, first) if not label.startswith("autoregressive") else method_style(None, None, label)
        if label.startswith("autoregressive"):  # the baseline: black, dashed, hollow
            style.update(linestyle="--", markerfacecolor="white")
        ax.plot(xs, ys, label=label, markersize=size, **style)
        for c, x, y in zip(cs, xs, ys):
            ax.annotate(str(c), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("mean end-to-end latency per request (s)")
    ax.set_ylabel("throughput (new tokens/s)")
    return _finish(fig, ax)


def figure_acceptance(runs: list[dict], title: str):
    """Acceptance per draft position at the lowest concurrency, one line per speculative method;
    None when no method drafted (autoregressive-only jobs): no empty panel."""
    curves = {label: by_c[min(by_c)] for label, by_c in _series(runs).items()
              if not label.startswith("autoregressive") and by_c[min(by_c)].get("acceptance_at")}
    if not curves:
        return None
    fig, ax = _new_figure(title)
    for (label, s), dx in zip(curves.items(), _offsets(len(curves), 0.3)):
        acc = s["acceptance_at"]
        ax.plot([j + 1 + dx for j in range(len(acc))], acc, linestyle="-", markersize=6, alpha=0.9,
                label=f"{label} (mean accepted length {s['mean_accepted_length']:.2f})", **_series_style(label, s))
    positions = max(len(s["acceptance_at"]) for s in curves.values())
    ax.set_xticks(range(1, positions + 1))
    ax.set_xlabel("draft position (series side by side)")
    ax.set_ylabel("acceptance (given drafted that deep)")
    ax.set_ylim(-0.05, 1.05)  # a line at 0 or 1 stays clear of the frame
    return _finish(fig, ax)


# measured, decode only, predicted: told apart by line and fill; the predicted markers are larger and hollow
MEASURES = {"speedup": ({"linestyle": "-"}, "measured"),
            "decode_speedup": ({"linestyle": ":", "markersize": 4}, "measured, decode only"),
            "predicted_speedup": ({"linestyle": "--", "markerfacecolor": "none", "markersize": 9,
                                   "markeredgewidth": 1.6, "zorder": 3}, "predicted (acceptance, costs)")}


def figure_speedup_k(runs: list[dict], title: str):
    """Speedup over autoregressive decoding against k, per method and concurrency: measured end to
    end, decode only, and predicted; None when no run drafted."""
    groups: dict[tuple[str, int], list[tuple[int, dict]]] = defaultdict(list)
    context = _context(runs)
    for r in runs:
        for m, s in _speculative(r).items():
            policy = f" ({s['policy']})" if s.get("policy") not in (None, "fixed") else ""
            groups[(_family(r, m) + policy + lossy_mark(s) + context(r), r["config"]["concurrency"])].append((s["k"], s))
    if not groups:
        return None
    fig, ax = _new_figure(title, wide=True)
    for ((name, c), pts), dx in zip(sorted(groups.items()), _offsets(len(groups), 0.4)):
        pts.sort(key=lambda p: p[0])
        style = method_style(pts[0][1].get("drafter") or _drafter_of(name), None, f"{name}, concurrency {c}")
        for key, (extra, _) in MEASURES.items():
            have = [(k * 2 ** dx, s[key]) for k, s in pts if s.get(key) is not None]  # offset in log2 units
            if have:
                ax.plot(*zip(*have), label=f"{name}, concurrency {c}" if key == "speedup" else None,
                        gid=key, **{"markersize": 6, **style, **extra})
    for key, (extra, text) in MEASURES.items():  # legend entries for the three measures
        ax.plot([], [], color="black", marker="o", label=text, **{"markersize": 6, **extra})
    ks_all = sorted({k for pts in groups.values() for k, _ in pts})
    ax.axhline(1.0, color="grey", linewidth=0.8, gid="reference")  # break-even
    ax.set_xlabel("k (num_speculative_tokens; series side by side)")
    ax.set_ylabel("speedup over autoregressive")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks_all, [str(k) for k in ks_all])
    ax.minorticks_off()
    return _finish(fig, ax, legend_size=6)


def figure_speedup_context(runs: list[dict], title: str):
    """Speedup over autoregressive decoding against the prompt's length (``dataset.input_len``), one
    line per method (transformers' ``generate()`` included, end to end: it has no decode split);
    None unless the jobs differ in prompt length (the ``context_length`` question)."""
    lengths = {r["config"]["dataset"].get("input_len") for r in runs}
    if len(lengths) < 2 or None in lengths:
        return None
    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    styles: dict[str, dict] = {}
    for r in sorted(runs, key=lambda r: r["config"]["dataset"]["input_len"]):
        n = r["config"]["dataset"]["input_len"]
        for m, s in r["summary"].items():
            key = "decode_speedup" if s.get("decode_speedup") is not None else "speedup"
            if m == "ar" or s.get(key) is None:
                continue
            label = (f"{_family(r, m)}, k {k_label(s)}" if "prefill_s" in s else f"{m}, end to end") + lossy_mark(s)
            lines[label].append((n, s[key]))
            styles[label] = method_style(s.get("drafter"), s.get("k") if isinstance(s.get("k"), int) else None, label)
    fig, ax = _new_figure(title + ": decode speedup against the prompt's length", wide=True)
    for (label, pts), dx in zip(sorted(lines.items()), _offsets(len(lines), 0.3)):
        ax.plot([n * 2 ** dx for n, _ in pts], [y for _, y in pts], label=label, markersize=6, **styles[label])
    ax.axhline(1.0, color="grey", linewidth=0.8, gid="reference")  # autoregressive decoding
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(lengths), [f"{n:,}" for n in sorted(lengths)])
    ax.minorticks_off()
    ax.set_xlabel("prompt tokens (series side by side)")
    ax.set_ylabel("speedup over autoregressive (decode only)")
    return _finish(fig, ax, legend_size=6)


FIGURES = {"throughput_latency.png": figure_throughput_latency, "acceptance.png": figure_acceptance,
           "speedup_k.png": figure_speedup_k, "speedup_context.png": figure_speedup_context}


def write_figures(runs: list[dict], out: Path, title: str) -> list[str]:
    """The figures that have something to show, saved under ``out``; their file names."""
    written = []
    for name, build in FIGURES.items():
        fig = build(runs, title)
        if fig is None:
            continue
        fig.savefig(out / name)
        plt.close(fig)
        written.append(name)
    return written


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def per_request_table(run: dict) -> list[str]:
    """Per request of one run: tokens/s of every method and mean accepted length of the speculative ones."""
    recs = [json.loads(line) for line in (run["dir"] / "requests.jsonl").read_text().splitlines()]
    methods, spec = list(run["summary"]), list(_speculative(run))
    by = {(r["method"], r["request"]): r for r in recs}
    lines = ["| request | id | prompt tokens | " + " | ".join(f"{m} tok/s" for m in methods)
             + "".join(f" | {m} mean acc. len" for m in spec) + " |",
             "|---:|---|---:|" + "---:|" * (len(methods) + len(spec))]
    for i in sorted({r["request"] for r in recs}):
        first = by[methods[0], i]
        rates = [by[m, i]["new_tokens"] / by[m, i]["latency_s"] if by[m, i]["latency_s"] else 0.0 for m in methods]
        lines.append(f"| {i} | {first['id']} | {first['prompt_tokens']} | " + " | ".join(f"{x:.1f}" for x in rates)
                     + "".join(f" | {by[m, i]['mean_accepted_length']:.2f}" for m in spec) + " |")
    return lines


def run_ks(config: Any) -> str:
    """The k values a run's methods draft at ("1..6", "1, 2, 4, 8"), from its ``RunConfig`` or
    ``config.json``'s ``config``: with ``methods``, each method's own (its ``k`` list, else the run's),
    not the top-level ``num_speculative_tokens`` they override."""
    c = asdict(config) if is_dataclass(config) else config
    ks = sorted({k for m in (c.get("methods") or {}).values() for k in (m.get("k") or [c["num_speculative_tokens"]])})
    ks = ks or [c["num_speculative_tokens"]]
    if len(ks) > 2 and ks == list(range(ks[0], ks[-1] + 1)):
        return f"{ks[0]}..{ks[-1]}"
    return ", ".join(map(str, ks))


def describe(config: Any) -> str:
    """One line naming what a run measured, from its ``RunConfig`` or ``config.json``'s ``config``."""
    c = asdict(config) if is_dataclass(config) else config
    d, t, dr = c["dataset"], c["target"], c["drafter"]
    opts = f" {dr['options']}" if dr.get("options") else ""
    methods = f", methods {', '.join(f'`{m}`' for m in c['methods'])}" if c.get("methods") else ""
    policy = f" ({c['policy']} policy)" if c.get("policy", "fixed") != "fixed" else ""
    repeats = f" x {d['repeats']}" if d.get("repeats", 1) > 1 else ""
    return (f"target `{t['model']}` ({t['dtype']}), drafter `{dr['name'] or 'none'}`{opts}{methods},"
            f" verifier `{c['verifier']['name']}`, k = {run_ks(c)}{policy}, concurrency = {c['concurrency']},"
            f" dataset `{d['name']}` ({d['num_prompts']} prompts{repeats}), temperature {c['sampling']['temperature']},"
            f" seed {c['seed']}")


def summary_markdown(summary: dict[str, dict], config: Any = None) -> str:
    """One run's summary (``summary.json``) as markdown tables: throughput, latency and speedups;
    drafting (acceptance per position, drafts per step, draft cost); the loop's time split; outputs
    that differ. ``config`` (its ``RunConfig`` or ``config.json``'s ``config``) heads it with :func:`describe`."""
    lines = [describe(config), ""] if config is not None else []
    hf = any("identical_to_hf_generate" in s for s in summary.values())
    lines += ["| method | drafter | k | requests | new tokens | wall s | tok/s | TTFT ms | TPOT ms | latency mean s"
              " | latency p90 s | speedup | decode speedup | predicted | mean acc. len | identical to baseline |"
              + (" speedup vs hf_generate | identical to hf_generate |" if hf else ""),
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
              + ("---:|---:|" if hf else "")]

    def f(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for name, s in summary.items():
        ident = f"{s['identical_to_baseline']}/{s['requests']} ({s['baseline']})" if "baseline" in s else "-"
        lines.append(
            f"| {name}{lossy_mark(s)} | {s['drafter'] or '-'} | {k_label(s)} | {s['requests']} | {s['new_tokens']}"
            f" | {s['wall_s']:.2f} | {s['tokens_per_s']:.1f} | {s['ttft_mean_s'] * 1e3:.1f}"
            f" | {s['tpot_mean_s'] * 1e3:.1f} | {s['latency_mean_s']:.2f} | {s['latency_p90_s']:.2f}"
            f" | {f(s.get('speedup'), '.2f')} | {f(s.get('decode_speedup'), '.2f')}"
            f" | {f(s.get('predicted_speedup'), '.2f')} | {f(s.get('mean_accepted_length'), '.2f')} | {ident} |"
            + (f" {s['speedup_vs_hf_generate']:.2f} | {s['identical_to_hf_generate']}/{s['requests']} |" if hf else ""))
    grouped = {n: s for n, s in summary.items() if "by_group" in s and "baseline" in s}
    if grouped:
        groups = list(next(iter(grouped.values()))["by_group"])
        lines += ["", "Per group (category; \"pass 2\": the same prompts asked again): mean accepted length,"
                  " and latency speedup over the baseline (summed latencies):", "",
                  "| group | " + " | ".join(f"{n} acc. len | {n} speedup" for n in grouped) + " |",
                  "|---|" + "---:|---:|" * len(grouped)]
        for g in groups:
            cells = [(s["by_group"].get(g, {}).get("mean_accepted_length"), s["by_group"].get(g, {}).get("latency_speedup"))
                     for s in grouped.values()]
            lines.append(f"| {g} | " + " | ".join(f"{f(a, '.2f')} | {f(x, '.2f')}" for a, x in cells) + " |")
    loop = {n: s for n, s in summary.items() if "prefill_s" in s}
    drafting = {n: s for n, s in loop.items() if s.get("acceptance_at")}
    if drafting:
        lines += ["", "Drafting (acceptance at a position: given the row drafted that deep):", "",
                  "| method | mean acc. len | acceptance per position | acceptance rate | drafted / step"
                  " | draft ms / step | draft cost / token (x target step) |",
                  "|---|---:|---|---:|---:|---:|---:|"]
        for name, s in drafting.items():
            lines.append(f"| {name} | {s['mean_accepted_length']:.2f} | "
                         + " ".join(f"{a:.2f}" for a in s["acceptance_at"])
                         + f" | {s['acceptance_rate']:.2f} | {s['drafted_per_step']:.1f}"
                         f" | {s['draft_s_per_step'] * 1e3:.2f} | {f(s.get('draft_cost_vs_target_step'), '.3f')} |")
    if loop:
        lines += ["", "Time split of this library's loop (share of wall time):", "",
                  "| method | prefill | draft | target | verify | loop overhead | draft ms/step | verify ms/step |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name, s in loop.items():
            w = s["wall_s"] or 1.0
            lines.append(f"| {name} | {s['prefill_s'] / w:.1%} | {s['draft_s'] / w:.1%} | {s['target_s'] / w:.1%}"
                         f" | {s['verify_s'] / w:.1%} | {s['other_s'] / w:.1%} | {s['draft_s_per_step'] * 1e3:.2f}"
                         f" | {s['verify_s_per_step'] * 1e3:.2f} |")
    differ = [(n, s["baseline"], d) for n, s in summary.items() for d in s.get("divergences", [])]
    if differ:
        lines += ["", "Outputs that differ from the baseline (first differing position; the target's top-2 logits"
                  " there, after the baseline's tokens: a tiny gap is a numerical near-tie):", ""]
        for name, base, d in differ:
            head = f"- {name}, request {d['request']}, position {d['position']}"
            if "top2_logits" not in d:
                lines.append(f"{head}: one output is a prefix of the other ({base})")
                continue
            hi, lo = d["top2_logits"]
            lines.append(f"{head}: got {d['got']}, {base} {d['want']}; top-2 {d['top2_ids']}"
                         f" logits {hi:.5f} / {lo:.5f} (gap {hi - lo:.2e})")
    return "\n".join(lines) + "\n"


def write_report(folder: Path, out: Path | None = None, title: str | None = None, per_request: bool = False) -> Path:
    runs = load_runs(folder)
    out = out or folder
    out.mkdir(parents=True, exist_ok=True)
    c0 = runs[0]["config"]
    title = title or (f"{c0['target']['model']}, {c0['dataset']['name']} ({c0['dataset']['num_prompts']} prompts),"
                      f" temperature {c0['sampling']['temperature']}")
    figures = write_figures(runs, out, title)

    lines = [f"# Sweep report: {title}", "", f"Source: `{folder}` ({len(runs)} runs, numbered as its job folders;"
             f" git {runs[0]['meta'].get('git_sha') or '?'}, torch {runs[0]['meta'].get('torch')},"
             f" {runs[0]['meta'].get('torch_threads')} thread(s)).", ""]
    lines += [f"![{n}]({n})" for n in figures] + [""]
    lines += ["| run | dataset | T | drafter | k | concurrency | method | tok/s | latency mean s | TTFT ms | TPOT ms"
              " | speedup | decode speedup | predicted | mean acc. len | loop overhead |",
              "|---|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    runs.sort(key=lambda r: (r["config"]["drafter"]["name"] or "", r["config"]["num_speculative_tokens"],
                             r["config"]["concurrency"], r["dir"].name))
    for r in runs:
        cfg = r["config"]
        for method, s in r["summary"].items():
            lines.append(
                f"| {r['dir'].name.split('_')[0]} | {cfg['dataset']['name']} | {cfg['sampling']['temperature']:g}"
                f" | {s.get('drafter', cfg['drafter']['name']) or '-'} | {k_label(s)} | {s['concurrency']}"
                f" | {method}{lossy_mark(s)} | {s['tokens_per_s']:.1f} | {s['latency_mean_s']:.2f} | {s['ttft_mean_s'] * 1e3:.0f}"
                f" | {s['tpot_mean_s'] * 1e3:.1f} | {_fmt(s.get('speedup'), '.2f')}"
                f" | {_fmt(s.get('decode_speedup'), '.2f')} | {_fmt(s.get('predicted_speedup'), '.2f')}"
                f" | {_fmt(s.get('mean_accepted_length'), '.2f')} | {_fmt(s.get('overhead_frac'), '.1%')} |")
    for r in runs:  # each run's own tables, rendered from its summary
        lines += ["", f"## Run `{r['dir'].name}`", "", summary_markdown(r["summary"], r["config"]).rstrip()]
        if per_request:
            lines += ["", "Per request:", "", *per_request_table(r)]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out / "report.md"


# ------------------------------------------------------------------------------------------------
# the roofline (mode: roofline): its tables and figures, from the run's roofline.json
#
# - ``roofline_time.png``: ms of one forward against m, one panel per (dtype, threads, batch): each
#   impl's chain (solid) and tree (dashed), the roofline and the bandwidth limit alone;
# - ``roofline_ratio.png``: t(m)/t(1) on the same panels, with the roofline's ratio;
# - ``context.png``: against context length, step time, peak memory and speculative speedups (the
#   panels that have data).

def _cell(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _ms(seconds: float | None, fmt: str = ".1f") -> str:
    return _cell(None if seconds is None else seconds * 1e3, fmt)


def _plan_text(plan: list[tuple[int, str]]) -> str:
    """``[(4, packed), ..., (31, packed)]`` as "packed at 4–31 rows; F.linear elsewhere"."""
    runs: list[list] = []
    for rows, how in sorted(plan):
        if runs and runs[-1][0] == how and runs[-1][2] == rows - 1:
            runs[-1][2] = rows
        else:
            runs.append([how, rows, rows])
    parts = [f"{how} at {lo}" + (f"–{hi}" if hi > lo else "") + " rows" for how, lo, hi in runs]
    return "; ".join(parts + ["F.linear elsewhere"]) if parts else "F.linear at every row count"


def roofline_markdown(result: dict[str, Any], cfg: RunConfig) -> str:
    """A roofline run (``mode: roofline``: its ``roofline.json`` and ``RunConfig``) as markdown: the machine's limits, t(m)/t(1) per setting, the context sweep, speedups."""
    rc, mc = cfg.roofline, result["machine"]
    lines = [f"target `{cfg.target.model}`, context {rc.context}, best of {rc.reps};"
             f" {mc['cpu'] or mc['device']} ({', '.join(mc.get('cpu_isa') or []) or 'no AVX2'}), {mc['cpu_count']} cores,"
             f" last-level cache {mc['llc_mib']} MiB", "",
             "| threads | STREAM copy GB/s | STREAM triad GB/s | array MiB |", "|---:|---:|---:|---:|"]
    lines += [f"| {b['threads']} | {b['copy_gb_s']:.1f} | {b['triad_gb_s']:.1f} | {b['array_mib']} |"
              for b in result["bandwidth"]]
    lines += ["", "| threads | dtype | F.linear GFLOP/s (n) |", "|---:|---|---:|"]
    lines += [f"| {p['threads']} | {p['dtype']} | {p['gflop_s']:.1f} ({p['n']}) |" for p in result["compute"]]
    ms = sorted({r["m"] for r in result["forward"]})
    lines += ["", "One forward over m new tokens: t(1) of the chain, the share of the bandwidth limit it reaches,"
              " and t(m)/t(1) (`roofline` rows: the same ratio of the roofline times).", "",
              "| impl | dtype | threads | batch | mask | t(1) ms | % of BW limit at m=1 | "
              + " | ".join(f"m={m}" for m in ms) + " |", "|---|---|---:|---:|---|---:|---:|" + "---:|" * len(ms)]
    summary = result["summary"]
    for i, s in enumerate(summary):
        setting = (s["dtype"], s["threads"], s["batch"], s["mask"])
        rows = [(s["impl"], s["ratio"], _ms(s["t1_s"]), _cell(s["pct_of_bandwidth_limit_m1"], ".1f"))]
        if i + 1 == len(summary) or setting != tuple(summary[i + 1][k] for k in ("dtype", "threads", "batch", "mask")):
            rows.append(("roofline", s["roofline_ratio"], "-", "-"))  # after the setting's last impl
        for name, ratio, t1, pct in rows:
            lines.append(f"| {name} | {s['dtype']} | {s['threads']} | {s['batch']} | {s['mask']} | {t1} | {pct} | "
                         + " | ".join(_cell(ratio.get(m), ".2f") for m in ms) + " |")
    if result["skipped"]:
        lines += ["", f"Skipped: {len(result['skipped'])} points ({result['skipped'][0]['why']})."]
    for f in result.get("few_rows", []):
        for p in f["plans"]:
            lines += ["", f"Few-row products of the library's {f['dtype']} linear layers, {p['threads']} thread(s)"
                      f" (specdec.few_rows; packed copies hold {f['packed_mib']:.0f} MiB): {_plan_text(p['plan'])}."]
    if result["context"]:
        kind = result["context"][0]["memory"] or "not measured"
        lines += ["", f"Against context (batch 1, {rc.threads[0]} thread(s), {cfg.target.dtype}); peak memory above"
                  f" the memory in use before the prefill, {kind}; the decode peak holds the KV cache."
                  " Tensor MiB: the tensors' own peak (allocations counted by the profiler, the same on every"
                  " run); held: what the prefill leaves allocated.", "",
                  "| context | impl | m | step ms | BW limit ms | % of BW limit | prefill s | prefill peak MiB"
                  " | decode peak MiB | prefill tensor MiB | held tensor MiB | decode tensor MiB | KV MiB |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result["context"]:
            lines.append(f"| {r['context']} | {r['impl']} | {r['m']} | {r['time_s'] * 1e3:.1f}"
                         f" | {_ms(r.get('bandwidth_limit_s'))} | {_cell(r.get('pct_of_bandwidth_limit'), '.1f')}"
                         f" | {r['prefill_s']:.2f} | {_cell(r['prefill_peak_mib'], '.0f')}"
                         f" | {_cell(r['decode_peak_mib'], '.0f')} | {_cell(r.get('prefill_tensor_mib'), '.0f')}"
                         f" | {_cell(r.get('held_tensor_mib'), '.0f')} | {_cell(r.get('decode_tensor_mib'), '.0f')}"
                         f" | {r['kv_mib']:.0f} |")
    if result["speedup"]:
        lines += ["", f"Speculative decoding against context (dataset `{cfg.dataset.name}`, {cfg.dataset.output_len}"
                  " new tokens; speedups over `ar` of the same context):", "",
                  "| context | method | k | prompt tokens | mean acc. len | speedup | decode speedup | decode ms/token"
                  " | verify ms/step | draft ms/step | identical to ar |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result["speedup"]:
            same = "-" if r["identical_to_baseline"] is None else f"{r['identical_to_baseline']}/{r['requests']}"
            lines.append(f"| {r['context']} | {r['method']} | {r['k'] or '-'} | {r['prompt_tokens']:.0f}"
                         f" | {_cell(r['mean_accepted_length'], '.2f')} | {_cell(r['speedup'], '.2f')}"
                         f" | {_cell(r['decode_speedup'], '.2f')} | {_ms(r['decode_s_per_token'])}"
                         f" | {_ms(r['verify_s_per_step'])} | {_ms(r['draft_s_per_step'], '.2f')} | {same} |")
    lines += ["", "Figures: `roofline_time.png`, `roofline_ratio.png`, `context.png`."]
    return "\n".join(lines) + "\n"


ROOFLINE_COLORS = {"library": "tab:blue", "library_general": "tab:green", "library_unpacked": "tab:purple",
          "library_gqa": "tab:brown", "transformers": "tab:orange"}
ROOFLINE_STYLES = {"chain": "-", "tree": "--"}


def _panels(keys: list, ncols: int, title: str):
    """A figure with one axis per key (ncols a row), the unused grid cells removed."""
    ncols = max(1, min(ncols, len(keys)))
    nrows = -(-len(keys) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(keys):]:
        fig.delaxes(ax)
    fig.suptitle(title)
    return fig, dict(zip(keys, flat))


def _save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _forward_figure(result: dict[str, Any], path: Path, ratio: bool) -> None:
    rows = result["forward"]
    if not rows:
        return
    cols = list(dict.fromkeys((r["dtype"], r["threads"]) for r in rows))  # the run's order
    keys = [(d, t, b) for b in dict.fromkeys(r["batch"] for r in rows) for d, t in cols
            if any((r["dtype"], r["threads"], r["batch"]) == (d, t, b) for r in rows)]
    what = "t(m) / t(1)" if ratio else "ms per forward"
    fig, axes = _panels(keys, len(cols), f"One target forward over m new tokens: {what}")
    for (dtype, threads, batch), ax in axes.items():
        panel = [r for r in rows if (r["dtype"], r["threads"], r["batch"]) == (dtype, threads, batch)]
        for impl in sorted({r["impl"] for r in panel}):
            for mask in ("chain", "tree"):
                pts = sorted((r["m"], r["ratio"] if ratio else r["time_s"] * 1e3) for r in panel
                             if r["impl"] == impl and r["mask"] == mask)
                if pts:
                    ax.plot(*zip(*pts), ROOFLINE_STYLES[mask], marker="o", ms=3, color=ROOFLINE_COLORS.get(impl),
                            label=f"{impl} {mask}")
        ref = {r["m"]: r for r in panel if r["mask"] == "chain"}  # the cost model is the same for every impl
        ms = sorted(ref)
        if ratio:
            ax.plot(ms, [ref[m]["roofline_ratio"] for m in ms], ":", color="black", label="roofline")
            ax.axhline(1.0, color="grey", lw=0.6)
            ax.set_ylabel("t(m) / t(1)")
        else:
            ax.plot(ms, [ref[m]["roofline_s"] * 1e3 for m in ms], ":", color="black", label="roofline")
            ax.plot(ms, [ref[m]["bandwidth_limit_s"] * 1e3 for m in ms], ":", color="grey", label="bandwidth limit")
            ax.set_yscale("log")
            ax.set_ylabel("ms per forward")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["m"] for r in panel}), [str(m) for m in sorted({r["m"] for r in panel})])
        ax.set_xlabel("m (new tokens per forward)")
        ax.set_title(f"{dtype}, {threads} thread(s), batch {batch}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    _save_figure(fig, path)


def _context_figure(result: dict[str, Any], path: Path) -> None:
    ctx, spd = result["context"], [r for r in result["speedup"] if r["method"] != "ar" and r["speedup"] is not None]
    keys = (["time"] if ctx else []) + (["memory"] if any(r["decode_peak_mib"] is not None for r in ctx) else []) \
        + (["speedup"] if spd else [])
    if not keys:
        return
    fig, axes = _panels(keys, len(keys), "Against context length (batch 1)")
    if "time" in axes:
        ax = axes["time"]
        for impl in sorted({r["impl"] for r in ctx}):
            for m in sorted({r["m"] for r in ctx}):
                pts = sorted((r["context"], r["time_s"] * 1e3) for r in ctx if (r["impl"], r["m"]) == (impl, m))
                ax.plot(*zip(*pts), marker="o", ms=3, color=ROOFLINE_COLORS.get(impl), ls="-" if m == 1 else "--",
                        label=f"{impl} m={m}")
        for m in sorted({r["m"] for r in ctx if "roofline_s" in r}):
            pts = sorted({(r["context"], r["roofline_s"] * 1e3) for r in ctx if r["m"] == m and "roofline_s" in r})
            ax.plot(*zip(*pts), ":" if m == 1 else "-.", marker="x", ms=3, color="black", label=f"roofline m={m}")
        ax.set_ylabel("ms per forward")
        ax.set_title("step time", fontsize=9)
    if "memory" in axes:
        ax = axes["memory"]
        first = {(r["impl"], r["context"]): r for r in ctx}  # memory is per (impl, context)
        for impl in sorted({i for i, _ in first}):
            pts = sorted((c, r) for (i, c), r in first.items() if i == impl)
            ax.plot([c for c, _ in pts], [r["prefill_peak_mib"] for _, r in pts], "--", marker="s", ms=3,
                    color=ROOFLINE_COLORS.get(impl), label=f"{impl} prefill peak")
            ax.plot([c for c, _ in pts], [r["decode_peak_mib"] for _, r in pts], "-", marker="o", ms=3,
                    color=ROOFLINE_COLORS.get(impl), label=f"{impl} decode peak")
            m1 = min(r["m"] for r in ctx)
            tensors = sorted((r["context"], r["decode_tensor_mib"]) for r in ctx
                             if r["impl"] == impl and r["m"] == m1 and r.get("decode_tensor_mib") is not None)
            if tensors:  # the tensors' own count (CPU): what the resident set cannot settle
                ax.plot(*zip(*tensors), ":", marker="^", ms=3, color=ROOFLINE_COLORS.get(impl),
                        label=f"{impl} decode tensors (m={m1})")
        kv = sorted({(c, r["kv_mib"]) for (_, c), r in first.items()})
        ax.plot(*zip(*kv), ":", marker="x", ms=3, color="black", label="KV cache (model)")
        ax.set_ylabel("peak MiB above the memory before prefill")
        ax.set_title(f"peak memory ({ctx[0]['memory']})", fontsize=9)
    if "speedup" in axes:
        ax = axes["speedup"]
        for method in dict.fromkeys(r["method"] for r in spd):
            pts = sorted((r["context"], r["decode_speedup"] or r["speedup"], r["mean_accepted_length"])
                         for r in spd if r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=method)
            for c, s, tau in pts:
                if tau is not None:
                    ax.annotate(f"τ={tau:.2f}", (c, s), fontsize=6, textcoords="offset points", xytext=(2, 3))
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.set_ylabel("decode speedup over autoregressive")
        ax.set_title("speculative decoding (τ: mean accepted length)", fontsize=9)
    for key, ax in axes.items():
        xs = sorted({r["context"] for r in (spd if key == "speedup" else ctx)})
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("context (prompt tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    _save_figure(fig, path)


def roofline_figures(result: dict[str, Any], out: Path) -> list[Path]:
    """Write the figures that have data to ``out``; returns their paths."""
    paths = [(out / "roofline_time.png", lambda p: _forward_figure(result, p, ratio=False)),
             (out / "roofline_ratio.png", lambda p: _forward_figure(result, p, ratio=True)),
             (out / "context.png", lambda p: _context_figure(result, p))]
    for path, draw in paths:
        draw(path)
    return [p for p, _ in paths if p.exists()]


CONF = Path(__file__).resolve().parent / "conf"


def _question(command: str) -> tuple[str, str]:
    """The preset a command ran (``--config-name``) and the question its YAML's first comment asks."""
    m = re.search(r"--config-name[ =](\S+)", command)
    name = m.group(1) if m else "config"
    path = CONF / f"{name}.yaml"
    head = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        if not line.startswith("#") or line.startswith("#   "):
            break
        head.append(line.lstrip("# ").rstrip())
    return name, " ".join(head)


def _same(x: dict) -> str:
    """Requests whose output equals the autoregressive baseline's, of all (- for the baseline)."""
    same = x.get("identical_to_baseline")
    return "-" if same is None else f"{same}/{x.get('requests', '?')}"


def _job(dirname: str) -> str:
    """A sweep job by what it set (``3_dataset.input_len=7500,progress=False`` → ``3: dataset.input_len=7500``)."""
    index, _, overrides = dirname.partition("_")
    kept = [o for o in overrides.split(",") if o and not o.startswith("progress=")]
    return f"{index}: {', '.join(kept)}" if kept else index


def question_record(folder: Path) -> dict[str, Any]:
    """A question's record, from its run (a multirun folder or one run folder): what the preset asks,
    the command, git SHA, machine (CPU model, threads, dtype) and date that ``config.json`` recorded,
    then one row per method of every job. Nothing is typed by hand."""
    runs = load_runs(folder)
    meta = runs[0]["meta"]
    if "command" not in meta or "machine" not in meta:
        raise ValueError(f"{folder} was run before runs recorded their command and machine: run it again")
    name, asks = _question(meta["command"])
    mach = meta["machine"]
    shas = sorted({r["meta"].get("git_sha") or "?" for r in runs})
    dates = sorted({r["meta"].get("date", "?") for r in runs})
    where = f"{mach['cpu']}" + (f", {mach['gpu']}" if mach.get("gpu") else "")
    rows = []
    for r in sorted(runs, key=lambda r: r["dir"].name):
        cfg = r["config"]
        for method, x in r["summary"].items():
            rows.append([_job(r["dir"].name), cfg["dataset"]["name"], f"{cfg['sampling']['temperature']:g}",
                         str(x["concurrency"]), f"{method}{lossy_mark(x)}", k_label(x), f"{x['tokens_per_s']:.1f}",
                         _fmt(x.get("speedup"), ".2f"), _fmt(x.get("decode_speedup"), ".2f"),
                         _fmt(x.get("mean_accepted_length"), ".2f"), _same(x)])
    return {"title": f"`{name}`", "question": asks,
            "provenance": {"command": meta["command"],
                           "git": f"{', '.join(s[:10] for s in shas)}; torch {meta.get('torch')}, "
                                  f"transformers {meta.get('transformers')}",
                           "machine": f"{where}, {mach['threads']} thread(s), {mach['dtype']}",
                           "date": dates[0] + (f" to {dates[-1]}" if len(dates) > 1 else "")},
            "source": f"made by `python experiments/report.py {folder} --table docs/results/{name}.md` from the "
                      "run's config.json and summary.json files (run outputs are not committed)",
            "tables": [{"columns": ["job", "dataset", "T", "concurrency", "method", "k", "tok/s", "speedup",
                                    "decode speedup", "mean acc. len", "identical to AR"],
                        "align": "lllrlrrrrrr", "rows": rows}]}


def question_table(folder: Path) -> str:
    """A question's current table: :func:`render_page` of its :func:`question_record`."""
    record = question_record(folder)
    return render_page(record, record["title"].strip("`"))


# ------------------------------------------------------------------------------------------------
# Results pages: docs/results/<name>.md rendered from its record docs/results/<name>.json

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
HEADER = ("command", "git", "machine", "date")  # every record's provenance, as each page's header lists it


def markdown_table(columns: list[str], align: str, rows: list[list[str]]) -> list[str]:
    """A markdown table; ``align``: one letter per column, ``l`` or ``r``."""
    if len(align) != len(columns) or any(len(r) != len(columns) for r in rows):
        raise ValueError(f"a table of {len(columns)} columns needs as many alignments and cells per row")
    return ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def render_page(record: dict[str, Any], name: str) -> str:
    """A results page's rendered part from its record: the title, the question, the header (command,
    git, machine, date, where the record came from and the command that renders the page), the
    figures and every table (a learning-curves record's tables derived from its curves). The page's
    notes follow it, kept when it is rendered again (:func:`specdec.provenance.with_kept_notes`)."""
    missing = [k for k in HEADER if not record.get("provenance", {}).get(k)]
    if missing or not record.get("title"):
        raise ValueError(f"the record of {name} lacks its title or provenance {missing}")
    p = record["provenance"]
    lines = [f"# {record['title']}", ""]
    if record.get("question"):
        lines += [record["question"], ""]
    lines += [f"- command: `{p['command']}`", f"- git: {p['git']}", f"- machine: {p['machine']}", f"- date: {p['date']}",
              *([f"- settings: {p['settings']}"] if p.get("settings") else []),
              *([f"- earlier curves: {p['earlier']}"] if p.get("earlier") else []),
              f"- record: [`{name}.json`]({name}.json)" + (f", {record['source']}" if record.get("source") else ""),
              f"- rendered by: `python experiments/report.py --page docs/results/{name}.md`", ""]
    tables = list(record.get("tables", []))
    if "curves" in record:
        lines += ["![learning curves](learning_curves.png)", ""]
        tables += learning_curves_tables(record["curves"])
    for t in tables:
        lines += [t["heading"], ""] if t.get("heading") else []
        lines += [t["caption"], ""] if t.get("caption") else []
        lines += [*markdown_table(t["columns"], t["align"], t["rows"]), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def write_page(page: Path) -> list[Path]:
    """Render ``page`` (and a learning-curves record's figure) from the record beside it, its notes kept."""
    record = json.loads(page.with_suffix(".json").read_text())
    page.write_text(with_kept_notes(page, render_page(record, page.stem)))
    written = [page]
    if "curves" in record:
        written.append(learning_curves_figure(record["curves"], page.with_suffix(".png")))
    return written


# the learning curves (experiments/benchmarks/learning_curves.py collects them into the record)
CURVE_FAMILIES = ("eagle3", "dflash", "dspark", "gemma_mtp", "mtp")
AIM_MAL = 2.5  # the aimed mean accepted length at the best k (the page estimates the tokens to reach it)
BEYOND = 1e15  # tokens past which an extrapolation names no data set that exists (the papers train on 1e7-1e8)


def tokens_to_reach(points: list[tuple[int, float]], aim: float) -> tuple[float, float | None]:
    """(slope per decade, tokens) of a least-squares line of mean accepted length against log10
    tokens seen, extrapolated to ``aim``: how far a curve's own trend would have to run. ``None``
    when the trend does not rise (or fewer than two points): no number of tokens reaches it."""
    if len(points) < 2:
        return 0.0, None
    xs, ys = [math.log10(t) for t, _ in points], [m for _, m in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    if slope <= 0:
        return slope, None
    decades = mx + (aim - my) / slope
    return slope, 10 ** decades if decades < 300 else math.inf  # a near-flat rise: past any float


def _tokens(need: float | None) -> str:
    if need is None:
        return "never on this trend"
    return f"> {BEYOND:.0e}" if need > BEYOND else f"{need:.1e}"


def learning_curves_tables(data: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The curves' two tables: every decoded point, and each curve's trend to :data:`AIM_MAL`."""
    rows = []
    for f, pts in data.items():
        for p in pts:
            d = p["decoded"]
            if d is None:
                continue
            cells = [[f"{d[n]['mean_accepted_length']:.2f}", " ".join(f"{x:.2f}" for x in d[n]["acceptance_at"])]
                     for n in ("mtbench", "humaneval")]
            rows.append([f, f"{p['tokens']:,}", str(p["steps"]), f"{p['wall_seconds']:.0f}", *cells[0], *cells[1]])
    trend = []
    for f, pts in data.items():
        done = [p for p in pts if p["decoded"]]
        cells = []
        for n in ("mtbench", "humaneval"):
            slope, need = tokens_to_reach([(p["tokens"], p["decoded"][n]["mean_accepted_length"]) for p in done], AIM_MAL)
            cells += [f"{slope:+.3f}", _tokens(need)]
        trend.append([f, str(len(done)), *cells])
    return [{"columns": ["drafter", "tokens seen", "steps", "wall s", "MT-bench MAL", "MT-bench acceptance 1..k",
                         "HumanEval MAL", "HumanEval acceptance 1..k"], "align": "lrrrrlrl", "rows": rows},
            {"caption": f"**Tokens to the aim, by each curve's own trend** (a least-squares line of MAL against log10 "
                        f"tokens seen over the curve's points, extrapolated to MAL {AIM_MAL}; a trend, not a promise):",
             "columns": ["drafter", "points", "MT-bench MAL gain per 10x tokens", f"MT-bench tokens to MAL {AIM_MAL}",
                         "HumanEval MAL gain per 10x tokens", f"HumanEval tokens to MAL {AIM_MAL}"],
             "align": "lrrrrr", "rows": trend}]


def learning_curves_figure(data: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    """Mean accepted length against tokens seen, held-out MT-bench and HumanEval side by side; a
    lever (``family@variant``) dashed in its family's colour."""
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, name in zip(axes, ("mtbench", "humaneval")):
        for f, pts in data.items():
            xs = [p["tokens"] for p in pts if p["decoded"]]
            ys = [p["decoded"][name]["mean_accepted_length"] for p in pts if p["decoded"]]
            family = f.split("@", 1)[0]
            lever = sum(1 for g in list(data)[:list(data).index(f)] if g.split("@", 1)[0] == family)  # 0: the plain curve
            ax.plot(xs, ys, marker="os^vD"[lever % 5], label=f, ls="--" if lever else "-",
                    color=f"C{CURVE_FAMILIES.index(family) if family in CURVE_FAMILIES else len(CURVE_FAMILIES)}")
        ax.set(xscale="log", xlabel="training tokens seen", ylabel="mean accepted length (greedy, chain k=4)",
               title=f"held-out {'MT-bench' if name == 'mtbench' else 'HumanEval'}")
        ticks = sorted({p["tokens"] for pts in data.values() for p in pts if p["decoded"]})
        ax.set_xticks(ticks, [f"{t / 1e3:.0f}k" if t < 1e6 else f"{t / 1e6:.1f}M" for t in ticks])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, nargs="?", help="a multirun folder (or one run folder)")
    ap.add_argument("--out", type=Path, default=None, help="where figures and report.md go (default: folder)")
    ap.add_argument("--title", default=None)
    ap.add_argument("--per-request", action="store_true", help="also tokens/s and acceptance per request")
    ap.add_argument("--table", type=Path, default=None,
                    help="write the question's record (docs/results/<question>.json) from the folder's run and "
                         "render its page (<question>.md) from it instead of a report; the page's notes are kept")
    ap.add_argument("--page", type=Path, nargs="+", default=None,
                    help="render these results pages (docs/results/<name>.md) from their committed records")
    args = ap.parse_args()
    if args.page is not None:
        for page in args.page:
            print(*write_page(page))
        return
    if args.folder is None:
        ap.error("a run or multirun folder, or --page")
    if args.table is not None:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.with_suffix(".json").write_text(json.dumps(question_record(args.folder), indent=1) + "\n")
        print(*write_page(args.table))
        return
    print(write_report(args.folder, args.out, args.title, args.per_request))


if __name__ == "__main__":
    main()

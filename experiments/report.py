"""Figures and a markdown report for a sweep (a Hydra multirun folder) or a single run folder.

    .venv/bin/python experiments/report.py multirun/<date>/<time> [--out DIR] [--title TEXT]

Reads every ``summary.json`` below the folder (with the ``config.json`` beside it) and writes to
``--out`` (default: the folder itself):

- ``throughput_latency.png``: throughput (tokens/s) against mean end-to-end latency, one point per
  concurrency, one line for autoregressive decoding and one per drafter and k;
- ``acceptance.png``: acceptance per draft position, one line per drafter and k (lowest concurrency);
- ``speedup_k.png``: speedup over autoregressive decoding against k: measured end to end, measured
  decode only, and predicted from measured acceptance and costs (the gap is loop overhead);
- ``report.md``: the figures and a table of every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["load_runs", "write_report"]


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


def _label(run: dict) -> str:
    d = run["config"]["drafter"]
    return f"{d['name']} k={run['config']['num_speculative_tokens']}"


def _series(runs: list[dict]) -> dict[str, dict[int, dict]]:
    """label -> concurrency -> summary (autoregressive runs of several jobs are averaged)."""
    ar: dict[int, list[dict]] = defaultdict(list)
    out: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in runs:
        c = r["config"]["concurrency"]
        if "ar" in r["summary"]:
            ar[c].append(r["summary"]["ar"])
        if "spec" in r["summary"]:
            out[_label(r)][c] = r["summary"]["spec"]
    series = {"autoregressive": {c: {"tokens_per_s": statistics.fmean(s["tokens_per_s"] for s in ss),
                                     "latency_mean_s": statistics.fmean(s["latency_mean_s"] for s in ss)}
                                 for c, ss in ar.items()}} if ar else {}
    series.update(sorted(out.items(), key=lambda kv: (kv[0].split(" k=")[0], int(kv[0].split("k=")[1]))))
    return series


def _finish(fig, ax, path: Path, legend_size: int = 7) -> None:
    """Grid, legend, tight layout, save, close: the same last lines for every figure."""
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_throughput_latency(runs: list[dict], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=100)
    for label, by_c in _series(runs).items():
        cs = sorted(by_c)
        xs, ys = [by_c[c]["latency_mean_s"] for c in cs], [by_c[c]["tokens_per_s"] for c in cs]
        ax.plot(xs, ys, marker="o", linestyle="--" if label == "autoregressive" else "-", label=label)
        for c, x, y in zip(cs, xs, ys):
            ax.annotate(str(c), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.set_xlabel("mean end-to-end latency per request (s)")
    ax.set_ylabel("throughput (new tokens/s)")
    ax.set_title(title + "\n(labels: concurrency)", fontsize=9)
    _finish(fig, ax, path)


def plot_acceptance(runs: list[dict], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=100)
    for label, by_c in _series(runs).items():
        if label == "autoregressive":
            continue
        s = by_c[min(by_c)]
        acc = s.get("acceptance_at") or []
        ax.plot(range(1, len(acc) + 1), acc, marker="o",
                label=f"{label} (mean accepted length {s['mean_accepted_length']:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (given drafted that deep)")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    _finish(fig, ax, path)


def plot_speedup_k(runs: list[dict], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=100)
    groups: dict[tuple[str, int], list[tuple[int, dict]]] = defaultdict(list)
    for r in runs:
        if "spec" in r["summary"]:
            groups[(r["config"]["drafter"]["name"], r["config"]["concurrency"])].append(
                (r["config"]["num_speculative_tokens"], r["summary"]["spec"]))
    styles = {"speedup": ("-", "o", "measured"), "decode_speedup": (":", "s", "measured, decode only"),
              "predicted_speedup": ("--", "^", "predicted (acceptance, costs)")}
    for i, ((name, c), pts) in enumerate(sorted(groups.items())):
        pts.sort(key=lambda p: p[0])
        ks = [k for k, _ in pts]
        for key, (ls, marker, _) in styles.items():
            ax.plot(ks, [s.get(key, 0) for _, s in pts], marker=marker, linestyle=ls, color=f"C{i}",
                    label=f"{name}, concurrency {c}" if key == "speedup" else None)
    for key, (ls, marker, text) in styles.items():
        ax.plot([], [], color="black", linestyle=ls, marker=marker, label=text)
    ks_all = sorted({k for pts in groups.values() for k, _ in pts})
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("k (num_speculative_tokens)")
    ax.set_ylabel("speedup over autoregressive")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks_all, [str(k) for k in ks_all])
    ax.minorticks_off()
    ax.set_title(title, fontsize=9)
    _finish(fig, ax, path, legend_size=6)


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def write_report(folder: Path, out: Path | None = None, title: str | None = None) -> Path:
    runs = load_runs(folder)
    out = out or folder
    out.mkdir(parents=True, exist_ok=True)
    c0 = runs[0]["config"]
    title = title or (f"{c0['target']['model']}, {c0['dataset']['name']} ({c0['dataset']['num_prompts']} prompts),"
                      f" temperature {c0['sampling']['temperature']}")
    figures = {"throughput_latency.png": plot_throughput_latency, "acceptance.png": plot_acceptance,
               "speedup_k.png": plot_speedup_k}
    for name, fn in figures.items():
        fn(runs, out / name, title)

    lines = [f"# Sweep report: {title}", "", f"Source: `{folder}` ({len(runs)} runs, numbered as its job folders;"
             f" git {runs[0]['meta'].get('git_sha') or '?'}, torch {runs[0]['meta'].get('torch')},"
             f" {runs[0]['meta'].get('torch_threads')} thread(s)).", ""]
    lines += [f"![{n}]({n})" for n in figures] + [""]
    lines += ["| run | drafter | k | concurrency | method | tok/s | latency mean s | TTFT ms | TPOT ms | speedup"
              " | decode speedup | predicted | mean acc. len | loop overhead |",
              "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(runs, key=lambda r: (r["config"]["drafter"]["name"] or "", r["config"]["num_speculative_tokens"],
                                         r["config"]["concurrency"])):
        cfg = r["config"]
        for method, s in r["summary"].items():
            lines.append(
                f"| {r['dir'].name.split('_')[0]} | {cfg['drafter']['name'] or '-'}"
                f" | {s['k'] if method != 'ar' and s.get('k') else '-'} | {s['concurrency']}"
                f" | {method} | {s['tokens_per_s']:.1f} | {s['latency_mean_s']:.2f} | {s['ttft_mean_s'] * 1e3:.0f}"
                f" | {s['tpot_mean_s'] * 1e3:.1f} | {_fmt(s.get('speedup'), '.2f')}"
                f" | {_fmt(s.get('decode_speedup'), '.2f')} | {_fmt(s.get('predicted_speedup'), '.2f')}"
                f" | {_fmt(s.get('mean_accepted_length'), '.2f')} | {_fmt(s.get('overhead_frac'), '.1%')} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out / "report.md"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="a multirun folder (or one run folder)")
    ap.add_argument("--out", type=Path, default=None, help="where figures and report.md go (default: folder)")
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    print(write_report(args.folder, args.out, args.title))


if __name__ == "__main__":
    main()

"""The figures of a roofline run (:mod:`specdec.eval.roofline`), from its ``roofline.json`` dict.

- ``roofline_time.png``: ms of one forward against m, one panel per (dtype, threads, batch): each
  impl's chain (solid) and tree (dashed), the roofline and the bandwidth limit alone;
- ``roofline_ratio.png``: t(m)/t(1) on the same panels, with the roofline's ratio;
- ``context.png``: against context length, step time, peak memory and speculative speedups (the
  panels that have data).

Matplotlib (the ``experiments`` extra) with the Agg backend; imported only here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_all"]

COLORS = {"library": "tab:blue", "library_general": "tab:green", "library_unpacked": "tab:purple",
          "library_gqa": "tab:brown", "transformers": "tab:orange"}
STYLES = {"chain": "-", "tree": "--"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panels(plt, keys: list, ncols: int, title: str):
    """A figure with one axis per key (ncols a row), the unused grid cells removed."""
    ncols = max(1, min(ncols, len(keys)))
    nrows = -(-len(keys) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(keys):]:
        fig.delaxes(ax)
    fig.suptitle(title)
    return fig, dict(zip(keys, flat))


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)


def _forward_figure(result: dict[str, Any], path: Path, ratio: bool) -> None:
    rows = result["forward"]
    if not rows:
        return
    plt = _plt()
    cols = list(dict.fromkeys((r["dtype"], r["threads"]) for r in rows))  # the run's order
    keys = [(d, t, b) for b in dict.fromkeys(r["batch"] for r in rows) for d, t in cols
            if any((r["dtype"], r["threads"], r["batch"]) == (d, t, b) for r in rows)]
    what = "t(m) / t(1)" if ratio else "ms per forward"
    fig, axes = _panels(plt, keys, len(cols), f"One target forward over m new tokens: {what}")
    for (dtype, threads, batch), ax in axes.items():
        panel = [r for r in rows if (r["dtype"], r["threads"], r["batch"]) == (dtype, threads, batch)]
        for impl in sorted({r["impl"] for r in panel}):
            for mask in ("chain", "tree"):
                pts = sorted((r["m"], r["ratio"] if ratio else r["time_s"] * 1e3) for r in panel
                             if r["impl"] == impl and r["mask"] == mask)
                if pts:
                    ax.plot(*zip(*pts), STYLES[mask], marker="o", ms=3, color=COLORS.get(impl), label=f"{impl} {mask}")
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
    _save(fig, path)


def _context_figure(result: dict[str, Any], path: Path) -> None:
    ctx, spd = result["context"], [r for r in result["speedup"] if r["method"] != "ar" and r["speedup"] is not None]
    keys = (["time"] if ctx else []) + (["memory"] if any(r["decode_peak_mib"] is not None for r in ctx) else []) \
        + (["speedup"] if spd else [])
    if not keys:
        return
    plt = _plt()
    fig, axes = _panels(plt, keys, len(keys), "Against context length (batch 1)")
    if "time" in axes:
        ax = axes["time"]
        for impl in sorted({r["impl"] for r in ctx}):
            for m in sorted({r["m"] for r in ctx}):
                pts = sorted((r["context"], r["time_s"] * 1e3) for r in ctx if (r["impl"], r["m"]) == (impl, m))
                ax.plot(*zip(*pts), marker="o", ms=3, color=COLORS.get(impl), ls="-" if m == 1 else "--",
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
                    color=COLORS.get(impl), label=f"{impl} prefill peak")
            ax.plot([c for c, _ in pts], [r["decode_peak_mib"] for _, r in pts], "-", marker="o", ms=3,
                    color=COLORS.get(impl), label=f"{impl} decode peak")
            m1 = min(r["m"] for r in ctx)
            tensors = sorted((r["context"], r["decode_tensor_mib"]) for r in ctx
                             if r["impl"] == impl and r["m"] == m1 and r.get("decode_tensor_mib") is not None)
            if tensors:  # the tensors' own count (CPU): what the resident set cannot settle
                ax.plot(*zip(*tensors), ":", marker="^", ms=3, color=COLORS.get(impl),
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
    _save(fig, path)


def plot_all(result: dict[str, Any], out: Path) -> list[Path]:
    """Write the figures that have data to ``out``; returns their paths."""
    paths = [(out / "roofline_time.png", lambda p: _forward_figure(result, p, ratio=False)),
             (out / "roofline_ratio.png", lambda p: _forward_figure(result, p, ratio=True)),
             (out / "context.png", lambda p: _context_figure(result, p))]
    for path, draw in paths:
        draw(path)
    return [p for p, _ in paths if p.exists()]

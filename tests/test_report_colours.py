"""experiments/report.py: a method's colour is fixed by what it is (drafter family hue, k shade,
variant marker), never by its place in a figure, so it is the same in every figure of a report and
in every report; families stay apart."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import matplotlib.colors

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("specdec_report_colours", ROOT / "experiments" / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def _hue(colour: str) -> float:
    return matplotlib.colors.rgb_to_hsv(matplotlib.colors.to_rgb(colour))[0]


def test_the_colour_of_a_method_is_stable_and_families_keep_their_hue():
    style = report.method_style
    assert style("ngram", 4, "ngram") == style("ngram", 4, "ngram")  # no state: every figure, every report
    assert style(None, None, "autoregressive")["color"] == "black"
    shades = [style("ngram", k, "ngram")["color"] for k in (1, 2, 3, 4, 8, 16)]
    assert len(set(shades)) == 6  # k told apart by shade
    lum = [sum(matplotlib.colors.to_rgb(c)) for c in shades]
    assert lum == sorted(lum, reverse=True)  # longer drafts darker
    families = ["ngram", "suffix", "mtp", "eagle3", "dflash", "dspark", "gemma_mtp"]
    assert len({style(f, 4, f)["color"] for f in families}) == len(families)
    hues = {f: _hue(style(f, None, f)["color"]) for f in families if f not in ("gemma_mtp",)}
    assert len({round(h, 1) for h in hues.values()}) >= 5  # distinct hues, not shades of one
    assert style("ngram", 2, "spec")["marker"] != style("ngram", 2, "ngram_wide")["marker"] or \
        style("ngram", 2, "spec") != style("ngram", 2, "ngram_wide")  # variants differ in marker (or collide rarely)
    assert style("mine", 4, "mine") == style("mine", 4, "mine")  # a drafter of one's own: a stable hue too


def test_a_method_has_one_colour_in_every_figure_of_a_report(tmp_path):
    """Two runs: the ngram line of the throughput figure and its acceptance line share a colour, and a
    figure built from more runs does not recolour it."""
    import json

    def run(folder: str, methods: dict[str, tuple[str, int]]):
        d = tmp_path / folder
        d.mkdir()
        summary = {"ar": {"tokens_per_s": 10.0, "latency_mean_s": 1.0, "k": 0, "drafter": None, "lossless": True}}
        for name, (drafter, k) in methods.items():
            summary[name] = {"tokens_per_s": 12.0 + k, "latency_mean_s": 0.8, "k": k, "drafter": drafter,
                             "lossless": True, "prefill_s": 0.1, "acceptance_at": [0.5] * k, "mean_accepted_length": 1.5,
                             "speedup": 1.2, "policy": None}
        config = {"concurrency": 1, "drafter": {"name": None}, "dataset": {"name": "mtbench"},
                  "sampling": {"temperature": 0.0}}
        (d / "summary.json").write_text(json.dumps(summary))
        (d / "config.json").write_text(json.dumps({"config": config}))

    run("0", {"ngram k=4": ("ngram", 4), "suffix k=4": ("suffix", 4)})
    run("1", {"eagle3 k=2": ("eagle3", 2), "ngram k=2": ("ngram", 2)})
    runs = report.load_runs(tmp_path)

    def colours(fig) -> dict[str, str]:
        return {line.get_label().split(" (")[0]: matplotlib.colors.to_hex(line.get_color())
                for line in fig.axes[0].get_lines() if not line.get_label().startswith("_")}

    thr = colours(report.figure_throughput_latency(runs, "t"))
    acc = colours(report.figure_acceptance(runs, "t"))
    alone = colours(report.figure_throughput_latency(runs[:1], "t"))
    report.plt.close("all")
    for label in ("ngram k=4", "suffix k=4", "ngram k=2", "eagle3 k=2"):
        assert thr[label] == acc[label], label
    assert alone["ngram k=4"] == thr["ngram k=4"] and alone["suffix k=4"] == thr["suffix k=4"]
    assert len({thr[label] for label in ("ngram k=4", "suffix k=4", "ngram k=2", "eagle3 k=2")}) == 4

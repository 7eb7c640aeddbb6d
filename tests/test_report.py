"""The sweep report's figures are readable: no empty panel, no line hidden under another, the
predicted markers visible, one autoregressive baseline per job context. Checked on the matplotlib
objects of figures built from a small synthetic multirun result (no model runs)."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest
from matplotlib.colors import to_rgba

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("specdec_experiments_report", ROOT / "experiments" / "report.py")
report = importlib.util.module_from_spec(_spec)
assert _spec.loader is not None
_spec.loader.exec_module(report)


def _run(drafter: str | None, k: int, c: int, temperature: float = 0.0, acceptance: list[float] | None = None) -> dict:
    """One job folder as :func:`report.load_runs` reads it: its config and summary."""
    ar = {"tokens_per_s": 20.0 * c ** 0.5, "latency_mean_s": 2.0 + 0.1 * c, "lossless": True}
    summary: dict = {"ar": ar}
    if drafter is not None:
        acc = acceptance if acceptance is not None else [0.0] * k
        summary["spec"] = {"prefill_s": 0.1, "k": k, "acceptance_at": acc, "mean_accepted_length": 1 + sum(acc),
                           "tokens_per_s": 15.0 * c ** 0.5, "latency_mean_s": 2.5 + 0.1 * c, "speedup": 0.8,
                           "decode_speedup": 0.8, "predicted_speedup": 0.8, "lossless": True}
    config = {"concurrency": c, "num_speculative_tokens": k, "drafter": {"name": drafter},
              "dataset": {"name": "mtbench"}, "sampling": {"temperature": temperature}}
    return {"dir": Path(f"{drafter}_{k}_{c}"), "config": config, "meta": {}, "summary": summary}


# a drafters sweep: three drafters (two of them never accepted: their lines coincide at 0) x two
# concurrencies, every job measuring its own autoregressive baseline, speedups all equal
SWEEP = [_run(d, 4, c, acceptance=[0.5, 0.25, 0.1, 0.0] if d == "eagle3" else None)
         for d, c in itertools.product(("eagle3", "mtp", "dflash"), (1, 4))]


@pytest.fixture()
def figures():
    built = {name: build(SWEEP, "a drafters sweep") for name, build in report.FIGURES.items()
             if name != "speedup_context.png"}  # a sweep over prompt length has its own test
    yield built
    report.plt.close("all")


def _data_lines(ax):
    """The lines that draw data (not legend-only entries, not the break-even reference)."""
    return [ln for ln in ax.get_lines() if len(ln.get_xdata()) and ln.get_gid() != "reference"]


def test_every_axes_has_lines_and_every_line_lies_inside_its_axes(figures):
    for name, fig in figures.items():
        assert fig is not None, name
        for ax in fig.axes:
            lines = _data_lines(ax)
            assert lines, f"{name}: an empty axes"
            (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
            for ln in lines:
                assert all(x0 < x < x1 for x in ln.get_xdata()) and all(y0 < y < y1 for y in ln.get_ydata()), \
                    f"{name}: {ln.get_label()} on or outside the frame"


def test_autoregressive_only_jobs_draw_no_acceptance_or_speedup_panel(tmp_path):
    runs = [_run(None, 4, c) for c in (1, 4)]
    assert report.FIGURES["acceptance.png"](runs, "t") is None
    assert report.FIGURES["speedup_k.png"](runs, "t") is None
    written = report.write_figures(runs, tmp_path, "t")
    assert written == ["throughput_latency.png"] and sorted(p.name for p in tmp_path.iterdir()) == written


def test_one_autoregressive_baseline_per_job_context():
    fig = report.FIGURES["throughput_latency.png"](SWEEP, "t")
    baselines = [ln for ln in fig.axes[0].get_lines() if ln.get_label().startswith("autoregressive")]
    assert len(baselines) == 1 and len(baselines[0].get_xdata()) == 2  # not one per drafter; both concurrencies
    two_temperatures = SWEEP + [_run(d, 4, c, temperature=0.7) for d, c in itertools.product(("eagle3", "mtp"), (1, 4))]
    fig = report.FIGURES["throughput_latency.png"](two_temperatures, "t")
    labels = sorted(ln.get_label() for ln in fig.axes[0].get_lines() if ln.get_label().startswith("autoregressive"))
    assert labels == ["autoregressive (T=0)", "autoregressive (T=0.7)"]
    report.plt.close("all")


def test_coinciding_series_stay_visible(figures):
    """mtp and dflash have the same acceptance (all zero) and every method the same speedups: each
    series has its own colour and marker, and no two series draw the same points."""
    for name in ("throughput_latency.png", "acceptance.png", "speedup_k.png"):
        lines = [ln for ln in _data_lines(figures[name].axes[0]) if ln.get_gid() in (None, "speedup")]
        styles = [(to_rgba(ln.get_color()), ln.get_marker()) for ln in lines]
        assert len(set(styles)) == len(styles), (name, styles)
        points = [tuple(zip(ln.get_xdata(), ln.get_ydata())) for ln in lines]
        if name == "throughput_latency.png":  # measured points, not shared x values: concentric markers
            drawn = [(pts, ln.get_markersize()) for pts, ln in zip(points, lines)]
            assert len(set(drawn)) == len(drawn) and len(set(points)) < len(points), drawn
        else:
            assert len(set(points)) == len(points), f"{name}: a line drawn exactly on another"


def test_predicted_markers_are_visible_and_in_the_legend(figures):
    ax = figures["speedup_k.png"].axes[0]
    predicted = [ln for ln in _data_lines(ax) if ln.get_gid() == "predicted_speedup"]
    measured = [ln for ln in _data_lines(ax) if ln.get_gid() == "speedup"]
    assert len(predicted) == len(measured) == 6  # 3 drafters x 2 concurrencies
    for p, m in zip(predicted, measured):
        assert p.get_marker() not in ("None", "", " ", None) and p.get_markersize() > m.get_markersize()
        assert p.get_markerfacecolor() == "none" and p.get_markeredgewidth() >= 1.5  # hollow: the measured shows through
        assert p.get_visible() and (p.get_alpha() or 1.0) == 1.0 and p.get_zorder() > m.get_zorder()
    assert "predicted (acceptance, costs)" in ax.get_legend_handles_labels()[1]


def test_the_context_figure_draws_each_method_against_prompt_length():
    """context_length's figure: one line per method (generate() included) over the swept prompt
    lengths, decode speedup where the loop measured one; no figure for jobs of one length."""
    runs = []
    for n in (128, 1024, 4000):
        r = _run("eagle3", 2, 1, acceptance=[0.4, 0.1])
        r["config"]["dataset"]["input_len"] = n
        r["summary"]["spec"]["decode_speedup"] = 1.0 + n / 10000
        r["summary"]["hf_generate"] = {"speedup": 1.1, "tokens_per_s": 9.0, "lossless": True}
        runs.append(r)
    fig = report.FIGURES["speedup_context.png"](runs, "t")
    lines = {ln.get_label(): ln for ln in _data_lines(fig.axes[0])}
    assert set(lines) == {"eagle3, k 2", "hf_generate, end to end"}
    assert [round(y, 4) for y in lines["eagle3, k 2"].get_ydata()] == [1.0128, 1.1024, 1.4]
    assert len(lines["hf_generate, end to end"].get_xdata()) == 3
    assert report.FIGURES["speedup_context.png"](SWEEP, "t") is None
    report.plt.close("all")


def test_a_questions_table_is_rendered_from_its_run_with_its_provenance(tmp_path):
    """docs/results/<question>.md: the command, git SHA, machine and date come from the run's
    config.json, the rows from its summary.json; a run that did not record them is refused."""
    import json

    job = tmp_path / "0_concurrency=1"
    job.mkdir()
    meta = {"config": {"concurrency": 1, "num_speculative_tokens": 8, "drafter": {"name": "ngram"},
                       "dataset": {"name": "copy"}, "sampling": {"temperature": 0.0}},
            "command": "python experiments/run.py --config-name ngram_vs_prompt_lookup -m",
            "git_sha": "0123456789abcdef", "torch": "2.13.0", "transformers": "5.0",
            "machine": {"cpu": "Some CPU", "gpu": None, "threads": 1, "dtype": "float32"}, "date": "2026-12-02 03:00 UTC"}
    summary = {"ar": {"concurrency": 1, "tokens_per_s": 16.0, "mean_accepted_length": 1.0, "lossless": True},
               "spec": {"concurrency": 1, "k": 8, "tokens_per_s": 27.5, "speedup": 1.72, "decode_speedup": 1.8,
                        "mean_accepted_length": 3.2, "identical_to_baseline": 6, "requests": 6, "lossless": True}}
    (job / "config.json").write_text(json.dumps(meta))
    (job / "summary.json").write_text(json.dumps(summary))
    table = report.question_table(tmp_path)
    assert table.startswith("# `ngram_vs_prompt_lookup`") and "prompt lookup" in table  # the preset's own question
    for part in ("`python experiments/run.py --config-name ngram_vs_prompt_lookup -m`", "0123456789", "Some CPU",
                 "1 thread(s), float32", "2026-12-02 03:00 UTC", "| 0: concurrency=1 | copy | 0 | 1 | spec | 8 | 27.5 | 1.72 | 1.80 | 3.20 | 6/6 |"):
        assert part in table, part
    del meta["machine"]
    (job / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="run it again"):
        report.question_table(tmp_path)


def test_rendering_a_page_again_replaces_its_tables_and_keeps_its_notes(tmp_path):
    """``--table`` on an existing page: what follows its notes line (the prose) survives, the rest is new."""
    from specdec.provenance import NOTES, with_kept_notes

    page = tmp_path / "q.md"
    assert with_kept_notes(page, "# table v1\n") == "# table v1\n\n" + NOTES + "\n"  # a new page gets the line
    page.write_text("# table v1\n| old |\n\n" + NOTES + "\n\nWhat the old table means.\n")
    again = with_kept_notes(page, "# table v2\n| new |\n")
    assert again.startswith("# table v2\n| new |") and "| old |" not in again
    assert again.endswith(NOTES + "\n\nWhat the old table means.\n")


RESULTS = ROOT / "docs" / "results"


@pytest.mark.parametrize("page", sorted(p.name for p in RESULTS.glob("*.md")))
def test_every_results_page_is_rendered_from_its_record(page):
    """docs/results/<name>.md is the renderer's page of its committed record <name>.json (its header:
    command, git SHA, machine, date), then its notes; nothing above the notes line is typed by hand."""
    import json

    from specdec.provenance import NOTES

    path = RESULTS / page
    record = json.loads(path.with_suffix(".json").read_text())
    text = path.read_text()
    assert NOTES in text, f"{page} has no notes line"
    rendered = text.split(NOTES, 1)[0].rstrip("\n") + "\n"
    assert rendered == report.render_page(record, path.stem), f"{page} differs from its record: python experiments/report.py --page docs/results/{page}"
    for key in report.HEADER:
        assert f"\n- {key}: " in rendered and record["provenance"][key], (page, key)


def test_a_record_without_its_provenance_or_a_ragged_table_is_refused():
    record = {"title": "t", "provenance": {"command": "c", "git": "g", "machine": "m", "date": "d"},
              "tables": [{"columns": ["a", "b"], "align": "lr", "rows": [["1", "2"]]}]}
    page = report.render_page(record, "x")
    assert page.startswith("# t\n") and "| a | b |\n|---|---:|\n| 1 | 2 |" in page and "- record: [`x.json`](x.json)" in page
    with pytest.raises(ValueError, match="machine"):
        report.render_page({**record, "provenance": {"command": "c", "git": "g", "date": "d"}}, "x")
    with pytest.raises(ValueError, match="columns"):
        report.render_page({**record, "tables": [{"columns": ["a", "b"], "align": "lr", "rows": [["1"]]}]}, "x")


def test_the_learning_curves_page_derives_its_tables_from_the_curves():
    curve = lambda mal: {"tokens": 1000, "steps": 2, "wall_seconds": 3.0, "held_out": {}, "command": "c",  # noqa: E731
                         "decoded": {n: {"mean_accepted_length": mal, "acceptance_at": [mal - 1]} for n in ("mtbench", "humaneval")}}
    data = {"eagle3": [curve(1.1), {**curve(1.2), "tokens": 10_000}], "mtp": [{**curve(1.0), "decoded": None}]}
    tables = report.learning_curves_tables(data)
    assert tables[0]["rows"][1] == ["eagle3", "10,000", "2", "3", "1.20", "0.20", "1.20", "0.20"] and len(tables[0]["rows"]) == 2
    assert tables[1]["rows"][0][:3] == ["eagle3", "2", "+0.100"] and tables[1]["rows"][1] == ["mtp", "0", "+0.000", "never on this trend", "+0.000", "never on this trend"]

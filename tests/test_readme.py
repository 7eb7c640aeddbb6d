"""The README's Python snippets run as written (on the real SmolLM2, so in the slow tier), and
``generate(temperature=...)`` points at ``sampling=SamplingParams(...)``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import specdec
from specdec.target import Target
from specdec.testing.tiny import tiny_model

README = Path(__file__).resolve().parents[1] / "README.md"


def snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_the_snippets_this_file_runs():
    code = snippets()
    assert len(code) >= 2
    assert any("SamplingParams(" in c and "sampling=" in c for c in code)  # a sampled example
    assert any("model.generate(" in c and "model, tokenizer = " in c for c in code)  # `model` defined


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(snippets())))
def test_every_readme_snippet_runs_as_written(index, tmp_path, monkeypatch, capsys):
    """Each snippet alone, in a fresh namespace, from an empty folder (one writes run.json)."""
    monkeypatch.chdir(tmp_path)
    exec(compile(snippets()[index], f"README.md snippet {index}", "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out.strip()  # every snippet prints what it made


@pytest.mark.parametrize("words", [{"temperature": 0.7}, {"top_p": 0.9, "seed": 1}, {"do_sample": True}])
def test_sampling_keywords_point_to_sampling_params(words):
    target = Target(tiny_model("llama", vocab_size=32))
    for drafter in ("ngram", None):
        with pytest.raises(ValueError, match=r"sampling=specdec\.SamplingParams\(.*not as keywords"):
            specdec.generate(target, [[1, 2, 3]], drafter, max_new_tokens=2, **words)


def test_drafter_options_without_a_named_drafter_are_refused_not_ignored():
    target = Target(tiny_model("llama", vocab_size=32))
    with pytest.raises(ValueError, match="need a drafter given by name"):
        specdec.generate(target, [[1, 2, 3]], None, max_new_tokens=2, max_ngram=2)
    out = specdec.generate(target, [[1, 2, 3]], "ngram", max_new_tokens=2, max_ngram=2,
                           sampling=specdec.SamplingParams(temperature=0.7, seed=0))
    assert len(out.tokens[0]) == 2


def test_the_readmes_training_times_are_those_the_checkpoints_record():
    """The range of CPU minutes the README gives is the one the SmolLM2 checkpoints' training.json
    files record (``wall_seconds``), so a new or retrained checkpoint that moves it fails here."""
    import json
    import re

    from specdec.paths import REPO_ROOT

    minutes = [json.loads(p.read_text())["wall_seconds"] / 60
               for p in (REPO_ROOT / "experiments" / "checkpoints").glob("smollm2-135m-*/training.json")]
    said = re.search(r"(\d+\.\d)–(\d+\.\d) CPU minutes each", (REPO_ROOT / "README.md").read_text())
    assert said is not None and minutes
    assert (float(said[1]), float(said[2])) == (round(min(minutes), 1), round(max(minutes), 1)), (said[0], minutes)

"""The progress bar of :func:`specdec.generate`: new tokens out of the budget, shown only to a person."""

from __future__ import annotations

import io
import sys

import pytest

import specdec


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _generate(target, progress=None):
    return specdec.generate(target, [[1, 2, 3], [4, 5]], drafter="ngram", k=2, max_new_tokens=6,
                            eos_token_ids=set(), progress=progress)


def test_forced_on_draws_a_bar_of_new_tokens_out_of_the_budget(target, capsys):
    _generate(target, progress=True)
    err = capsys.readouterr().err
    assert "generate" in err and "12/12" in err and "tok" in err, err


def test_forced_off_draws_nothing_even_on_a_terminal(target, monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    _generate(target, progress=False)
    assert sys.stderr.getvalue() == ""


@pytest.mark.parametrize("terminal, env, shown", [
    (False, {}, False),  # a log file or a pipe
    (True, {}, True),  # a person at a terminal
    (True, {"PYTEST_CURRENT_TEST": "x"}, False),  # inside a test
    (True, {"CI": "true"}, False),  # inside CI
])
def test_by_default_only_a_terminal_outside_tests_and_ci_sees_it(target, monkeypatch, terminal, env, shown):
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    monkeypatch.delenv("CI", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "stderr", _Terminal() if terminal else io.StringIO())
    _generate(target)
    assert ("12/12" in sys.stderr.getvalue()) is shown, sys.stderr.getvalue()

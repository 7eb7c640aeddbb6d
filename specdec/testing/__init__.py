"""Conformance tools: what the test suite runs on every drafter, usable on a new one.

The tools (:mod:`specdec.testing.tools`: :func:`chi_square`, :func:`greedy_reference`,
:func:`assert_greedy_equivalent`, :func:`assert_batch_independent`, :func:`sampled_gof`,
:func:`q_contract`, :class:`RandomDrafter`, :class:`Recording`, :func:`tree_parents`) and :func:`run_conformance`, which runs the conformance
suite (:mod:`specdec.testing.conformance`, built on those tools) on any drafter.

Kernel authors: :mod:`specdec.testing.triton_memory` runs Triton's interpreter with a GPU's memory
ordering (a store seen only after a barrier), so a kernel that reads its own unsynchronised writes
fails on CPU as it would on the hardware.
"""

from __future__ import annotations

from specdec.drafter import Drafter
from specdec.testing.tools import (RandomDrafter, Recording, assert_batch_independent, assert_greedy_equivalent,
                                   chi_square, greedy_reference, q_contract, sampled_gof, tree_parents)

__all__ = ["run_conformance", "chi_square", "greedy_reference", "assert_greedy_equivalent", "sampled_gof", "q_contract",
           "RandomDrafter", "Recording", "tree_parents", "assert_batch_independent"]


def run_conformance(*drafters: str | type[Drafter], pytest_args: tuple[str, ...] = ("-q",)) -> int:
    """Run the conformance suite on ``drafters`` (classes, registered names or ``module:Class``),
    each built with its own ``tiny(target)``; returns pytest's exit code (0: every check passed).

    Works from any directory, inside or outside this repository::

        from specdec.testing import run_conformance
        assert run_conformance(MyDrafter) == 0
    """
    import pytest  # the test extras: only this function needs pytest and hypothesis

    from specdec.testing import conformance, plugin

    if not drafters:
        raise ValueError("run_conformance needs at least one drafter")
    plugin.CASES.clear()
    plugin.CASES.update(plugin.drafter_factory(d) for d in drafters)
    return int(pytest.main([conformance.__file__, "-p", "specdec.testing.plugin", "-p", "no:cacheprovider",
                            *pytest_args]))

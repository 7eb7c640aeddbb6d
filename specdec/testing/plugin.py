"""A pytest plugin that runs the conformance suite (:mod:`specdec.testing.conformance`) on any drafter.

    pytest --pyargs specdec.testing.conformance -p specdec.testing.plugin --specdec-drafter my_pkg.mod:MyDrafter

``--specdec-drafter`` (repeatable) takes a registered name (``ngram``, or one an installed package
declares) or ``module:Class``; each drafter is built with its own ``tiny(target)`` factory, bound to
a tiny random Llama whose distributions are peaked enough that top-k and top-p cut something.
:func:`specdec.testing.run_conformance` sets the cases from Python instead.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import pytest
import torch

from specdec.drafter import Drafter
from specdec.registry import drafter_class
from specdec.target import Target
from specdec.testing.tiny import tiny_model

__all__ = ["CASES", "drafter_factory"]

VOCAB = 32
# name → factory(target) -> bound drafter; filled from --specdec-drafter or by run_conformance
CASES: dict[str, Callable[[Target], Drafter]] = {}


def _import_class(spec: str) -> object:
    """The object ``module:Class`` names; a ``ValueError`` of one line, with the fix, when the module
    cannot be imported or has no such name."""
    module, _, attr = spec.partition(":")
    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):  # the package itself is not there
            raise ValueError(f"{spec!r}: no module named {e.name!r} in this environment ({sys.executable}); install"
                             f" the package that holds it (from its folder: pip install -e .), or run `python -m pytest`"
                             f" from the folder that contains {e.name.split('.')[0]!r}") from None
        raise ValueError(f"{spec!r}: importing {module!r} failed, it needs {e.name!r}, which is not installed") from None
    if not attr or not hasattr(found, attr):
        raise ValueError(f"{spec!r}: module {module!r} has no {attr!r}; name a Drafter class as module:Class")
    return getattr(found, attr)


def drafter_factory(spec: str | type[Drafter]) -> tuple[str, Callable[[Target], Drafter]]:
    """A case from a registered name, ``module:Class`` or a Drafter class: (its name, its tiny factory).
    A name that leads nowhere is a ``ValueError`` of one line that says how to fix it."""
    if isinstance(spec, type):
        cls = spec
    elif ":" in spec:
        cls = _import_class(spec)
    else:
        cls = drafter_class(spec)
    if not (isinstance(cls, type) and issubclass(cls, Drafter)):
        raise TypeError(f"{spec!r} is not a specdec Drafter class")
    return f"{getattr(cls, 'name', cls.__name__)}[tiny]", cls.tiny


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--specdec-drafter", action="append", default=[],
                     help="a drafter to run the conformance suite on: a registered name or module:Class (repeatable)")


def pytest_configure(config: pytest.Config) -> None:
    for spec in config.getoption("--specdec-drafter"):
        try:
            name, factory = drafter_factory(spec)
        except (ValueError, TypeError) as e:  # one line with the fix, not pytest's INTERNALERROR traceback
            raise pytest.UsageError(f"--specdec-drafter {e}") from None
        CASES[name] = factory


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "drafter_case" in metafunc.fixturenames:
        if not CASES:
            raise pytest.UsageError("no drafter to test: pass --specdec-drafter NAME or module:Class")
        metafunc.parametrize("drafter_case", sorted(CASES), indirect=True)
    if "sampled_verifier" in metafunc.fixturenames:  # every lossless verifier on every drafter given
        from specdec.testing.conformance import SAMPLED_VERIFIERS

        metafunc.parametrize("sampled_verifier", SAMPLED_VERIFIERS)


@pytest.fixture(scope="session")
def target() -> Target:
    """A tiny Llama with peaked distributions (so top-k and top-p cut something)."""
    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    return Target(tiny_model("llama", vocab_size=VOCAB, init_scale=0.3, seed=0))


@pytest.fixture
def drafter_case(request: pytest.FixtureRequest, target: Target) -> tuple[str, Drafter]:
    return request.param, CASES[request.param](target)

"""Drafters and verifiers by name: built-ins through their entry points, plug-ins by decorator."""

from __future__ import annotations

import subprocess
import sys

import pytest

import specdec
from specdec.drafter import Drafter
from specdec.registry import DRAFTERS, VERIFIERS, Registry, register_drafter
from specdec.testing import RandomDrafter


def test_every_builtin_is_declared_as_an_entry_point():
    import specdec.drafters
    import specdec.verifiers

    assert {n: DRAFTERS.get(n) for n in specdec.drafters.DRAFTERS} == specdec.drafters.DRAFTERS
    assert {n: VERIFIERS.get(n) for n in specdec.verifiers.VERIFIERS} == specdec.verifiers.VERIFIERS
    for name in DRAFTERS.names():
        assert DRAFTERS.get(name).name == name


def test_importing_specdec_imports_no_drafter():
    code = "import sys, specdec; print(sorted(m for m in sys.modules if m.startswith('specdec.drafters')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown drafter 'eagle'; known: \[.*'eagle3'"):
        DRAFTERS.get("eagle")
    with pytest.raises(TypeError, match="must be a string"):
        DRAFTERS.get(3)  # type: ignore[arg-type]


def test_a_drafter_registered_by_decorator_is_made_by_name(target):
    @register_drafter
    class Mine(RandomDrafter):
        name = "test_registry_mine"

    try:
        assert "test_registry_mine" in DRAFTERS.names()
        d = specdec.make_drafter("test_registry_mine", target)
        assert isinstance(d, Mine)
        with pytest.raises(ValueError, match="already registered"):
            register_drafter(type("Other", (RandomDrafter,), {"name": "test_registry_mine"}))
    finally:
        DRAFTERS.unregister("test_registry_mine")
    assert "test_registry_mine" not in DRAFTERS


def test_registration_checks_what_it_is_given():
    reg: Registry[Drafter] = Registry("drafter", "specdec.test-none", Drafter)
    with pytest.raises(TypeError, match="subclass of Drafter"):
        reg.register(int)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a `name`"):
        reg.register(type("NoName", (RandomDrafter,), {"name": ""}))

"""The conformance suite (specdec.testing.conformance) on every registered drafter and the
adversarial test drafters: the cases and fixtures are in conftest.py. Outside this repository the
same suite runs through specdec.testing.plugin / specdec.testing.run_conformance."""

from specdec.testing.conformance import *  # noqa: F401,F403  (pytest collects the imported test_* functions)

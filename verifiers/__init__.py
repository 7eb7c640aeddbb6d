"""Verifiers, chosen by name.

| name | lossless | what it does |
|---|---|---|
| ``greedy`` | yes (temperature 0 only) | exact argmax match, chains and trees |
| ``rejection`` | yes | rejection sampling (Leviathan et al. 2023, Chen et al. 2023); on trees, recursive rejection sampling over siblings |
| ``block`` | yes | block verification (Sun et al. 2025): a chain verified jointly, never fewer accepted in expectation; trees fall back to ``rejection`` |
| ``coupled`` | yes | position-keyed noise shared by drafter and target (Gumbel-max): a seeded request emits exactly plain seeded sampling's tokens, whatever the drafter, k, policy or batch |
| ``typical`` | **no** | Medusa's typical acceptance; for comparison only |
"""

if __name__ != "specdec.verifiers":  # the bare name `verifiers` belongs to another PyPI package
    raise ImportError(
        "the folder verifiers/ of the specdec repository was imported as the top-level package 'verifiers':"
        " Python is running with the repository root on sys.path (python -m or a REPL started there),"
        " where the folder shadows the PyPI package of that name. Import it as specdec.verifiers, and run"
        " from another directory or use the installed commands (specdec-demo, pytest)."
    )

from specdec.verifier import Verifier
from specdec.verifiers.block import BlockVerifier
from specdec.verifiers.coupled import CoupledVerifier
from specdec.verifiers.greedy import GreedyVerifier
from specdec.verifiers.rejection import RejectionVerifier
from specdec.verifiers.typical import TypicalVerifier

VERIFIERS: dict[str, type[Verifier]] = {
    "greedy": GreedyVerifier,
    "rejection": RejectionVerifier,
    "typical": TypicalVerifier,
    "block": BlockVerifier,
    "coupled": CoupledVerifier,
}

__all__ = ["VERIFIERS", "Verifier", "GreedyVerifier", "RejectionVerifier", "TypicalVerifier", "BlockVerifier",
           "CoupledVerifier"]

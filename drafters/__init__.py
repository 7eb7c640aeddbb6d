"""Drafters, chosen by name. Every entry provides ``tiny(target)`` for the conformance suite.

| name | needs from the target | proposes |
|---|---|---|
| ``ngram`` | tokens only | prompt lookup, deterministic chain |
| ``draft_model`` | nothing (own LM, same vocabulary) | ``k`` sequential samples, exact q |
"""

if __name__ != "specdec.drafters":  # the bare name `drafters` belongs to another PyPI package
    raise ImportError("import this package as specdec.drafters")

from specdec.drafter import Drafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter

DRAFTERS: dict[str, type[Drafter]] = {
    "ngram": NgramDrafter,
    "draft_model": DraftModelDrafter,
}

__all__ = ["DRAFTERS", "Drafter", "NgramDrafter", "DraftModelDrafter"]

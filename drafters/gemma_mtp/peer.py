"""transformers' Gemma-4 assistant drafting as the peer of the ``gemma_mtp`` drafter.

``generate(assistant_model=<Gemma4Assistant>)`` runs transformers'
``SinglePositionMultiTokenCandidateGenerator`` on the drafter's own assistant model. transformers
reads the target's K/V through the ``shared_kv_states`` only Gemma 4 and Gemma 3n targets return,
so the peer needs one of those (this library's drafter reads any target's cache).
"""

from __future__ import annotations

from typing import Any

from specdec.drafter import Drafter
from specdec.drafters.draft_model import transformers_assistant
from specdec.drafters.gemma_mtp.drafter import GemmaMTPDrafter
from specdec.target import Target

__all__ = ["transformers_peer"]


def transformers_peer(target: Target, drafter: Drafter | None, k: int) -> dict[str, Any]:
    """``generate()`` arguments for transformers' assistant drafting ``k`` tokens a step."""
    if not isinstance(drafter, GemmaMTPDrafter):
        raise ValueError("hf_compare 'gemma_mtp' runs the gemma_mtp drafter's assistant: use drafter=gemma_mtp")
    if not type(target.model).__name__.startswith(("Gemma4", "Gemma3n")):
        raise ValueError(f"hf_compare 'gemma_mtp' needs a Gemma 4 or Gemma 3n target (transformers reads their"
                         f" shared K/V states); got {type(target.model).__name__}")
    return {"assistant_model": transformers_assistant(drafter.assistant, k)}

"""transformers' own MTP drafting as the peer of the ``mtp`` drafter.

``generate(use_mtp=True)`` drafts with the MTP layers stored in the target's checkpoint
(``model.layers.{L+d}.*``), the same modules the drafter loads, so both run the same weights.
"""

from __future__ import annotations

from typing import Any

from specdec.drafter import Drafter
from specdec.drafters.mtp.drafter import MTPDrafter
from specdec.target import Target
from specdec.transformers_versions import require

__all__ = ["transformers_peer"]


def transformers_peer(target: Target, drafter: Drafter | None, k: int) -> dict[str, Any]:
    """``generate()`` arguments for transformers' MTP drafting. It drafts as many tokens as the
    checkpoint has modules, whatever ``k``."""
    if not isinstance(drafter, MTPDrafter):
        raise ValueError("hf_compare 'mtp' runs the mtp drafter's checkpoint: use drafter=mtp")
    require("generate(use_mtp=True)")
    # A transformers limitation: it finds the MTP weights through `_keys_to_ignore_on_load_unexpected`,
    # which DeepSeek-V3 hard-codes to the 671B layout (model.layers.61). Point it at this target's layers.
    L = target.num_layers
    target.model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{L + d}\..*" for d in range(drafter.depth)]
    return {"use_mtp": True}

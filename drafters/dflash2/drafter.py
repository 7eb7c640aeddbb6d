"""DFlash 2: DFlash's one-pass block drafter, its blocks convolved, its drafts chosen by walking a
candidate lattice (z-lab / Inco, 2026; the network is :mod:`specdec.drafters.dflash2.model`).

Each step runs DFlash's block ``[anchor, MASK × k]`` once (:meth:`BlockDrafter.block_hidden`). Slot
``j`` (block position ``j ≥ 1``) keeps the target head's top-K tokens as candidates; the
selector scores every edge between adjacent slots' candidates (the anchor is slot 1's only
predecessor), and the draft is a path through them walked from the anchor:

- **greedy**: at each slot the best-scoring edge from the token just chosen (first candidate on
  ties), as vLLM's walk does; ``q = None``.
- **sampled** (T > 0): at each slot one inverse-CDF draw from ``softmax(s_j(x_{j−1}, ·) / T)`` over
  the K candidates, ``q_j`` being exactly that distribution over the vocabulary (zero outside the
  candidates), so rejection sampling stays exact. Only the temperature shapes it, as in vLLM's and
  z-lab's walks: the request's top-k / top-p warp the target's side only (the verifier's residual
  covers any token the candidates miss). A temperature-0 row among sampled ones walks greedily
  (one-hot q).

A step costs DFlash's plus one K×K score table per slot (``K·K·r`` products) and the walk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from specdec.drafters.dflash.drafter import BlockDrafter, BlockState
from specdec.drafters.dflash.model import BlockDraftModel
from specdec.drafters.dflash2.model import DFlash2Config, DFlash2Model
from specdec.sampling import RowSampling, sample_from, warp
from specdec.types import DraftProposal

__all__ = ["DFlash2Drafter", "walk"]


def walk(scores: Tensor, candidates: Tensor, rows: RowSampling | None, u: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The path through the lattice from the anchor. scores [B, L, K_prev, K] (:meth:`CandidateSelector.edge_scores`),
    candidates [B, L, K] token ids; ``rows`` and uniforms ``u`` [B, L] for a sampled walk, None for a
    greedy one. Returns (tokens [B, L], q over the candidates [B, L, K] float32 | None)."""
    B, L, K = candidates.shape
    prev = torch.zeros(B, dtype=torch.long, device=scores.device)  # slot 0: every predecessor row is the anchor's
    picks, qs = [], []
    zeros, ones = torch.zeros(B, dtype=torch.long, device=scores.device), torch.ones(B, device=scores.device)
    for j in range(L):
        s = scores[:, j].gather(1, prev.view(B, 1, 1).expand(B, 1, K)).squeeze(1)  # [B, K]: edges from the last pick
        if rows is None:
            prev = s.max(-1).indices  # first index of the maximum on ties
        else:
            assert u is not None
            # temperature only; T = 0 rows one-hot on the argmax
            q = warp(s, rows.temperature, zeros, ones, all_greedy=False, use_top_k=False, use_top_p=False)
            prev = sample_from(q, u[:, j])
            qs.append(q)
        picks.append(prev)
    idx = torch.stack(picks, 1)
    return candidates.gather(2, idx.unsqueeze(-1)).squeeze(-1), (torch.stack(qs, 1) if qs else None)


class DFlash2Drafter(BlockDrafter):
    name = "dflash2"
    model_class = DFlash2Model
    tiny_config: ClassVar[dict[str, Any]] = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4,
                                             "selector_top_k": 8}
    model: DFlash2Model
    cfg: DFlash2Config

    def __init__(self, model: BlockDraftModel, greedy_draft: bool = False, head_dtype: str = "",
                 token_map: str | Sequence[int] = "", draft_vocab: int = 0):
        if not isinstance(model, DFlash2Model):
            raise ValueError(f"dflash2 needs a DFlash 2 model (DFlash2DraftModel: convolutions and a candidate"
                             f" selector); got {type(model).__name__}, use the dflash or dspark drafter")
        super().__init__(model, greedy_draft, head_dtype, token_map, draft_vocab)

    @torch.inference_mode()
    def propose(self, state: BlockState, k: int, rows: RowSampling) -> DraftProposal:
        hidden = self.block_hidden(state, k + 1)[:, 1:]  # slot j drafts the token at P + j, as DFlash
        vocab = self.drafted_ids()
        logits = self.target.logits(hidden, self.head_dtype, vocab)  # [B, k, V]; -inf outside the draft vocabulary
        K = min(self.cfg.selector_top_k, self.target.vocab_size if vocab is None else int(vocab.numel()))
        values, candidates = logits.topk(K, dim=-1)  # sorted: ties resolve as vLLM's
        selector = self.model.candidate_selector
        scores = selector.edge_scores(candidates, self.model.unary(values), hidden, state.anchors)
        greedy = self.greedy_draft or rows.all_greedy
        tokens, q_k = walk(scores, candidates, None if greedy else rows, None if greedy else rows.draft_uniform(k))
        if q_k is None:
            return DraftProposal.chain(tokens)
        q = q_k.new_zeros(*q_k.shape[:2], self.target.vocab_size).scatter_(2, candidates, q_k)
        return DraftProposal.chain(tokens, q)

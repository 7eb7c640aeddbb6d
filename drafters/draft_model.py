"""A separate, smaller causal LM as the drafter (Leviathan et al. 2023; Chen et al. 2023).

Drafting runs in this library's own loop over a :class:`~specdec.target.Target` wrapping the
draft LM (its own ragged KV cache), never through ``generate()``, whose per-step overhead
doubles a small draft's cost. Each step first feeds the tokens the draft has not seen yet, then
draws ``k`` tokens one at a time from the warped draft distribution, which is returned as ``q``.
Rejected drafts are rolled back out of the draft cache in :meth:`DraftModelDrafter.observe`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from specdec.drafter import Drafter
from specdec.sampling import RowSampling
from specdec.target import Target, TargetSession
from specdec.types import Committed, DraftProposal, padded_ids

__all__ = ["DraftModelDrafter", "DraftModelConfig", "DraftModelState", "transformers_assistant",
           "transformers_peer"]


@dataclass(frozen=True)
class DraftModelConfig:
    model: str = ""  # a name `specdec.models.load_model` resolves, or a local folder
    dtype: str = "float32"
    greedy_draft: bool = False  # argmax drafts (q declared deterministic) even when sampling


@dataclass
class DraftModelState:
    session: TargetSession
    history: list[list[int]]  # every token of each row, the pending next token included
    tentative: int = 0  # draft tokens fed to the draft cache during the last propose


class DraftModelDrafter(Drafter):
    name = "draft_model"
    options_class = DraftModelConfig

    def __init__(self, model: PreTrainedModel, tokenizer=None, greedy_draft: bool = False):
        self.draft = Target(model, tokenizer)
        self.greedy_draft = greedy_draft

    @classmethod
    def create(cls, target: Target, model: PreTrainedModel | str | None = None, tokenizer=None,
               **options: Any) -> DraftModelDrafter:
        """``model``: a loaded ``PreTrainedModel`` (with ``tokenizer``) or a name/folder to load."""
        if isinstance(model, PreTrainedModel):
            d = cls(model, tokenizer, **options)
        else:
            from specdec.models import load_model

            config = DraftModelConfig(model=model or "", **options)
            if not config.model:
                raise ValueError("draft_model needs `model`: a loaded model, a name or a folder")
            model, tokenizer = load_model(config.model, dtype=getattr(torch, config.dtype))
            d = cls(model, tokenizer, config.greedy_draft)
        d.bind(target)
        return d

    def bind(self, target: Target) -> None:
        if self.draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft model vocabulary ({self.draft.vocab_size}) differs from the target's ({target.vocab_size})"
            )
        if self.draft.tokenizer is not None and target.tokenizer is not None:
            if self.draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
                raise ValueError("draft model tokenizer differs from the target's: token ids would not mean the same")
        super().bind(target)

    def start(self, prefill: Committed, rows: RowSampling) -> DraftModelState:
        history = [t[:n] + [x] for t, n, x in zip(prefill.tokens.tolist(), prefill.num_tokens.tolist(),
                                                   prefill.next_tokens.tolist())]
        return DraftModelState(self.draft.new_session(len(history)), history)

    @torch.inference_mode()
    def propose(self, state: DraftModelState, k: int, rows: RowSampling) -> DraftProposal:
        cache = state.session.cache
        cached = cache.lengths.tolist()
        pending = [h[c:] for h, c in zip(state.history, cached)]
        width = max(len(p) for p in pending)
        dev = self.draft.device
        block = padded_ids(pending, width, 0, dev)
        n_pending = torch.tensor([len(p) for p in pending], device=dev)
        out = self.draft.forward(state.session, block, logits_rows=(n_pending - 1).unsqueeze(1))
        self.draft.commit(state.session, torch.arange(width, device=dev).unsqueeze(0) < n_pending.unsqueeze(1))
        tokens, qs = [], []
        logits = out.logits[:, 0]
        for j in range(k):
            if j:
                logits = self.draft.forward(state.session, tokens[-1].unsqueeze(1)).logits[:, 0]
                self.draft.commit(state.session, torch.ones(len(pending), 1, dtype=torch.bool, device=dev))
            x, q = rows.draw(logits, self.greedy_draft)
            tokens.append(x)
            qs.append(q)
        state.tentative = k - 1
        q = None if self.greedy_draft else torch.stack(qs, 1)
        return DraftProposal.chain(torch.stack(tokens, 1).to(self.target.device), q)

    def observe(self, state: DraftModelState, committed: Committed) -> None:
        assert committed.verification is not None
        kept = committed.verification.num_accepted.clamp(max=state.tentative)
        state.session.cache.rollback((state.tentative - kept).to(self.draft.device))
        state.tentative = 0
        for h, toks, n, nxt in zip(state.history, committed.tokens.tolist(), committed.num_tokens.tolist(),
                                   committed.next_tokens.tolist()):
            h.extend(toks[1:n])
            h.append(nxt)
        state.session.cache.maybe_compact()

    def select_rows(self, state: DraftModelState, rows: Tensor) -> None:
        state.session.cache.select_rows(rows.to(self.draft.device))
        state.history[:] = [state.history[i] for i in rows.tolist()]

    @classmethod
    def tiny(cls, target: Target, **overrides: Any) -> DraftModelDrafter:
        from specdec.testing.tiny import tiny_model

        seed = overrides.pop("seed", 1)
        model = tiny_model("llama", vocab_size=target.vocab_size, num_hidden_layers=1, seed=seed,
                           max_position_embeddings=target.max_positions)
        d = cls(model, **overrides)
        d.bind(target)
        return d


def transformers_assistant(model: PreTrainedModel, k: int) -> PreTrainedModel:
    """``model`` as transformers' assistant drafting exactly ``k`` tokens a step. Its candidate
    generators read that count from the assistant's own generation config (``generate()``'s
    ``num_assistant_tokens`` argument is ignored), so a shallow copy (same weights) carries it."""
    assistant = copy.copy(model)
    assistant.generation_config = copy.deepcopy(model.generation_config)
    assistant.generation_config.update(num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                                       assistant_confidence_threshold=0.0)
    return assistant


def transformers_peer(target: Target, drafter: Drafter | None, k: int) -> dict[str, Any]:
    """``generate()`` arguments for transformers' assisted generation with this drafter's own LM."""
    if not isinstance(drafter, DraftModelDrafter):
        raise ValueError("hf_compare 'assistant' runs the draft_model drafter's weights: use drafter=draft_model")
    return {"assistant_model": transformers_assistant(drafter.draft.model, k)}

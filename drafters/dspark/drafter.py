"""DSpark: DFlash's block backbone, causal correction, and confidence-scheduled verification
(DeepSeek-AI, arXiv 2607.05147).

Three changes to DFlash (:mod:`specdec.drafters.dflash.drafter`):

1. **The anchor predicts.** The block ``[anchor, MASK × (γ−1)]`` at positions ``P..P+γ−1`` gives
   base logits ``U_1..U_γ`` from positions ``0..γ−1``: ``γ`` drafts per pass.
2. **Causal correction.** Drafts are drawn left to right from ``U_k`` plus the Markov head's bias
   from ``x_{k−1}`` (:mod:`specdec.drafters.dspark.heads`), each after the same warp as the
   target's; ``q`` is exactly the distribution each token was drawn from. Greedy drafting takes
   the argmaxes in the same order and returns ``q = None``.
3. **Confidences and the prefix scheduler.** The confidence head gives ``c_k`` per draft
   (temperature-calibrated), reported on every proposal (``DraftProposal.confidence``) for any
   draft-length policy. ``scheduler=True`` applies the prefix scheduler
   (:class:`specdec.policy.PrefixPolicy`) to DSpark's own proposals, with a step-cost table
   profiled once at start-up for ``profile_gamma`` drafts a step (default: the trained block's), or
   passed as ``costs``: ``num_valid`` per row from the survival products, and a skipped draft pass
   (an empty proposal, also lossless) while even the best schedule is expected to be slower than
   autoregressive decoding, re-probing after ``probe_every`` steps. Applied here rather than by the
   loop, a policy handed to the loop still stacks on top of it. The same schedule for another
   drafter is ``policy=PrefixPolicy(costs)``. The scheduler is off by default: it makes how many
   tokens a row verifies depend on the other rows, so a row's *random stream* (not its output
   distribution) then depends on its batch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specdec.drafters.dflash.drafter import BlockDrafter, BlockState
from specdec.drafters.dflash.model import BlockDraftModel
from specdec.drafters.dspark.model import DSparkConfig, DSparkModel
from specdec.kernels.markov import markov_chain, markov_sample
from specdec.models import cache_dir
from specdec.policy import PrefixPolicy, StepCosts, pinned_rows, profile_step_costs
from specdec.sampling import RowSampling, SamplingParams
from specdec.target import Target
from specdec.timing import Stopwatch
from specdec.types import Committed, DraftProposal

__all__ = ["DSparkDrafter", "DSparkState"]


@dataclass
class DSparkState(BlockState):
    """DFlash's block state (anchors, pending, cache) plus, under the prefix scheduler, its
    per-run state and each row's request index in the run (rows leave as they finish)."""

    schedule: Any = None
    requests: Tensor | None = None


class DSparkDrafter(BlockDrafter):
    name = "dspark"
    model_class = DSparkModel
    options = ("greedy_draft", "scheduler", "costs", "budget", "ragged", "probe_every", "profile_gamma", "head_dtype",
               "token_map", "draft_vocab")
    tiny_config = {"markov_rank": 4, "block_size": 4, "enable_confidence_head": True}
    model: DSparkModel
    cfg: DSparkConfig

    def __init__(self, model: BlockDraftModel, greedy_draft: bool = False, scheduler: bool = False,
                 costs: StepCosts | str | None = None, budget: int | None = None, ragged: bool = False,
                 probe_every: int = 8, profile_gamma: int | None = None, head_dtype: str = "",
                 token_map: str | Sequence[int] = "", draft_vocab: int = 0):
        if not isinstance(model, DSparkModel):
            raise ValueError("dspark needs a model whose anchor position predicts (DeepSpec / speculators"
                             " sample_from_anchor layout); this looks like a DFlash checkpoint")
        if scheduler and model.confidence_head is None:
            raise ValueError("the prefix scheduler needs a confidence head (enable_confidence_head)")
        super().__init__(model, greedy_draft, head_dtype, token_map, draft_vocab)
        self.scheduler = scheduler
        self.costs = StepCosts.load(costs) if isinstance(costs, (str, Path)) else costs
        self.budget, self.ragged, self.probe_every = budget, ragged, probe_every
        self.profile_gamma = profile_gamma  # the k the costs are profiled at (default: the trained block's drafts)
        self.policy: PrefixPolicy | None = None  # built at bind, once the costs are known

    def bind(self, target: Target) -> None:
        super().bind(target)
        if self.scheduler and self.costs is None:
            self.costs = self.profile(target, gamma=self.profile_gamma)
        if self.scheduler:
            self.policy = PrefixPolicy(self.costs, self.budget, self.ragged, self.probe_every)

    def start(self, prefill: Committed, rows: RowSampling) -> DSparkState:
        s = super().start(prefill, rows)
        B = s.anchors.shape[0]
        if self.policy is None:
            return DSparkState(s.anchors, s.pending, s.cache)
        return DSparkState(s.anchors, s.pending, s.cache, self.policy.start(B), torch.arange(B, device="cpu"))

    def select_rows(self, state: DSparkState, rows: Tensor) -> None:
        super().select_rows(state, rows)
        if state.requests is not None:
            state.requests = state.requests[rows.cpu()]

    # --- drafting -----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, state: DSparkState, k: int, rows: RowSampling) -> DraftProposal:
        B = state.anchors.shape[0]
        scheduled = self.policy is not None and state.requests is not None
        pinned = pinned_rows(self.policy, rows) if scheduled else None  # seeded sampled rows keep every draft
        if scheduled and pinned is None and self.policy.skip(state.schedule, k, state.requests):
            return DraftProposal.empty(B, self.target.device)
        hidden = self.block_hidden(state, k)  # position j drafts the token at P + j + 1
        base = self.target.logits(hidden, self.head_dtype, self.drafted_ids())  # [B, k, V]
        greedy = self.greedy_draft or rows.all_greedy
        u = rows.draft_uniform(k)  # drawn when greedy too: the drafter's stream advances alike
        tokens, q = self._sample(base, state.anchors, hidden, u, rows, greedy)
        conf = None if self.model.confidence_head is None else self.confidences(hidden, state.anchors, tokens)
        proposal = DraftProposal.chain(tokens, q, None, conf)  # conf: advice for a draft-length policy
        if scheduled:
            nv = self.policy.choose(state.schedule, proposal, state.requests)
            if pinned is not None:  # the schedule depends on the batch: a seed pins its row as in any batch
                nv = torch.where(pinned.to(nv.device), proposal.num_valid, nv)
            proposal = proposal.with_num_valid(nv)
        return proposal

    def _sample(self, base: Tensor, anchors: Tensor, hidden: Tensor, u: Tensor, rows: RowSampling,
                greedy: bool) -> tuple[Tensor, Tensor | None]:
        """Left-to-right Markov sampling (:func:`~specdec.kernels.markov.markov_chain`); q is None
        when greedy. On a GPU, the vanilla head with a temperature-only warp runs the fused kernel
        (:func:`~specdec.kernels.markov.markov_sample`, the same sampler)."""
        head = self.model.markov_head
        fused = (head is not None and head.kind == "vanilla" and base.device.type == "cuda" and not greedy
                 and bool((rows.top_k == 0).all()) and bool((rows.top_p >= 1).all()))
        if fused:
            assert head is not None
            return markov_sample(base, anchors, head.markov_w1.weight, head.markov_w2.weight, rows.temperature, u)
        bias = None if head is None else head.sampler_bias(hidden)
        return markov_chain(base, anchors, bias, None if greedy else rows.probs, u)

    def confidences(self, hidden: Tensor, anchors: Tensor, tokens: Tensor) -> Tensor:
        """Calibrated ``c_k`` for drafts ``tokens`` [B, γ] from the block hidden [B, γ, D]. [B, γ]"""
        logits = self.model.confidence_logits(hidden, torch.cat([anchors.unsqueeze(1), tokens[:, :-1]], 1))
        assert logits is not None
        temps = self.cfg.confidence_temperatures
        if temps:
            t = torch.tensor([temps[min(j, len(temps) - 1)] for j in range(logits.shape[1])], device=logits.device)
            logits = logits / t
        return torch.sigmoid(logits)

    # --- start-up profiling -------------------------------------------------------------------
    def profile(self, target: Target, context: int = 32, gamma: int | None = None) -> StepCosts:
        """Profile the verify and draft costs on this machine once (a few seconds); cached under
        ``cache_dir()/step_costs/`` by target, draft config, threads and device."""
        gamma = gamma or self.cfg.num_drafts
        arch = {k: v for k, v in self.cfg.to_dict().items() if k != "confidence_temperatures"}
        key = hashlib.sha1(json.dumps([target.config.to_dict(), arch, torch.get_num_threads(),
                                       str(target.device), context, gamma], sort_keys=True, default=str).encode())
        path = cache_dir() / "step_costs" / f"{key.hexdigest()[:16]}.json"
        gen = torch.Generator().manual_seed(0)
        sessions: dict[int, Any] = {}

        def verify(r: int, w: int) -> float:
            if r not in sessions:  # one prefilled context per batch size, reused
                sessions[r] = target.new_session(r)
                target.prefill(sessions[r], torch.randint(0, target.vocab_size, (r, context), generator=gen).tolist())
            block = torch.randint(0, target.vocab_size, (r, w), generator=gen).to(target.device)
            with Stopwatch(target.device) as sw:
                target.forward(sessions[r], block)
            target.commit(sessions[r], torch.zeros(r, w, dtype=torch.bool))  # holes: the context stays put
            return sw.seconds

        def draft(r: int) -> float:
            feats = torch.randn(r, context, self.model.fc.in_features, generator=gen).to(target.device, target.dtype)
            state = DSparkState(torch.zeros(r, dtype=torch.long, device=target.device), list(feats),
                                self.new_context(r))  # no schedule: the plain draft pass
            rows = RowSampling([SamplingParams(temperature=1.0, seed=0)] * r, target.device)
            self.extend_context(state)
            with Stopwatch(target.device) as sw:
                self.propose(state, gamma, rows)
            return sw.seconds

        with torch.inference_mode():
            return profile_step_costs(verify, draft, widths=(1, 1 + gamma // 2, 1 + gamma), cache=path)

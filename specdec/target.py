"""The target: an adapter over any Hugging Face causal LM.

It runs one forward over a block of new tokens (a chain or a tree, with a tree mask and
per-node positions), captures the residual-stream hidden states a drafter asked for with forward
hooks (only the layers asked for, never the full ``output_hidden_states`` tuple), and keeps the
KV cache ragged across rows (:mod:`specdec.cache`).

Layer-id convention: id ``i`` is the input of decoder layer ``i``; id ``L`` is the output of the
last layer before the final norm. DFlash/DSpark name layers by their *output*; convert with
:func:`layer_output_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from specdec.cache import RaggedCache
from specdec.types import Requirements, chain_parents

__all__ = ["Target", "TargetSession", "TargetOutput", "layer_output_ids"]


def layer_output_ids(ids: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """Convert "output of layer i" ids (DFlash, DSpark) to this library's "input of layer i+1"."""
    return tuple(i + 1 for i in ids)


@dataclass
class TargetOutput:
    logits: Tensor  # [B, m, V] float32
    hidden: dict[int, Tensor] = field(default_factory=dict)  # layer id -> [B, m, D]
    final_hidden: Tensor | None = None  # [B, m, D], post-norm


@dataclass
class TargetSession:
    """The per-generation state of the target: its ragged KV cache."""

    cache: RaggedCache


class Target:
    """Wraps a causal LM; one instance serves many generations (state lives in sessions)."""

    def __init__(self, model: PreTrainedModel, tokenizer=None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        text_config = getattr(self.config, "get_text_config", lambda: self.config)()
        self.text_config = text_config
        self.decoder: nn.Module = model.get_decoder()
        self.layers: nn.ModuleList = self.decoder.layers
        self.final_norm: nn.Module = self.decoder.norm
        self.num_layers = len(self.layers)
        self.hidden_size = int(text_config.hidden_size)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(text_config, "max_position_embeddings", 1 << 30))
        self.layer_types: list[str] | None = getattr(text_config, "layer_types", None)
        self.sliding_window: int | None = getattr(text_config, "sliding_window", None)
        self.requirements = Requirements()
        self._captured: dict[int | str, Tensor] = {}
        self._hooks: list = []

    # --- what the target hands out -------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.config, self.tokenizer):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if eos is None:
                continue
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return ids

    def request(self, req: Requirements) -> None:
        """Capture, from now on, the union of what was asked so far."""
        for i in req.layer_inputs:
            if not 0 <= i <= self.num_layers:
                raise ValueError(f"layer id {i} outside [0, {self.num_layers}] for this {self.num_layers}-layer target")
        self.requirements = self.requirements.union(req)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for i in self.requirements.layer_inputs:
            module = self.layers[i] if i < self.num_layers else self.final_norm
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True))
        if self.requirements.final_hidden:
            self._hooks.append(self.final_norm.register_forward_hook(self._post_hook("final")))

    def _pre_hook(self, key: int):
        def hook(module, args, kwargs):
            self._captured[key] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _post_hook(self, key: str):
        def hook(module, args, output):
            self._captured[key] = output[0] if isinstance(output, tuple) else output
        return hook

    # --- running --------------------------------------------------------------------------
    def new_session(self, batch: int) -> TargetSession:
        return TargetSession(RaggedCache(batch, self.device, self.dtype, self.layer_types, self.sliding_window))

    @torch.inference_mode()
    def forward(self, session: TargetSession, tokens: Tensor, parents: Tensor | None = None,
                logits_rows: Tensor | None = None) -> TargetOutput:
        """One pass over a block of new tokens [B, m] with block-local ``parents`` [B, m].

        ``parents=None`` means a chain. The block is pending until :meth:`commit`.
        ``logits_rows`` [B, m'] picks which block positions need logits (all by default),
        which saves the LM head on a long prefill.
        """
        B, m = tokens.shape
        if parents is None:
            parents = chain_parents(m, B, tokens.device)
        plan = session.cache.plan(parents.to(self.device))
        self._captured = {}
        out = self.decoder(
            input_ids=tokens.to(self.device),
            attention_mask=plan.attention_mask,
            position_ids=plan.position_ids,
            cache=session.cache.kv,
            use_cache=True,
        )
        h = out.last_hidden_state
        if logits_rows is not None:
            h = h.gather(1, logits_rows.to(self.device).unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        logits = self.logits(h)
        hidden = {i: self._captured[i] for i in self.requirements.layer_inputs}
        final = self._captured.get("final")
        self._captured = {}
        return TargetOutput(logits, hidden, final)

    def logits(self, hidden: Tensor) -> Tensor:
        """LM head (with any final soft-capping the model applies) in float32."""
        logits = self.lm_head(hidden)
        cap = getattr(self.text_config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def commit(self, session: TargetSession, keep: Tensor) -> None:
        session.cache.commit(keep.to(self.device))

    def prefill(self, session: TargetSession, prompts: list[list[int]]) -> tuple[TargetOutput, Tensor, Tensor]:
        """Run the prompts, right-padded, and commit them.

        Returns the output (logits at each prompt's last token only, [B, 1, V]; features for
        every prompt token), the padded prompt tokens [B, L] (-1 padded) and their lengths [B].
        """
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        L = int(lengths.max())
        padded = torch.full((len(prompts), L), -1, dtype=torch.long)
        for b, p in enumerate(prompts):
            padded[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        out = self.forward(session, padded.clamp(min=0), logits_rows=(lengths - 1).unsqueeze(1))
        keep = torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)
        self.commit(session, keep)
        return out, padded.to(self.device), lengths.to(self.device)

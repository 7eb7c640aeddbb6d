"""A door from transformers: ``model.generate(..., custom_generate=specdec.custom_generate("ngram"))``.

transformers' ``generate`` accepts a callable as ``custom_generate``: it prepares the inputs and the
generation config as usual, then hands the decoding loop to the callable. :func:`custom_generate`
returns such a callable running specdec's draft → verify loop, so a researcher with an
``AutoModelForCausalLM`` in hand keeps the API they know and gets the target's own output
(greedy: the same tokens; sampled: the same distribution, with temperature, top-k and top-p taken
from the generation config).

Only what the loop reproduces exactly is accepted: logits processors other than temperature,
top-k and top-p (repetition penalty, min-p, bad words ...), beams, streamers and dict outputs
raise a ``ValueError`` naming the setting, before any work starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from specdec.api import make_drafter
from specdec.drafter import Drafter
from specdec.loop import Request, run
from specdec.policy import make_policy
from specdec.registry import drafter_class, verifier_class
from specdec.sampling import SamplingParams
from specdec.target import Target
from specdec.validate import as_int

__all__ = ["custom_generate"]

_EXACT_PROCESSORS = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"}


def custom_generate(drafter: str | None, k: int = 4, verifier: str = "rejection", policy: str | None = None,
                    **drafter_options: Any) -> Callable[..., Tensor]:
    """A decoding loop for ``model.generate(custom_generate=...)`` with the drafter registered as
    ``drafter`` (``None``: plain decoding through the same loop) built with ``drafter_options``;
    ``policy="adaptive"`` chooses per row and step how many of the k drafts to verify
    (:mod:`specdec.policy`).

    The drafter is built once per model, at the first call, through :func:`specdec.make_drafter`
    (checkpoints by name, options checked), and reused, as is the policy (it keeps what it measured).
    """
    k = as_int("k", k, minimum=1)
    chooser = make_policy(policy)
    verifier_cls = verifier_class(verifier)
    if drafter is not None:
        drafter_class(drafter)  # an unknown name fails here, not inside generate()
    bound: dict[int, tuple[Target, Drafter | None]] = {}

    def decode(model, input_ids: Tensor, logits_processor=None, stopping_criteria=None, generation_config=None,
               synced_gpus: bool = False, streamer=None, **model_kwargs: Any) -> Tensor:
        cfg = generation_config
        _check_supported(cfg, logits_processor, streamer)
        if id(model) not in bound:
            target = Target(model)
            bound[id(model)] = (target, make_drafter(drafter, target, **drafter_options) if drafter else None)
        target, draft = bound[id(model)]
        mask = model_kwargs.get("attention_mask")
        keep = mask.bool() if mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        prompts = [row[m].tolist() for row, m in zip(input_ids, keep)]
        max_new = int(cfg.max_length) - input_ids.shape[1]
        if max_new < 1:
            raise ValueError(f"max_length {cfg.max_length} leaves no room after the {input_ids.shape[1]}-token prompt")
        seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()  # follows torch.manual_seed, as transformers does
        sampling = [SamplingParams(float(cfg.temperature), int(cfg.top_k or 0), float(cfg.top_p), seed=s)
                    if cfg.do_sample else SamplingParams() for s in seeds]
        eos = cfg.eos_token_id
        eos_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [int(eos)])
        requests = [Request(p, max_new, s) for p, s in zip(prompts, sampling)]
        result = run(target, draft, verifier_cls(), requests, k=k, eos_token_ids=eos_ids, policy=chooser)
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else (min(eos_ids) if eos_ids else 0)
        width = max(len(r.tokens) for r in result.requests)  # transformers stops once every row is done
        out = torch.full((len(prompts), width), int(pad), dtype=torch.long, device=input_ids.device)
        for b, r in enumerate(result.requests):
            out[b, : len(r.tokens)] = torch.tensor(r.tokens, dtype=torch.long)
        return torch.cat([input_ids, out], dim=1)

    return decode


def _check_supported(cfg, logits_processor, streamer) -> None:
    """Refuse, by name, every generation setting the loop would not reproduce exactly."""
    if cfg is None:
        raise ValueError("custom_generate is called by transformers' generate(), which passes a generation config")
    if streamer is not None:
        raise ValueError("streamer is not supported by specdec's loop")
    if getattr(cfg, "num_beams", 1) != 1 or getattr(cfg, "num_return_sequences", 1) != 1:
        raise ValueError("beam search and num_return_sequences > 1 are not speculative decoding")
    if getattr(cfg, "return_dict_in_generate", False):
        raise ValueError("return_dict_in_generate is not supported: the loop returns token ids")
    extra = sorted({type(p).__name__ for p in (logits_processor or [])} - _EXACT_PROCESSORS)
    if extra:
        raise ValueError(f"these logits processors would change the target's distribution and are not supported: {extra}")

"""The small notebook-facing API: load a target, make a drafter, generate, read the metrics."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.drafter import Drafter
from specdec.kernels.choice import record as kernel_choices
from specdec.loop import Request, RunResult, run
from specdec.metrics import GenerationSummary
from specdec.policy import DraftPolicy, make_policy
from specdec.registry import drafter_class, verifier_class
from specdec.sampling import SamplingParams
from specdec.target import Target, set_threads
from specdec.validate import as_prompt_batch
from specdec.verifier import Verifier

__all__ = ["load_target", "make_drafter", "make_verifier", "generate", "GenerationResult", "encode_messages"]


def load_target(model: str | torch.nn.Module, tokenizer=None, dtype: torch.dtype = torch.float32,
                device_map: str | dict | None = None, threads: int | None = None, compile: bool | str = False,
                fast: bool = True, pack: bool = True, autotune: bool = True, capture: str = "auto") -> Target:
    """A :class:`Target` from a loaded model, an alias such as ``"smollm2-135m"``, or a folder.

    ``threads``: torch's CPU threads (default: :func:`specdec.target.set_threads` picks them from
    the machine unless the user already chose); ``compile``, ``fast``, ``pack`` and ``capture`` (each
    step after the prefill recorded once per shape and replayed: CUDA graphs by default on CUDA, eager
    on a CPU; :mod:`specdec.capture`): see :class:`Target`.
    ``autotune``: on a CPU, tune the few-row plan of the linear layers here, before any timed run
    (:meth:`Target.tune`: read from the on-disk cache and spot-checked, else measured once for this
    machine, about ten seconds for SmolLM2, and cached; never on a busy machine, which keeps the
    heuristic and says so in every summary); ``False`` takes a cached plan or the deterministic
    :data:`specdec.few_rows.HEURISTIC`. Generation never measures.
    """
    if not isinstance(autotune, bool):
        raise TypeError(f"autotune must be a bool, got {type(autotune).__name__}")
    set_threads(threads)
    if isinstance(model, torch.nn.Module):  # a loaded causal LM (a transformers PreTrainedModel)
        target = Target(model, tokenizer, fast=fast, compile=compile, pack=pack, capture=capture)
    else:
        from specdec.models import load_model

        loaded, tok = load_model(model, dtype=dtype, device_map=device_map)
        target = Target(loaded, tokenizer or tok, fast=fast, compile=compile, pack=pack, capture=capture)
    if autotune:
        target.tune()
    return target


def make_drafter(name: str, target: Target, **options: Any) -> Drafter:
    """Build the drafter registered as ``name`` (:mod:`specdec.registry`) bound to ``target``.

    An option the drafter does not take raises ``ValueError`` naming it and the drafter's options
    (:meth:`Drafter.option_names`). A ``checkpoint`` option may be a folder, the name of a committed checkpoint or a hub id
    (:func:`specdec.models.resolve_checkpoint`).
    """
    cls = drafter_class(name)
    _refuse_unknown_options("drafter", name, cls.option_names(), options)
    if options.get("checkpoint"):
        from specdec.models import resolve_checkpoint

        options["checkpoint"] = str(resolve_checkpoint(options["checkpoint"]))
    return cls.create(target, **options)


def make_verifier(name: str, **options: Any) -> Verifier:
    """Build the verifier registered as ``name`` (:mod:`specdec.registry`). An option it does not
    take raises ``ValueError`` naming it and the verifier's options (:meth:`Verifier.option_names`)."""
    cls = verifier_class(name)
    _refuse_unknown_options("verifier", name, cls.option_names(), options)
    return cls(**options)


def _refuse_unknown_options(kind: str, name: str, known: Any, options: dict[str, Any]) -> None:
    """The one check both builders make before any work: every option is one the class takes
    (``known`` None: the class accepts anything)."""
    unknown = sorted(set(options) - set(known)) if known is not None else []
    if unknown:
        raise ValueError(f"{kind} {name!r} has no option {', '.join(map(repr, unknown))};"
                         f" its options are: {', '.join(known) if known else 'none'}")


@dataclass
class GenerationResult:
    texts: list[str] | None
    tokens: list[list[int]]
    run: RunResult

    summary: GenerationSummary

    def to_dict(self) -> dict[str, Any]:
        """Texts, tokens, the summary and every request's metrics, as plain JSON-able values."""
        return {"texts": self.texts, "tokens": self.tokens, "summary": self.summary.to_dict(),
                "requests": [r.metrics.to_dict() for r in self.run.requests]}

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def encode_messages(target: Target, messages: list[dict[str, str]], chat: bool) -> list[int]:
    """Token ids of a conversation that ends in a user turn: the target's chat template (with the
    generation prompt) where it has one and ``chat`` is set, else the turns joined by blank lines."""
    tok = target.tokenizer
    if tok is None:
        raise ValueError("text prompts need a target with a tokenizer; pass token ids instead")
    if chat and getattr(tok, "chat_template", None):
        return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    return tok.encode("\n\n".join(m["content"] for m in messages))


def _encode(target: Target, prompt: str | list[int], chat: bool) -> list[int]:
    if not isinstance(prompt, str):
        return prompt
    return encode_messages(target, [{"role": "user", "content": prompt}], chat)


_SAMPLING_WORDS = ("temperature", "top_k", "top_p", "seed", "do_sample")


def _check_sampling_options(drafter: Drafter | str | None, options: dict[str, Any]) -> None:
    """Sampling settings passed as keywords (``temperature=0.7``) are refused with the argument that
    takes them, unless the named drafter has an option of that name; drafter options without a
    drafter named are refused too (they would be ignored)."""
    own = set(drafter_class(drafter).option_names() or ()) if isinstance(drafter, str) else set()
    misplaced = [w for w in _SAMPLING_WORDS if w in options and w not in own]
    if misplaced:
        given = ", ".join(f"{w}={options[w]!r}" for w in misplaced if w != "do_sample")
        raise ValueError(f"generate() takes sampling settings as sampling=specdec.SamplingParams({given}),"
                         f" not as keywords ({', '.join(misplaced)}); temperature=0 (the default) is greedy")
    if options and not isinstance(drafter, str):
        raise ValueError(f"drafter options {sorted(options)} need a drafter given by name (drafter='ngram', ...);"
                         " a built drafter already has its options")


def generate(target: Target, prompts: str | list[str] | list[list[int]], drafter: Drafter | str | None = None,
             k: int = 4, verifier: Verifier | str = "rejection",
             sampling: SamplingParams | list[SamplingParams] | None = None, max_new_tokens: int = 64,
             chat: bool = False, eos_token_ids: set[int] | None = None, progress: bool | None = None,
             policy: DraftPolicy | str | None = None, timed: bool = False,
             **drafter_options: Any) -> GenerationResult:
    """Speculative generation for one prompt or a batch; ``drafter=None`` decodes autoregressively.

    ``progress``: a tqdm bar of new tokens on stderr; None (default) shows it only when someone is
    watching (:func:`specdec.loop.interactive`: a terminal, not pytest or CI); True or False forces it.
    ``policy="adaptive"`` verifies, per row and step, only as many of the (up to ``k``) drafts as
    pay (:mod:`specdec.policy`); None verifies every proposed node. ``timed`` synchronises the
    device at every phase boundary (an exact time split on a GPU). Sampling is
    ``sampling=SamplingParams(temperature=..., top_k=..., top_p=..., seed=...)`` (one for the batch or
    one per prompt); ``temperature=`` as a keyword is refused with that pointer.
    """
    _check_sampling_options(drafter, drafter_options)
    prompts = as_prompt_batch(prompts)
    policy = make_policy(policy)
    if isinstance(drafter, str):
        drafter = make_drafter(drafter, target, **drafter_options)
    if isinstance(verifier, str):
        verifier = make_verifier(verifier)
    params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling settings for {len(prompts)} prompts")
    requests = [Request(_encode(target, p, chat), max_new_tokens, s) for p, s in zip(prompts, params)]
    result = run(target, drafter, verifier, requests, k=k, eos_token_ids=eos_token_ids, progress=progress,
                 policy=policy, timed=timed)
    tokens = [r.tokens for r in result.requests]
    texts = [target.tokenizer.decode(t, skip_special_tokens=True) for t in tokens] if target.tokenizer else None
    summary = GenerationSummary.of([r.metrics for r in result.requests], result.metrics,
                                   drafter.name if drafter is not None else None, verifier.name, verifier.lossless,
                                   k if drafter is not None else 0,
                                   policy.name if policy is not None and drafter is not None else None,
                                   few_rows=target.row_plan_record(), kernels=kernel_choices(),
                                   capture=target.capture_mode)
    return GenerationResult(texts, tokens, result, summary)

"""Drafters, chosen by name. Every entry provides ``tiny(target)`` for the conformance suite.

| name | needs from the target | proposes |
|---|---|---|
| ``ngram`` | tokens only | prompt lookup, deterministic chain |
| ``suffix`` | tokens only | SuffixDecoding: suffix trees over the prompt and earlier outputs, frequency-scored deterministic tree |
| ``draft_model`` | nothing (own LM, same vocabulary) | ``k`` sequential samples, exact q |
| ``gemma_mtp`` | post-norm final hidden, the target's KV cache | Gemma-4 assistant: Q-only layers on the target's K/V, ``k`` steps at one position |
| ``mtp`` | post-norm final hidden state | DeepSeek-V3 MTP/NextN modules, reused past their depth; chain (exact q) or top-k tree |
| ``eagle3`` | inputs of 3 target layers (embedding shared) | EAGLE-3 head, reduced vocabulary; chain (exact q), static tree (sampled without replacement) or EAGLE-2 dynamic tree |
| ``dflash`` | m layer outputs (context K/V), embeddings, LM head | one non-causal block pass: ``k`` drafts, independent given the block (exact q) |
| ``dflash2`` | as ``dflash`` | the block pass with grouped dynamic convolutions, then a walk through the top-K candidates per slot scored by a low-rank bilinear selector (exact q over the candidates) |
| ``dspark`` | as ``dflash`` | one block pass (the anchor predicts too) + Markov-corrected left-to-right sampling (exact q); confidences for the prefix scheduler |
| ``hybrid`` | what its two parts need | per row and step, a model-free part's (suffix) or a learned part's (EAGLE-3) proposal, whichever is expected to get more accepted (or vLLM's ngram-first rule) |
"""

if __name__ != "specdec.drafters":  # the bare name `drafters` belongs to another PyPI package
    raise ImportError(
        "the folder drafters/ of the specdec repository was imported as the top-level package 'drafters':"
        " Python is running with the repository root on sys.path (python -m or a REPL started there),"
        " where the folder shadows the PyPI package of that name. Import it as specdec.drafters, and run"
        " from another directory or use the installed commands (specdec-demo, pytest)."
    )

from specdec.drafter import Drafter
from specdec.drafters.dflash.drafter import DFlashDrafter
from specdec.drafters.dflash2.drafter import DFlash2Drafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle3.drafter import Eagle3Drafter
from specdec.drafters.dspark.drafter import DSparkDrafter
from specdec.drafters.gemma_mtp.drafter import GemmaMTPDrafter
from specdec.drafters.hybrid.drafter import HybridDrafter
from specdec.drafters.mtp.drafter import MTPDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix.drafter import SuffixDrafter

DRAFTERS: dict[str, type[Drafter]] = {
    "ngram": NgramDrafter,
    "suffix": SuffixDrafter,
    "draft_model": DraftModelDrafter,
    "gemma_mtp": GemmaMTPDrafter,
    "mtp": MTPDrafter,
    "eagle3": Eagle3Drafter,
    "dflash": DFlashDrafter,
    "dflash2": DFlash2Drafter,
    "dspark": DSparkDrafter,
    "hybrid": HybridDrafter,
}

__all__ = ["DRAFTERS", "Drafter", "NgramDrafter", "DraftModelDrafter", "GemmaMTPDrafter", "MTPDrafter", "Eagle3Drafter", "DFlashDrafter",
           "DFlash2Drafter", "DSparkDrafter", "SuffixDrafter", "HybridDrafter"]

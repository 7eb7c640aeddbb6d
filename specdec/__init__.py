"""specdec: pluggable speculative-decoding drafters, one draft → verify loop, proven lossless.

    import specdec
    target = specdec.load_target("smollm2-135m")
    out = specdec.generate(target, "Repeat this code: ...", drafter="ngram", k=8)
    out.texts, out.summary
"""

from specdec.api import GenerationResult, generate, load_target, make_drafter, make_verifier
from specdec.loop import Request, run
from specdec.sampling import SamplingParams
from specdec.target import Target
from specdec.types import Committed, DraftProposal, Requirements, Verification

__all__ = [
    "Committed", "DraftProposal", "GenerationResult", "Request", "Requirements", "SamplingParams", "Target",
    "Verification", "generate", "load_target", "make_drafter", "make_verifier", "run",
]

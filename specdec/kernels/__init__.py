"""Fused Triton kernels for the draft → verify hot path, each beside an exact torch reference.

Importable as ``specdec.kernels`` only. The library runs without Triton: every kernel has a
pure-torch reference that is the default on CPU, and :mod:`specdec.kernels.dispatch` picks the
path (``SPECDEC_KERNELS=auto|torch|triton``). Triton itself is imported only when a Triton path
runs. See ``docs/kernels.md``.
"""

from specdec.kernels.compaction import gather_slots, gather_slots_reference
from specdec.kernels.dispatch import backend_for, platform, triton_available, use_backend
from specdec.kernels.markov import markov_chain, markov_sample, markov_sample_reference
from specdec.kernels.norm_concat_linear import (fused_norm_concat_linear, norm_concat_linear,
                                                norm_concat_linear_reference, rms_norm_params)
from specdec.kernels.rejection import argmax_walk, rejection_sample, rejection_sample_reference

__all__ = ["backend_for", "platform", "triton_available", "use_backend",
           "rejection_sample", "rejection_sample_reference", "argmax_walk",
           "fused_norm_concat_linear", "norm_concat_linear", "norm_concat_linear_reference", "rms_norm_params",
           "markov_chain", "markov_sample", "markov_sample_reference",
           "gather_slots", "gather_slots_reference"]

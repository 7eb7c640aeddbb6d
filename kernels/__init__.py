"""Fused Triton kernels for the draft → verify hot path, each beside an exact torch reference.

Importable as ``specdec.kernels`` only. The library runs without Triton: every kernel has a
pure-torch reference that is the default on CPU.
"""

if __name__ != "specdec.kernels":  # the bare name `kernels` belongs to another PyPI package
    raise ImportError("import this package as specdec.kernels")

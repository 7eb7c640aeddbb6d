"""Fused Triton kernels for the draft → verify hot path, each beside an exact torch reference.

Importable as ``specdec.kernels`` only. The library runs without Triton: every kernel has a
pure-torch reference that is the default on CPU.
"""

if __name__ != "specdec.kernels":  # the bare name `kernels` belongs to another PyPI package
    raise ImportError(
        "the folder kernels/ of the specdec repository was imported as the top-level package 'kernels':"
        " Python is running with the repository root on sys.path (python -m or a REPL started there),"
        " where the folder shadows the PyPI package of that name. Import it as specdec.kernels, and run"
        " from another directory or use the installed commands (specdec-demo, pytest)."
    )

"""Run one module of ``experiments/benchmarks/``: ``python experiments/bench.py <module> [options]``.

    .venv/bin/python experiments/bench.py acceptance --preset drafters_mtbench --k 1 4
    .venv/bin/python experiments/bench.py gpu --out /tmp/gpu --dry-run        # (make gpu-bench)

The modules and what each measures: ``experiments/benchmarks/__init__.py``. Run it by path from the
repository root (a bare checkout on a GPU machine too: ``gpu`` finds the source tree itself).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/: the benchmarks package

import benchmarks  # noqa: E402


def main() -> int | None:
    names = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__))
    if len(sys.argv) < 2 or sys.argv[1] not in names:
        sys.exit(f"usage: python experiments/bench.py <module> [options]; modules: {', '.join(names)}")
    name = sys.argv[1]
    sys.argv = [f"{sys.argv[0]} {name}", *sys.argv[2:]]  # each module parses its own options
    return importlib.import_module(f"benchmarks.{name}").main()


if __name__ == "__main__":
    sys.exit(main())

"""Print the vLLM and SGLang settings that serve an EAGLE-3 checkpoint the way specdec drafts with it.

    .venv/bin/python experiments/run.py --config-name lab/eagle3_serving checkpoint=experiments/checkpoints/smollm2-135m-eagle3 k=5
    .venv/bin/python experiments/run.py --config-name lab/eagle3_serving checkpoint=<folder> tree=static k=4 \
        'static_tree="[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]"'
    .venv/bin/python experiments/run.py --config-name lab/eagle3_serving checkpoint=<folder> tree=dynamic k=5 top_k=4 budget=16

The folder must hold a speculators-format checkpoint (what ``save_eagle3`` and
the EAGLE-3 recipe of ``experiments/run.py --config-name train/smollm2_eagle3`` writes); the verifier it names is the target to serve.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec.drafters.eagle3.checkpoint import serving_config


def serve(checkpoint: str, k: int = 3, tree: str = "chain", static_tree: str | None = None, top_k: int = 4,
          budget: int = 16) -> None:
    """Mode ``eagle3_serving``: print the vLLM and SGLang commands that serve ``checkpoint`` with this
    chain or tree (``tree``: chain, static or dynamic)."""
    if tree not in ("chain", "static", "dynamic"):
        raise SystemExit(f"tree must be chain, static or dynamic, got {tree!r}")
    folder = Path(checkpoint).resolve()
    cfg = json.loads((folder / "config.json").read_text())
    verifier = (cfg.get("speculators_config") or {}).get("verifier", {}).get("name_or_path") or "<target>"
    s = serving_config(folder, k, tree, static_tree, top_k, budget)
    print(f"vllm serve {verifier} {s['vllm']}")
    print(f"python -m sglang.launch_server --model-path {verifier} {s['sglang']}")
    if s["note"]:
        print(f"# {s['note']}")

"""Print the vLLM and SGLang settings that serve an EAGLE-3 checkpoint the way specdec drafts with it.

    .venv/bin/python experiments/bench.py eagle3_serving experiments/checkpoints/smollm2-135m-eagle3 --k 5
    .venv/bin/python experiments/bench.py eagle3_serving <folder> --tree static --k 4 \
        --static-tree "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]"
    .venv/bin/python experiments/bench.py eagle3_serving <folder> --tree dynamic --k 5 --top-k 4 --budget 16

The folder must hold a speculators-format checkpoint (what ``save_eagle3`` and
the EAGLE-3 recipe of ``experiments/train.py`` write); the verifier it names is the target to serve.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.drafters.eagle3.checkpoint import serving_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--k", type=int, default=3, help="chain length or tree depth")
    ap.add_argument("--tree", default="chain", choices=["chain", "static", "dynamic"])
    ap.add_argument("--static-tree", default=None)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--budget", type=int, default=16)
    args = ap.parse_args()
    folder = Path(args.checkpoint).resolve()
    cfg = json.loads((folder / "config.json").read_text())
    verifier = (cfg.get("speculators_config") or {}).get("verifier", {}).get("name_or_path") or "<target>"
    s = serving_config(folder, args.k, args.tree, args.static_tree, args.top_k, args.budget)
    print(f"vllm serve {verifier} {s['vllm']}")
    print(f"python -m sglang.launch_server --model-path {verifier} {s['sglang']}")
    if s["note"]:
        print(f"# {s['note']}")


if __name__ == "__main__":
    main()

"""``specdec-autotune``: tune a target's few-row plan for this machine ahead of any timed run.

The command line of :func:`specdec.few_rows.autotune`. It loads the target through
:func:`specdec.load_target`, which sits above the target adapter, so it lives apart from
:mod:`specdec.few_rows` (which the adapter imports).
"""

from __future__ import annotations

import argparse
import json
import sys

from specdec.api import load_target
from specdec.few_rows import autotune, cache_file, describe, plan_key, plan_record

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """Tune (or, with ``--force``, re-tune) a target's few-row plan for this machine and print it with
    the cache file, so that no later run measures. Exit status 1 when it refused to tune (a busy
    machine, passes that disagree): the line on stderr says why."""
    ap = argparse.ArgumentParser(prog="specdec-autotune", description=main.__doc__)
    ap.add_argument("--model", default="smollm2-135m", help="an alias or a folder (default: smollm2-135m)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: chosen from the machine)")
    ap.add_argument("--no-pack", action="store_true", help="never consider oneDNN's packed copies")
    ap.add_argument("--force", action="store_true", help="measure again even when a plan is cached")
    args = ap.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be at least 1, got {args.threads}")
    target = load_target(args.model, threads=args.threads, pack=not args.no_pack, autotune=False)
    autotune(target.model, packed=target.pack, force=args.force)
    key = plan_key(target.model, target.pack)
    record = plan_record(target.model, packed=target.pack)
    print(json.dumps({**record, "key": key, "file": str(cache_file(key))}, indent=1))
    print(f"few-row plan: {describe(record)}", file=sys.stderr)  # its age, how it was measured, why
    if record["note"].startswith("not tuned"):  # busy, or the passes disagreed: say so to a script too
        raise SystemExit(1)


if __name__ == "__main__":
    main()

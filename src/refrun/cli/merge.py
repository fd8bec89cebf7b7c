"""``refrun merge SOURCE --into TARGET``: copy the runs of one store into another (a store
recorded on a machine without network, brought back; docs/offline-install.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from refrun.store.merge import merge


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("merge", help="copy the runs of one store into another")
    p.add_argument("source", metavar="SOURCE",
                   help="the store to copy from: an MLflow URI (sqlite:///PATH) or a .db file")
    p.add_argument("--into", required=True, metavar="TARGET",
                   help="the store to copy into: sqlite:///PATH, http(s)://HOST:PORT ...")
    p.add_argument("--artifacts-root", type=Path, default=None, metavar="DIR",
                   help="where the source's artifact folders lie now when they moved with "
                        "the store (default: the store file's folder)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    result = merge(args.source, args.into, args.artifacts_root)
    for r in result.runs:
        print(f"{r.outcome:<9} {r.source_id} -> {r.target_id or '-'}  {r.detail}")
    merged, present, left = (result.count(o) for o in ("merged", "present", "left out"))
    print(f"{merged} merged, {present} already there, {left} left out")
    # Runs left out (unfinished, no curves artifact): 2, not 1, which only ever means a
    # negative verdict (docs/reliability.md, "Exit codes").
    return 2 if left else 0

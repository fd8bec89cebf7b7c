"""``refrun sync``: deliver spooled points of runs whose process ended before delivery."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from refrun.recording.sync import sync_all
from refrun.settings import settings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sync", help="deliver spooled points to the tracking store")
    p.add_argument("--spool-dir", type=Path, default=None,
                   help="spool root (default: $REFRUN_SPOOL_DIR or ./.refrun/spool)")
    p.add_argument("--keep", action="store_true",
                   help="keep spools that are completely delivered (default: delete them)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    root = args.spool_dir or settings().spool_root
    results = sync_all(root, prune=not args.keep)
    if not results:
        print(f"nothing to sync in {root}")
        return 0
    failed = 0
    stores: dict[str, int] = {}  # one line per unusable store, not one per spool
    for r in results:
        if r.outcome == "store":
            stores[r.detail] = stores.get(r.detail, 0) + 1
            continue
        print(f"{r.local_id}  {r.outcome:<10} run={r.run_id or '-'}  points={r.points}  {r.detail}")
        failed += r.outcome == "error"
    for cause, n in stores.items():
        print(f"refrun sync: error: {cause} ({n} spool{'s' if n > 1 else ''} kept; run "
              "`refrun sync` again once the store is usable)", file=sys.stderr)
    # 2, not 1: a spool that could not be delivered is not a negative verdict on anything
    # (exit 1 is kept for "the candidate failed"; docs/reliability.md, "Exit codes").
    return 2 if stores or failed else 0

"""The command line every pipeline's gradient check shares
(``python -m pipelines.<workload>.gradcheck``): which port, with which defects, seed and
device count, was the candidate run, and where to record the check."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence


def parse(argv: Sequence[str] | None, description: str,
          port_defects: Mapping[str, Sequence[str]], devices_help: str,
          several_devices: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed options; a defect the port does not have, or several devices for a port
    not in ``several_devices`` (None: any port, the check itself runs on one), is a usage
    error (exit 2) naming it."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--backend", required=True, choices=tuple(port_defects))
    ap.add_argument("--seed", type=int, required=True, help="the candidate's seed (weights)")
    ap.add_argument("--devices", type=int, default=1, help=devices_help)
    ap.add_argument("--defect", action="append", default=[],
                    help="the candidate's defects (as trained)")
    ap.add_argument("--candidate", required=True, help="the candidate's run id")
    ap.add_argument("--quick", action="store_true", help="the [quick] configuration")
    ap.add_argument("--tracking-uri", default=None)
    ap.add_argument("--spool-dir", default=None, help="accepted and unused (a complete run)")
    ns = ap.parse_args(argv)
    bad = [d for d in ns.defect if d not in port_defects[ns.backend]]
    if bad:
        ap.error(f"--defect {', '.join(bad)}: not a defect of {ns.backend}")
    if ns.devices < 1 or (ns.devices > 1 and several_devices is not None
                          and ns.backend not in several_devices):
        ap.error(f"--devices {ns.devices}: the {ns.backend} check runs on one device")
    return ns


def report(candidate: str, run_id: str | None, passed: bool) -> int:
    """Say what was recorded for ``candidate``; the check's outcome is data, so exit 0."""
    print(f"[gradcheck] run {run_id} for candidate {candidate}: "
          f"{'passed' if passed else 'FAILED'}", flush=True)
    return 0

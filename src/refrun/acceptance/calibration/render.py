"""Rendering a calibration as a criteria file (TOML with its provenance and power
statement in comments) and writing it atomically after the ordinary loader accepted it."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from refrun._version import __version__
from refrun.acceptance.criteria import (
    CriteriaSettings,
    Prices,
    parse_criteria,
)

if TYPE_CHECKING:  # annotations only: derive imports this module
    from refrun.acceptance.calibration.derive import Calibrated

METHOD = ("held-out seeds: each reference seed judged against groups of the others; "
          "threshold = max(worst trial, mean + k s) of what the held-out trials needed, k the "
          "one-sided normal tolerance factor for N seeds (coverage 1 - false_alarm_rate / "
          "criteria, confidence); a per-step envelope's k capped by the Student-t prediction "
          "bound of one new seed")


def clean_float(x: float) -> float:
    return float(f"{x:.6g}")


# --- TOML ----------------------------------------------------------------------------------
def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"not a finite number: {v}")
        return repr(clean_float(v))
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml(x)}" for k, x in v.items()) + " }"
    raise TypeError(type(v))


def _toml_key(k: str) -> str:
    """A table key: bare when TOML allows it, else quoted (a hardware name such as
    ``a100.80gb`` written bare would be a dotted key: a nested table)."""
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k, ensure_ascii=False)


def _comment(text: str) -> list[str]:
    import textwrap

    return [f"# {ln}" for ln in textwrap.wrap(text, 88)] or ["#"]


def render(c: Calibrated) -> str:
    """The criteria file of a calibration: a header, ``[calibration]``, ``[settings]`` and
    one commented ``[[criteria]]`` table per criterion."""
    o = c.options
    lines = [f"# Criteria of workload {c.workload!r} written by `refrun calibrate` "
             f"(refrun {__version__}, {c.created_utc}).", "#"]
    lines += _comment(f"Every threshold comes from held-out validation over {len(c.run_ids)} "
                      f"reference seeds: each seed judged against groups of {c.group_size} "
                      f"of the others (use {c.group_size} references with `refrun accept`). "
                      f"Target false-alarm rate {o.false_alarm_rate:g} for the whole file "
                      f"(coverage 1 - {o.false_alarm_rate:g}/{len(c.criteria)} per "
                      f"criterion), tolerance limits at confidence {o.confidence:g}.")
    lines += ["#", "# Power (the smallest shift each criterion detects with these seeds):"]
    for d in c.criteria:
        lines += _comment(f"  {d.id}: {d.detectable}")
    if c.outliers:
        lines += ["#", "# Outlier reference seeds:"]
        for out in c.outliers:
            lines += _comment(f"  {out.text()}")
    if c.notes:
        lines += ["#", "# Notes:"]
        for note in c.notes:
            lines += _comment(f"  {note}")
    if c.skipped:
        lines += ["#", "# Metrics without a criterion:"]
        for m, why in c.skipped.items():
            lines += _comment(f"  {m}: {why}")
    lines += ["#", "# Re-measure with: refrun calibrate --check THIS_FILE --reference "
              + " ".join(c.run_ids[:3]) + (" ..." if len(c.run_ids) > 3 else ""),
              "version = 1", f"workload = {_toml(c.workload)}",
              f"description = {_toml(f'calibrated from {len(c.run_ids)} reference seeds')}",
              "", "[calibration]", f"method = {_toml(METHOD)}", f"runs = {_toml(c.run_ids)}",
              f"n = {len(c.run_ids)}", f"group_size = {c.group_size}",
              f"backend = {_toml(c.backend)}",
              f"false_alarm_rate = {_toml(float(o.false_alarm_rate))}",
              f"confidence = {_toml(float(o.confidence))}", f"date = {_toml(c.created_utc)}",
              f"refrun_version = {_toml(__version__)}"]
    if o.require_gradcheck:
        lines.append("require_gradcheck = true")
    if c.outliers:
        lines.append(f"outliers = {_toml([x.run_id for x in c.outliers])}")
        lines.append(f"outliers_excluded = {_toml(any(x.excluded for x in c.outliers))}")
    # The header's power lines as data: `refrun accept` prints them beside a verdict.
    lines += ["", "[calibration.power]"]
    lines += [f"{_toml(d.id)} = {_toml(d.detectable)}" for d in c.criteria]
    lines.append("")
    settings = {k: v for k, v in asdict(o.settings).items()
                if v != getattr(CriteriaSettings(), k)}
    lines += ["[settings]"] + [f"{k} = {_toml(v)}" for k, v in settings.items()] + [""]
    if c.loss_metric is not None:  # the training loss is not called `loss`
        lines += ["[l0]", f"loss_metric = {_toml(c.loss_metric)}", ""]
    if o.prices != Prices():  # refrun calibrate --price: what cost criteria price runs with
        lines += ["[prices]", f"currency = {_toml(o.prices.currency)}",
                  f"per = {_toml(o.prices.per)}", f"hourly = {_toml(dict(o.prices.hourly))}",
                  ""]
    for d in c.criteria:
        lines += _comment(f"{d.id}: " + "; ".join(d.comment))
        lines.append("[[criteria]]")
        lines += [f"{k} = {_toml(v)}" for k, v in d.table.items()]
        lines.append("")
    return "\n".join(lines)


def write_file(c: Calibrated, path: str) -> str:
    """Write the calibrated file atomically after checking it loads (nothing half-written)."""
    from refrun.util.outputs import write_output

    text = c.text()
    parse_criteria(text, path)  # the file must load with the ordinary loader
    write_output(path, text, "--output")
    return text

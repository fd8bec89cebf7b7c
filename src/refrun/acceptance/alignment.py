"""Which axis an assessment aligned runs on, and where that choice came from.

A criteria file may fix the axis (``[settings] axis = "samples"``); ``refrun accept
--axis`` may give one too.  The rule (a verdict must never silently change its basis):

* only the file gives it -> the file's axis (source ``criteria``);
* only ``--axis`` gives it -> that axis (source ``--axis``);
* both give the same axis -> that axis (source ``criteria``: the file alone gives it);
* both give different axes -> :class:`RefrunInputError` naming the file, line and key;
* neither -> ``step`` (source ``default``; also for ``--axis step`` with a file that writes
  no axis: the basis is the default's).

The chosen axis is recorded in the assessment (``alignment``), and a re-assessment (a
sign-off's check) applies the recorded axis again, so the verdict is reproduced on the
same basis.
"""

from __future__ import annotations

import dataclasses
import tomllib
from typing import Any, Literal

from refrun import schema
from refrun.acceptance.criteria import CriteriaFile, locate
from refrun.errors import RefrunInputError
from refrun.schema import AXES

AxisSource = Literal["criteria", "--axis", "default"]
DEFAULT_AXIS = "step"


def file_axis(crit: CriteriaFile) -> str | None:
    """The axis the criteria file's text writes in ``[settings]``, None when it writes none
    (the loaded settings cannot tell a written ``step`` from the default)."""
    try:
        settings = tomllib.loads(crit.text).get("settings") if crit.text else None
    except tomllib.TOMLDecodeError:  # a loaded file parsed already; a bare test object
        return None
    axis = settings.get("axis") if isinstance(settings, dict) else None
    return axis if isinstance(axis, str) else None


def with_axis(crit: CriteriaFile, axis: str | None) -> CriteriaFile:
    """``crit`` aligning on ``axis`` (``--axis``; None: unchanged).  Raises
    :class:`RefrunInputError` (file:line, key) when the file writes another axis."""
    if axis is None:
        return crit
    if axis not in AXES:
        raise RefrunInputError(f"--axis {axis!r}: not one of {', '.join(AXES)}")
    written = file_axis(crit)
    if written is not None and written != axis:
        line = locate(crit.text.splitlines(), ("settings", "axis"))
        where = f"{crit.path}:{line}" if line else crit.path
        raise RefrunInputError(f"{where}: [settings] axis = {written!r} conflicts with --axis "
                               f"{axis}; a verdict never changes its basis silently (edit the "
                               "file or drop --axis)")
    return dataclasses.replace(crit, settings=dataclasses.replace(crit.settings, axis=axis))


def alignment_of(crit: CriteriaFile) -> dict[str, str]:
    """``{"axis": ..., "source": ...}`` for the assessment: the axis ``crit`` aligns on and
    where it came from (an axis the text does not write was given by ``--axis``)."""
    axis = crit.settings.axis
    written = file_axis(crit)
    source: AxisSource
    if written is not None:
        source = "criteria"
    elif axis != DEFAULT_AXIS:
        source = "--axis"
    else:
        source = "default"
    return {"axis": axis, "source": source}


def recorded_axis(assessment: dict[str, Any]) -> str | None:
    """The axis a recorded assessment (``refrun/assessment.json``) was given by ``--axis``
    (None when it came from the file or the default: re-reading the file gives it)."""
    al = assessment.get("alignment")
    if isinstance(al, dict) and al.get("source") == "--axis":
        return al.get("axis")
    return None


def batch_hint(axis: str, candidate: tuple[int | None, int | None],
               references: list[tuple[int | None, int | None]]) -> str:
    """One line when runs aligned by step process different amounts of data per step,
    else "".  Each run is ``(global batch, tokens per sample)`` (the ``refrun.global_batch``
    and ``refrun.tokens_per_sample`` tags; None where not tagged).  On the step axis, step n
    of a candidate with twice the references' global batch has seen twice their samples:
    its curves are compared at another point of training than the user means, and
    ``--axis samples`` (or ``tokens``) compares them at equal data seen.  Tokens per step
    (batch x tokens per sample) are compared when every run has both tags and the global
    batches agree.  Runs without the tags say nothing (no hint)."""
    if axis != "step" or not references or candidate[0] is None \
            or any(b is None for b, _ in references):
        return ""
    ref_b = sorted({b for b, _ in references if b is not None})
    if ref_b != [candidate[0]]:
        return (f"the candidate's global batch ({schema.TAG_GLOBAL_BATCH}) is "
                f"{candidate[0]}, the references' {', '.join(map(str, ref_b))}, and runs are "
                "aligned by step: step n of each has seen different numbers of samples; "
                "--axis samples compares them at equal samples seen")
    if candidate[1] is None or any(t is None for _, t in references):
        return ""
    ref_t = sorted({b * t for b, t in references if b is not None and t is not None})
    cand_t = candidate[0] * candidate[1]
    if ref_t != [cand_t]:
        return (f"the candidate processes {cand_t} tokens per step, the references "
                f"{', '.join(map(str, ref_t))} ({schema.TAG_GLOBAL_BATCH} x "
                f"{schema.TAG_TOKENS_PER_SAMPLE}), and runs are aligned by step; "
                "--axis tokens compares them at equal tokens seen")
    return ""

"""Evaluating stopping rules periodically: from inside a training loop (:class:`Watcher`)
or from another process (:func:`watch_run`, used by ``refrun watch``).

Inside the loop, :meth:`Watcher.check` never blocks the step: it only starts a background
thread when ``every_s`` has passed, and that thread reads the run's own spool (the points
written so far), evaluates the rules and records each triggered rule as a run warning.
It never stops the run: the decision stays with a person.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from refrun import identity
from refrun.acceptance.criteria import CriteriaFile, load_criteria
from refrun.acceptance.stopping import StopReport, evaluate_stopping
from refrun.comparison import RunData, load_run
from refrun.comparison.loading import dense_counters, sparse_counters

if TYPE_CHECKING:  # a reader never loads the recording stack: the session is handed in
    from refrun.recording.session import RunSession


def session_snapshot(session: RunSession) -> RunData:
    """The points a live session has written to its spool so far, as a RUNNING run."""
    meta = session.spool.read_meta()
    curves = dense_counters(session.spool.read_all(), sparse_counters(meta.tags))
    rd = RunData.from_curves(curves, run_id=meta.run_id or session.local_id, tags=meta.tags,
                             params=meta.params)
    return RunData(run_id=rd.run_id, tags=rd.tags, params=rd.params, status="RUNNING",
                   start_time_ms=meta.start_ms, end_time_ms=None, curves=rd.curves,
                   source="spool")


class Watcher:
    """Stopping rules checked every ``every_s`` seconds from inside a training loop::

        watcher = Watcher("criteria.toml", run, references=[ref_id], every_s=60)
        for step in ...:
            ...
            report = watcher.check()      # returns at once; the latest report or None
            if report and report.investigate: ...   # e.g. page someone, save a checkpoint
    """

    def __init__(self, criteria: str | Path | CriteriaFile, session: RunSession,
                 references: Sequence[str | RunData] = (), every_s: float = 60.0,
                 tracking_uri: str | None = None,
                 on_investigate: Callable[[StopReport], None] | None = None) -> None:
        self.criteria = criteria if isinstance(criteria, CriteriaFile) else load_criteria(criteria)
        self.session = session
        self.every_s = every_s
        self.on_investigate = on_investigate
        self.latest: StopReport | None = None
        self.error: BaseException | None = None
        self._refs_in = list(references)
        self._refs: list[RunData] | None = None
        self._uri = tracking_uri or session.tracking_uri
        self._last = 0.0
        self._thread: threading.Thread | None = None

    def check(self) -> StopReport | None:
        """Start an evaluation if one is due (never waits for it); the latest report."""
        now = time.monotonic()
        if now - self._last >= self.every_s and not (self._thread and self._thread.is_alive()):
            self._last = now
            self._thread = threading.Thread(target=self._evaluate, daemon=True,
                                            name="refrun-watcher")
            self._thread.start()
        return self.latest

    def wait(self, timeout: float | None = None) -> StopReport | None:
        """Wait for a running evaluation (outside the training step, e.g. at the end)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.latest

    def _evaluate(self) -> None:
        try:
            if self._refs is None:
                self._refs = [r if isinstance(r, RunData) else
                              load_run(r, tracking_uri=self._uri, progress=False)
                              for r in self._refs_in]
            report = evaluate_stopping(self.criteria, session_snapshot(self.session), self._refs)
            self.latest = report
            for f in report.investigate:
                self.session.warn_once(f"stopping:{f.id}", f"stopping rule {f.id!r} says "
                                       f"investigate: {f.reason}")
            if report.investigate and self.on_investigate is not None:
                self.on_investigate(report)
        except BaseException as exc:  # a watcher must never take training down
            self.error = exc


def watch_run(crit: CriteriaFile, run_id: str, reference_ids: Sequence[str] = (),
              every_s: float = 60.0, max_checks: int | None = None,
              tracking_uri: str | None = None,
              on_report: Callable[[StopReport], None] | None = None,
              allow_cross_workload: bool = False,
              on_note: Callable[[str], None] | None = None) -> StopReport:
    """Evaluate the rules on a run in the store every ``every_s`` seconds until it is no
    longer RUNNING or ``max_checks`` evaluations were made; returns the last report.

    The run's workload must match the criteria file's and the references' (the rule of
    ``refrun accept``, :func:`refrun.identity.check_workloads`): otherwise
    :class:`~refrun.errors.RefrunInputError` before the first evaluation, unless
    ``allow_cross_workload`` (then ``on_note`` gets the one-line note)."""
    refs = [load_run(r, tracking_uri=tracking_uri, progress=False) for r in reference_ids]
    checks = 0
    while True:
        run = load_run(run_id, tracking_uri=tracking_uri, progress=False, allow_partial=True)
        if checks == 0:
            note = identity.check_workloads(run, refs, crit.workload, crit.path,
                                            allow=allow_cross_workload)
            if note and on_note is not None:
                on_note(note)
        report = evaluate_stopping(crit, run, refs)
        checks += 1
        if on_report is not None:
            on_report(report)
        if run.status != "RUNNING" or (max_checks is not None and checks >= max_checks):
            return report
        time.sleep(every_s)

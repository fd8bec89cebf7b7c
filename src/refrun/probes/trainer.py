"""What every trainer callback shares: a probe driven by a trainer's events.

Lightning, the Hugging Face ``Trainer`` and Keras call back at "batch begins", "batch
ends", "evaluation done" and "training ends"; :class:`TrainerRecorder` turns those into
the probe contract (:mod:`refrun.probes.base`): ``probe.step(n)`` around each optimizer
step, ``probe.log`` of the loss (device value or number), ``probe.log_eval`` of evaluation
metrics, ``probe.progress`` of the samples a batch held, ``probe.close`` at the end.  So a
callback records the same identity tags, metrics (``loss``, ``eval/*``, ``perf/step_time_s``,
``compile/*``, ``sys/*``, ``progress/*``) and evidence (placement, summaries) as the probe
of its backend, and nothing else.  Framework-free: the callbacks build the probe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from refrun import RunSession
    from refrun.probes.base import Probe


@dataclass
class TrainerRecorder:
    """Drives a probe from trainer events (one training run at a time).

    ``make_probe(run)`` builds the backend's probe when training starts.  ``run``: an open
    :class:`~refrun.RunSession`; when None, ``start_run_kwargs`` start one at training
    start (``refrun.start_run(**start_run_kwargs)``) that is closed at training end.
    """

    make_probe: Callable[[RunSession], Probe]
    run: RunSession | None = None
    start_run_kwargs: Mapping[str, Any] = field(default_factory=dict)
    probe: Probe | None = None
    _own_run: bool = False
    _step_cm: Any = None

    def start(self) -> None:
        """Training starts: open the run if needed and build the probe.

        A second fit with the same callback (``trainer.fit(ckpt_path=...)`` resuming the
        same run from a checkpoint) gets a new probe built on the trainer's objects of that
        fit (a trainer builds its optimizers anew for each fit; the probe of the ended fit
        is closed and would read the old ones), in the same run when the run is the
        user's, so the steps the fit replays are recorded as a restore
        (:mod:`refrun.comparison.restores`); in a new run when this recorder started and
        ended the first one."""
        if self.probe is not None and not self.probe.closed:
            return
        if self.run is None or (self._own_run and self.probe is not None):
            import refrun

            self.run = refrun.start_run(**dict(self.start_run_kwargs))
            self._own_run = True
        self.probe = self.make_probe(self.run)

    @property
    def needs_samples(self) -> bool:
        """True when the samples of each step must come from the trainer (the run declared
        no ``refrun.global_batch``): only then is it worth a callback's time to count a
        batch on the training thread."""
        return self.probe is None or self.probe.global_batch is None

    def begin_step(self, n: int, samples: int | None = None) -> None:
        """An optimizer step ``n`` begins (``samples``: what its batch holds, all ranks)."""
        if self.probe is None:
            self.start()
        assert self.probe is not None
        if self._step_cm is not None:
            self.end_step()  # a trainer that skipped "end" (an exception, a skipped batch)
        self._step_cm = self.probe.step(n)
        self._step_cm.__enter__()
        if samples is not None and self.probe.global_batch is None:
            self.probe.progress(samples=samples)

    def end_step(self, **metrics: Any) -> None:
        """The step ends: log ``metrics`` (e.g. ``loss=``; never None: a callback leaves
        out what it does not have) in it, then close it."""
        if self._step_cm is None or self.probe is None:
            return
        if metrics:  # passed on as is: no per-step copy (allocations invite GC pauses)
            self.probe.log(**metrics)
        cm, self._step_cm = self._step_cm, None
        cm.__exit__(None, None, None)

    def log(self, step: int, **metrics: Any) -> None:
        """Values reported outside a step (a trainer's logging cadence) at ``step``."""
        if self.probe is not None and metrics:
            self.probe.log(step, **metrics)

    def log_eval(self, step: int | None, metrics: Mapping[str, Any]) -> None:
        """Evaluation metrics as ``eval/<name>`` at ``step`` (default: the last step)."""
        if self.probe is None or not metrics:
            return
        n = step if step is not None else self.probe.current_step
        if n is None:
            return
        self.probe.log_eval(n, **dict(metrics))

    def close(self) -> None:
        """Training ends: close the step, the probe and a run this recorder started."""
        self.end_step()
        if self.probe is not None:
            self.probe.close()
        if self._own_run and self.run is not None:
            with contextlib.suppress(Exception):
                self.run.close()

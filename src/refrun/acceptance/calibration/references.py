"""The runs a calibration rests on, loaded from the tracking store: the reference seeds
of a workload and its known-good same-seed pairs."""

from __future__ import annotations

from collections.abc import Sequence

from refrun import schema
from refrun.acceptance import paired as pairs
from refrun.acceptance.calibration.derive import Calibrated, CalibrationOptions, calibrate
from refrun.comparison import RunData
from refrun.pairing import declares_pair


def calibrate_ids(run_ids: Sequence[str], tracking_uri: str | None = None,
                  options: CalibrationOptions | None = None) -> Calibrated:
    """Load the reference runs by id and :func:`calibrate`."""
    from refrun.comparison import load_run

    runs = [load_run(i, tracking_uri=tracking_uri, progress=False) for i in run_ids]
    return calibrate(runs, options, known_good_runs(runs, tracking_uri))


def known_good_runs(references: Sequence[RunData], tracking_uri: str | None
                    ) -> list[RunData]:
    """The known-good same-seed pair runs of the references' workload in the store
    (``refrun.pair.known_good``), loaded; empty when the references share no workload."""
    from refrun.comparison import load_run

    workload = references[0].workload if references else None
    if not workload:
        return []
    return [load_run(i, tracking_uri=tracking_uri, progress=False)
            for i in pairs.known_good_ids(workload, tracking_uri)]


def reference_ids(workload: str, tracking_uri: str | None = None) -> list[str]:
    """Finished runs of ``workload`` with role reference, oldest first."""
    from refrun.comparison import find_run_ids
    from refrun.store.client import client as store_client

    ids = find_run_ids(workload, schema.ROLES[0], tracking_uri=tracking_uri)
    client = store_client(tracking_uri)
    # A run that declares a same-seed pair (a rerun of a seed) is no independent seed.
    done = [i for i in ids if (r := client.get_run(i)).info.status == "FINISHED"
            and not declares_pair(r.data.tags)]
    return list(reversed(done))

"""Finding recorded runs by their refrun identity tags."""

from __future__ import annotations

import pandas as pd

from refrun import schema
from refrun.store.client import client as store_client

_COLUMNS = {
    "run_id": None,
    "role": schema.TAG_ROLE,
    "hardware": schema.TAG_HARDWARE,
    "backend": schema.TAG_BACKEND,
    "chips": schema.TAG_CHIPS,
    "seed": schema.TAG_SEED,
    "status": None,
    "steps": schema.TAG_STEPS_COUNT,
    "last_step": schema.TAG_STEPS_LAST,
    "repeated": schema.TAG_STEPS_REPEATED,
    "backwards": schema.TAG_STEPS_BACKWARDS,
    "nonfinite": schema.TAG_NONFINITE,
}


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def search_filter(**tags: str | None) -> str:
    """MLflow filter string matching refrun identity tags (``role="reference"`` ...)."""
    parts = [f'tags."{schema.identity_tag(k)}" = {_quote(str(v))}'
             for k, v in tags.items() if v is not None]
    return " and ".join(parts)


def list_runs(workload: str, role: str | None = None, tracking_uri: str | None = None,
              **tags: str | None) -> pd.DataFrame:
    """Runs of ``workload`` (optionally one role / other identity tags), newest first.

    Columns: run_id, role, hardware, backend, chips, seed, status, steps, last_step,
    repeated, backwards, nonfinite, experiment, start_time.
    """
    client = store_client(tracking_uri)
    flt = search_filter(workload=workload, role=role, **tags)
    exps = client.search_experiments()
    runs = []
    page = None
    while True:
        batch = client.search_runs([e.experiment_id for e in exps], filter_string=flt,
                                   max_results=1000, order_by=["attributes.start_time DESC"],
                                   page_token=page)
        runs.extend(batch)
        page = batch.token
        if not page:
            break
    names = {e.experiment_id: e.name for e in exps}
    rows = []
    for r in runs:
        row = {}
        for col, tag in _COLUMNS.items():
            if col == "run_id":
                row[col] = r.info.run_id
            elif col == "status":
                row[col] = r.info.status
            else:
                row[col] = r.data.tags.get(tag, "-")
        row["experiment"] = names.get(r.info.experiment_id, r.info.experiment_id)
        row["start_time"] = pd.to_datetime(r.info.start_time, unit="ms", utc=True)
        rows.append(row)
    return pd.DataFrame(rows, columns=[*_COLUMNS, "experiment", "start_time"])

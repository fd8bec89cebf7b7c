"""The full-resolution curves artifact (``refrun/curves.parquet``).

Long format, one row per accepted point, never thinned:

=============  =======  ==================================================
metric         string   metric name (``loss``, ``eval/accuracy`` ...)
step           int64    training step the point belongs to
value          float64  the value; NaN and ±Inf are kept as they are
timestamp_ms   int64    wall time the point was accepted, ms since the epoch
seq            int64    order in which points were accepted (0, 1, 2 ...)
=============  =======  ==================================================

``seq`` lets a reader apply "last value written for a step wins" (or first) when a
run resumed from a checkpoint repeats steps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from refrun import schema

SCHEMA = pa.schema(
    [
        ("metric", pa.dictionary(pa.int32(), pa.string())),  # schema.CURVE_COLUMNS
        ("step", pa.int64()),
        ("value", pa.float64()),
        ("timestamp_ms", pa.int64()),
        ("seq", pa.int64()),
    ]
)


def write_curves(df: pd.DataFrame, path: Path) -> Path:
    """Write the long curves table to Parquet (zstd); returns ``path``."""
    table = pa.Table.from_pandas(
        df[["metric", "step", "value", "timestamp_ms", "seq"]].astype({"metric": "string"}),
        preserve_index=False,
        nthreads=1,  # no thread pool: this also runs from atexit, after pools are shut down
    )
    table = table.cast(SCHEMA)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        pq.write_table(table, tmp, compression="zstd")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not keep a torn file
        raise
    return path


def read_curves(path: Path, metrics: list[str] | None = None) -> pd.DataFrame:
    """Read a curves artifact, optionally only some metrics (filtered in Arrow)."""
    filters = [("metric", "in", list(metrics))] if metrics else None
    table = pq.read_table(path, filters=filters)
    df = table.to_pandas()
    df["metric"] = df["metric"].astype("string")
    return df


def summary_tags(df: pd.DataFrame, main_metric: str = schema.M_LOSS) -> dict[str, str]:
    """End-of-run tags computed from the curves table.

    Step counts come from ``main_metric`` (or the metric with most points when absent).
    ``repeated`` counts points whose step equals the previous step of the same metric in
    logging order; ``backwards`` counts points whose step is smaller; ``nonfinite`` counts
    NaN/±Inf values over all metrics.
    """
    tags = {schema.TAG_NONFINITE: str(int((~np.isfinite(df["value"].to_numpy())).sum()))}
    repeated = backwards = 0
    for _, g in df.sort_values("seq").groupby("metric", sort=False, observed=True):
        d = np.diff(g["step"].to_numpy())
        repeated += int((d == 0).sum())
        backwards += int((d < 0).sum())
    tags[schema.TAG_STEPS_REPEATED] = str(repeated)
    tags[schema.TAG_STEPS_BACKWARDS] = str(backwards)
    if len(df):
        counts = df["metric"].value_counts()
        main = main_metric if main_metric in counts.index else str(counts.idxmax())
        steps = df.loc[df["metric"] == main, "step"].to_numpy()
        tags[schema.TAG_STEPS_COUNT] = str(len(np.unique(steps)))
        tags[schema.TAG_STEPS_FIRST] = str(int(steps.min()))
        tags[schema.TAG_STEPS_LAST] = str(int(steps.max()))
    return tags

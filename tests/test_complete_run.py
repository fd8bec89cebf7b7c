"""refrun.store.complete's fast table summaries against the general definitions."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from refrun import schema
from refrun.store.complete import curves_table, table_summary_tags
from refrun.util.thinning import sorted_unique


def _by_hand(metrics: list[str], steps: list[int], values: list[float],
             main: str) -> dict[str, str]:
    """The summary tags from their definitions, one point at a time (independent code)."""
    last: dict[str, int] = {}
    repeated = backwards = 0
    for m, s in zip(metrics, steps, strict=True):
        if m in last:
            repeated += s == last[m]
            backwards += s < last[m]
        last[m] = s
    counts = {m: metrics.count(m) for m in dict.fromkeys(metrics)}
    if main not in counts:
        main = max(counts, key=counts.get)  # first of the most frequent, in first-seen order
    main_steps = [s for m, s in zip(metrics, steps, strict=True) if m == main]
    return {
        schema.TAG_NONFINITE: str(sum(not np.isfinite(v) for v in values)),
        schema.TAG_STEPS_REPEATED: str(repeated),
        schema.TAG_STEPS_BACKWARDS: str(backwards),
        schema.TAG_STEPS_COUNT: str(len(set(main_steps))),
        schema.TAG_STEPS_FIRST: str(min(main_steps)),
        schema.TAG_STEPS_LAST: str(max(main_steps)),
    }


@pytest.mark.parametrize("seed", range(12))
def test_table_summary_tags_match_their_definitions(seed):
    rng = np.random.default_rng(seed)
    names = ["loss", "lr", "diff/x"] if seed % 2 else ["a", "b"]
    n = int(rng.integers(1, 300))
    metrics = list(rng.choice(names, n))
    if seed % 3 == 0:  # grouped metric by metric (comparison runs) vs interleaved (imports)
        metrics.sort(key=names.index)
    steps = rng.integers(0, 40, n).tolist()
    values = rng.normal(size=n)
    values[rng.random(n) < 0.1] = np.nan
    values[rng.random(n) < 0.05] = np.inf
    # Categories in first-seen order, so "first of the most frequent" means the same thing.
    cats = list(dict.fromkeys(metrics))
    table = curves_table(pd.Categorical(metrics, categories=cats), steps, values, 1)
    assert table_summary_tags(table) == _by_hand(metrics, steps, values.tolist(), "loss")


def test_sorted_unique_is_numpy_unique():
    rng = np.random.default_rng(3)
    for n in (0, 1, 2, 7, 1000):
        x = rng.integers(-20, 20, n)
        got = sorted_unique(x)
        assert got.dtype == np.unique(x).dtype
        np.testing.assert_array_equal(got, sorted(set(x.tolist())))


def test_values_over_mlflows_length_are_cut_warned_and_counted(store, caplog) -> None:
    # A complete run (imports, comparisons, assessments) cut long values silently before.
    from mlflow.tracking import MlflowClient

    from refrun import limits
    from refrun.store.complete import CompleteRun, string_tags, write_complete_run

    long_tag, long_param = "t" * (limits.TAG_VALUE_LENGTH + 7), "p" * 9000
    table = curves_table(["loss"] * 3, np.arange(3), np.array([3.0, 2.0, 1.0]), 0)
    with caplog.at_level("WARNING", logger="refrun"):
        run_id = write_complete_run(CompleteRun(
            "cut-test", {**string_tags({"user.note": long_tag}), "short": "kept"}, table,
            params={"option.long": long_param, "option.short": "1"},
            end_tags={"end.note": long_tag}), store.tracking_uri)
    run = MlflowClient(store.tracking_uri).get_run(run_id)
    assert run.data.tags["user.note"] == long_tag[:limits.TAG_VALUE_LENGTH]
    assert run.data.tags["end.note"] == long_tag[:limits.TAG_VALUE_LENGTH]
    assert run.data.params["option.long"] == long_param[:limits.PARAM_VALUE_LENGTH]
    assert run.data.tags["short"] == "kept" and run.data.params["option.short"] == "1"
    assert run.data.tags[schema.TAG_TRUNCATED] == "3"
    warned = [r.getMessage() for r in caplog.records if "cut to MLflow's limit" in r.getMessage()]
    assert len(warned) == 3 and all(k in " ".join(warned)
                                    for k in ("'user.note'", "'end.note'", "'option.long'"))

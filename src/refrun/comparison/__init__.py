"""Comparing recorded runs: loading, alignment by step, measures, reference groups and
the comparison run.  Measures only, no verdicts; never imports a training framework.

See docs/comparison.md for the API, the alignment rules and the JSON schema.
"""

from refrun.comparison.alignment import (
    Aligned,
    AlignmentReport,
    Series,
    SeriesReport,
    align,
    resolve_series,
)
from refrun.comparison.engine import CompareOptions, Comparison, MetricComparison, compare
from refrun.comparison.group import GroupEnvelope, GroupStats, envelope_position, group_stats
from refrun.comparison.loading import RunData, find_run_ids, load_query, load_run, load_runs
from refrun.comparison.measures import (
    CounterTotals,
    DiffMeasures,
    EvalPoint,
    FinalWindow,
    StepTimeMeasures,
    counter_totals,
    diff_measures,
    eval_points,
    step_time_ratio,
    warmup_end,
)
from refrun.comparison.record import record_comparison

__all__ = [
    "Aligned", "AlignmentReport", "CompareOptions", "Comparison", "CounterTotals",
    "DiffMeasures", "EvalPoint", "FinalWindow", "GroupEnvelope", "GroupStats",
    "MetricComparison", "RunData", "Series", "SeriesReport", "StepTimeMeasures", "align",
    "compare", "counter_totals", "diff_measures", "envelope_position", "eval_points",
    "find_run_ids", "group_stats", "load_query", "load_run", "load_runs",
    "record_comparison", "resolve_series", "step_time_ratio", "warmup_end",
]

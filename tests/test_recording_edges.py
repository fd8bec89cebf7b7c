"""Issue 22 at ``log()``: every value the session refuses is counted and named, long tag
and param values are cut with a counted warning, and a param logged again is handled one
way whatever the timing.  A real sqlite store; the session's own delivery process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import refrun
from refrun import schema


def _warnings_doc(client, run_id: str, tmp: Path) -> dict:
    return json.loads(Path(client.download_artifacts(run_id, schema.ARTIFACT_WARNINGS,
                                                     str(tmp))).read_text())


def test_every_refused_value_is_counted_and_named(store, tmp_path: Path) -> None:
    bad = {"s": "0.5", "n": None, "b": True, "c": 1j, "a": np.zeros(3), "big": 10**400}
    with refrun.start_run(workload="w", role="candidate", flush_interval_s=0.05) as run:
        run.log(0, loss=1.0)
        run.log(7, loss=0.5, **bad)
        run.log(8, big=10**400)  # the same refusal again: counted, listed once
    client = store.client()
    r = client.get_run(run.run_id)
    assert r.info.status == "FINISHED"
    assert r.data.tags[schema.TAG_REFUSED] == str(len(bad) + 1)
    refused = {e["name"]: e for e in _warnings_doc(client, run.run_id, tmp_path)["refused"]}
    assert set(refused) == set(bad)
    for name, value in bad.items():
        e = refused[name]
        assert e["first_step"] == 7 and f"metric {name!r} at step 7" in e["reason"], e
        if name != "big":
            assert f"type {type(value).__name__}" in e["reason"], e
    assert refused["big"]["count"] == 2 and "too large for a float" in refused["big"]["reason"]
    # The 10**400 warning names the metric and the step.
    messages = [w["message"] for w in run.warnings]
    assert any("metric 'big' at step 7" in m and "401 digits" in m for m in messages)
    assert [m.step for m in client.get_metric_history(run.run_id, "loss")] == [0, 7]


def test_long_values_are_cut_with_a_counted_warning(store) -> None:
    with refrun.start_run(workload="w", role="candidate", flush_interval_s=0.05,
                          params={"cfg": "p" * 7000}, tags={"start": "s" * 5001}) as run:
        run.set_tags({"notes": "n" * 9000, "short": "ok"})
    r = store.client().get_run(run.run_id)
    assert r.data.tags[schema.TAG_TRUNCATED] == "3"
    assert r.data.params["cfg"] == "p" * 6000  # MLflow's param limit
    assert r.data.tags["start"] == "s" * 5000 and r.data.tags["notes"] == "n" * 5000
    assert r.data.tags["short"] == "ok"
    messages = " | ".join(w["message"] for w in run.warnings)
    for needle in ("param 'cfg': value of 7,000 characters cut to MLflow's limit of 6,000",
                   "tag 'start': value of 5,001 characters cut",
                   "tag 'notes': value of 9,000 characters cut"):
        assert needle in messages


@pytest.mark.parametrize("delivered_first", [False, True])
def test_a_param_logged_again_keeps_its_first_value(store, delivered_first: bool) -> None:
    # Before: the outcome depended on whether the first value had reached the store (kept
    # silently, or refused by the store and counted in refrun.skipped).  Now one rule.
    with refrun.start_run(workload="w", role="candidate", flush_interval_s=0.05,
                          params={"lr": 0.1}) as run:
        if delivered_first:
            from tests.test_durability import wait_for

            wait_for(lambda: "lr" in store.client().get_run(run.run_id).data.params,
                     "the first value in the store")
        run.log_params({"lr": 0.1, "wd": 0.0})  # same value again: nothing to say
        run.log_params({"lr": 0.2})
        run.log(0, loss=1.0)
    r = store.client().get_run(run.run_id)
    assert r.data.params == {"lr": "0.1", "wd": "0.0"}
    assert r.data.tags[schema.TAG_REFUSED] == "1"
    assert schema.TAG_SKIPPED not in r.data.tags
    assert any("param 'lr' already logged as '0.1', the new value '0.2' is refused"
               in w["message"] for w in run.warnings)

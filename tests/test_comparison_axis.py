"""Alignment by samples or tokens seen (issue 15.4): a candidate with twice the global
batch on twice the chips lines up with its reference by samples, and the report says how."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

import refrun
import refrun.torch
from refrun import schema
from refrun.comparison import CompareOptions, RunData, compare
from refrun.comparison.alignment import axis_map, resolve_series, to_axis
from refrun.errors import RefrunInputError


def loss_of(samples: np.ndarray) -> np.ndarray:
    """The same curve for both runs as a function of data seen (the truth by samples)."""
    return 2.0 * np.exp(-samples / 1000.0)


def run_by_batch(batch: int, steps: int, run_id: str, recorded: bool) -> RunData:
    s = np.arange(steps)
    samples = (s + 1) * batch  # cumulative samples at the end of step s
    rows = [pd.DataFrame({"metric": "loss", "step": s, "value": loss_of(samples)})]
    if recorded:
        rows.append(pd.DataFrame({"metric": schema.M_PROGRESS_SAMPLES, "step": s,
                                  "value": samples.astype(float)}))
    return RunData.from_curves(pd.concat(rows, ignore_index=True), run_id=run_id,
                               tags={schema.TAG_GLOBAL_BATCH: str(batch)})


@pytest.mark.parametrize("recorded", [True, False], ids=["progress-metric", "global-batch"])
def test_twice_the_batch_lines_up_by_samples(recorded: bool) -> None:
    ref = run_by_batch(32, 100, "ref", recorded)  # 4 chips x 8
    cand = run_by_batch(64, 50, "cand", recorded)  # 8 chips x 8
    by_step = compare(ref, cand, progress=False).metrics["loss"]
    assert by_step.measures.max_abs_diff > 0.1  # step n of one is not step n of the other
    m = compare(ref, cand, options=CompareOptions(axis="samples"), progress=False)
    loss = m.metrics["loss"]
    a = loss.alignment
    # common sample counts: 64, 128, ..., 3200 (every candidate step, every other reference)
    assert a.axis == "samples" and a.aligned_steps == 50
    assert (a.first_aligned_step, a.last_aligned_step) == (64, 3200)
    assert loss.measures.max_abs_diff == pytest.approx(0.0, abs=1e-12)
    src = "recorded" if recorded else "global_batch"
    assert [(r.run, r.source, r.per_step) for r in a.axis_mapping] == [
        ("reference", src, 32.0), ("candidate", src, 64.0)]
    assert a.notes[0].startswith("aligned by samples seen")
    frame = loss.frame
    assert list(frame.columns[:2]) == ["step", "samples"]
    assert frame["samples"].tolist() == list(range(64, 3201, 64))
    assert frame["step"].tolist() == list(range(50))  # the candidate's own steps
    assert schema.M_PROGRESS_SAMPLES not in m.metrics  # an axis, not a measurement
    doc = json.loads(json.dumps(m.to_dict()))
    assert doc["options"]["axis"] == "samples"
    assert doc["metrics"]["loss"]["alignment"]["axis_mapping"][1]["per_step"] == 64.0


def test_tokens_from_tokens_per_sample_and_missing_axis_is_one_line() -> None:
    ref = run_by_batch(32, 10, "ref", False)
    cand = run_by_batch(64, 5, "cand", False)
    with pytest.raises(RefrunInputError, match="axis tokens: run ref has no 'progress/tokens'"):
        compare(ref, cand, options=CompareOptions(axis="tokens"), progress=False)
    for r in (ref, cand):
        r.tags[schema.TAG_TOKENS_PER_SAMPLE] = "128"
    m = compare(ref, cand, options=CompareOptions(axis="tokens"), progress=False)
    a = m.metrics["loss"].alignment
    assert a.first_aligned_step == 64 * 128 and a.aligned_steps == 5
    with pytest.raises(RefrunInputError, match="axis"):
        CompareOptions(axis="epochs")


def test_to_axis_interpolates_inside_and_drops_outside() -> None:
    """Metric steps between two recorded progress points are interpolated (eval every 10
    steps, progress every 5); steps outside the record are dropped and counted."""
    ser = resolve_series(np.array([0, 7, 10, 30]), np.array([1.0, 2.0, 3.0, 4.0]))
    amap = axis_map("samples", (np.array([0, 5, 10, 15, 20]),
                                np.array([10.0, 60.0, 110.0, 160.0, 210.0])),
                    np.array([0, 30]), None)
    out, dropped = to_axis(ser, amap)
    # step 7: 60 + 2/5 * 50 = 80 (by hand); step 30 is past the record
    assert out.steps.tolist() == [10, 80, 110] and dropped == 1
    assert out.values.tolist() == [1.0, 2.0, 3.0]


def train(store, batch: int, steps: int, seed: int) -> str:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(123)
    with refrun.start_run("axis-test", "reference" if batch == 8 else "candidate",
                          hardware="cpu", backend="torch", global_batch=batch,
                          tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                          snapshot_environment=False, delivery="thread") as run:
        probe = refrun.torch.instrument(run, model=model, optimizer=opt, monitors=None)
        for n in range(steps):
            x = torch.randn(batch, 4, generator=gen)
            with probe.step(n):
                loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                probe.log(loss=loss)
        probe.close()
    return run.run_id


def test_probe_records_progress_and_compare_aligns_real_runs(store) -> None:
    ref = train(store, 8, 12, 0)
    cand = train(store, 16, 6, 0)
    hist = store.client().get_metric_history(cand, schema.M_PROGRESS_SAMPLES)
    assert sorted((m.step, m.value) for m in hist) == [(n, 16.0 * (n + 1)) for n in range(6)]
    m = compare([ref], cand, options=CompareOptions(axis="samples"),
                tracking_uri=store.tracking_uri, progress=False)
    a = m.metrics["loss"].alignment
    assert a.aligned_steps == 6 and a.last_aligned_step == 96
    assert [r.source for r in a.axis_mapping] == ["recorded", "recorded"]

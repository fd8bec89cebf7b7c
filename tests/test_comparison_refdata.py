"""Real cross-hardware curves imported into a real sqlite store and compared; every measure
is checked against an independent numpy computation on the raw files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from refrun.comparison import CompareOptions, compare, load_run, record_comparison
from refrun.importers import import_megatron, import_torchtitan
from tests.refdata import DATA, needs_data

TT = DATA / "torchtitan"
MEG = DATA / "megatron" / "gpt3_mcore_te_tp1_pp1_resume_torch_dist_dist_optimizer"
pytestmark = needs_data


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("refdata")
    uri = f"sqlite:///{tmp}/mlflow.db"
    kw = {"tracking_uri": uri, "spool_dir": tmp / "spool"}
    ids = {
        "uri": uri,
        "tt_cuda": import_torchtitan(TT / "llama3_cuda.txt", workload="llama3",
                                     role="reference", hardware="h100", **kw),
        "tt_rocm": import_torchtitan(TT / "llama3_rocm_mi350x.txt", workload="llama3",
                                     role="candidate", hardware="mi350x", **kw),
        "a100": import_megatron(MEG / "golden_values_dev_dgx_a100.json", workload="gpt3",
                                role="reference", hardware="a100", **kw),
        "h100_resumed": import_megatron(MEG / "golden_values_dev_dgx_h100.json",
                                        resumed=MEG / "golden_values_dev_dgx_h100_2nd.json",
                                        workload="gpt3", role="candidate", hardware="h100",
                                        **kw),
        "h100_2nd": import_megatron(MEG / "golden_values_dev_dgx_h100_2nd.json",
                                    workload="gpt3", role="candidate", hardware="h100", **kw),
    }
    return ids


def _raw_tt(name: str) -> tuple[np.ndarray, np.ndarray]:
    a = np.loadtxt(TT / name)
    return a[:, 0].astype(np.int64), a[:, 1]


def _raw_meg(name: str, metric: str) -> dict[int, float]:
    values = json.loads((MEG / name).read_text())[metric]["values"]
    return {int(k): float(v) for k, v in values.items()}


def test_torchtitan_llama3_measures_match_numpy(db: dict[str, str]) -> None:
    cmp = compare(db["tt_cuda"], db["tt_rocm"], tracking_uri=db["uri"])
    s, r = _raw_tt("llama3_cuda.txt")
    s2, c = _raw_tt("llama3_rocm_mi350x.txt")
    assert np.array_equal(s, s2)
    d = c - r
    rd = np.abs(d) / np.maximum(np.maximum(np.abs(r), np.abs(c)), 1e-12)
    k = math.ceil(0.1 * len(s))
    m = cmp.metrics["loss"].measures
    expected = {
        "mean_abs_diff": np.mean(np.abs(d)), "max_abs_diff": np.max(np.abs(d)),
        "mean_rel_diff": np.mean(rd), "max_rel_diff": np.max(rd), "bias": np.mean(d),
        "rms_diff": np.sqrt(np.mean(d**2)), "diff_at_last_step": d[-1],
        "rel_diff_at_last_step": rd[-1], "reference_at_last_step": r[-1],
        "candidate_at_last_step": c[-1],
    }
    for name, value in expected.items():
        assert getattr(m, name) == pytest.approx(value, abs=1e-12, rel=0), name
    assert m.n == 100 and m.last_step == 100
    assert m.step_of_max_abs_diff == s[np.argmax(np.abs(d))]
    fw = m.final_window
    assert (fw.n, fw.first_step, fw.last_step) == (k, s[-k], s[-1])
    assert fw.mean_abs_diff == pytest.approx(np.mean(np.abs(d[-k:])), abs=1e-12, rel=0)
    assert fw.mean_rel_diff == pytest.approx(np.mean(rd[-k:]), abs=1e-12, rel=0)
    assert fw.bias == pytest.approx(np.mean(d[-k:]), abs=1e-12, rel=0)
    frame = cmp.frame("loss")
    np.testing.assert_allclose(frame["diff"].to_numpy(), d, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(frame["step"].to_numpy(), s)
    a = cmp.metrics["loss"].alignment
    assert (a.aligned_steps, a.only_in_reference, a.only_in_candidate) == (100, 0, 0)
    # the loaded run is the artifact, tagged as an import
    run = load_run(db["tt_rocm"], tracking_uri=db["uri"])
    assert run.source == "artifact" and run.backend == "import" and run.hardware == "mi350x"


def test_megatron_resumed_pair_reports_repeated_range_and_keeps_choice(db: dict[str, str]
                                                                       ) -> None:
    first = _raw_meg("golden_values_dev_dgx_h100.json", "lm loss")
    second = {s: v for s, v in _raw_meg("golden_values_dev_dgx_h100_2nd.json",
                                         "lm loss").items() if s >= 51}
    ref = _raw_meg("golden_values_dev_dgx_a100.json", "lm loss")
    for keep, winner in (("last", {**first, **second}), ("first", first)):
        cmp = compare(db["a100"], db["h100_resumed"], metrics=["loss"],
                      options=CompareOptions(keep=keep), tracking_uri=db["uri"])
        mc = cmp.metrics["loss"]
        cand = mc.alignment.candidate
        assert cand.repeated_steps == 50 and cand.repeated_ranges == [[51, 100, 50]]
        assert cand.backwards == 1 and cand.nonfinite == 0  # placeholders dropped
        steps = np.array(sorted(ref))
        r = np.array([ref[s] for s in steps])
        c = np.array([winner[s] for s in steps])
        assert mc.alignment.aligned_steps == 21 and mc.alignment.cadence_differs
        assert mc.alignment.only_in_candidate == 100 - 21
        assert mc.measures.mean_abs_diff == pytest.approx(np.mean(np.abs(c - r)), abs=1e-12)
        assert mc.measures.bias == pytest.approx(np.mean(c - r), abs=1e-12)
        assert any("51-100" in n and keep in n for n in mc.alignment.notes)


def test_megatron_nan_strings_counted_and_excluded(db: dict[str, str]) -> None:
    cmp = compare(db["h100_resumed"], db["h100_2nd"], metrics=["loss", "perf/step_time_s"],
                  tracking_uri=db["uri"])
    loss = cmp.metrics["loss"]
    raw = _raw_meg("golden_values_dev_dgx_h100_2nd.json", "lm loss")
    n_nan = sum(1 for v in raw.values() if math.isnan(v))
    assert loss.alignment.candidate.nan == n_nan == 50
    assert loss.alignment.candidate.first_nonfinite_step == 1
    assert loss.alignment.excluded_nonfinite == n_nan
    assert loss.alignment.aligned_steps == 50
    assert not loss.frame["candidate"].isna().any()
    # resumed second half against itself (last wins) is identical
    assert loss.measures.max_abs_diff == 0.0
    st = cmp.metrics["perf/step_time_s"]
    assert st.alignment.candidate.nan == 51  # iteration-time has no value at step 51
    # each run's own steady window (steps >= 11): the resumed run has both halves
    it1 = _raw_meg("golden_values_dev_dgx_h100.json", "iteration-time")
    it2 = _raw_meg("golden_values_dev_dgx_h100_2nd.json", "iteration-time")
    merged = {**it1, **{s: v for s, v in it2.items() if s >= 51}}
    med_ref = np.nanmedian([v for s, v in merged.items() if s >= 11])
    med_cand = np.nanmedian([v for s, v in it2.items() if s >= 11])
    assert st.step_time is not None and st.step_time.warmup_end_step == 11
    assert st.step_time.ratio == pytest.approx(med_cand / med_ref, abs=1e-12)


def test_step_time_ratio_and_group_on_real_files(db: dict[str, str]) -> None:
    cmp = compare(db["a100"], db["h100_resumed"], metrics=["perf/step_time_s"],
                  tracking_uri=db["uri"])
    st = cmp.metrics["perf/step_time_s"].step_time
    ra = _raw_meg("golden_values_dev_dgx_a100.json", "iteration-time")
    rb = {**_raw_meg("golden_values_dev_dgx_h100.json", "iteration-time"),
          **{s: v for s, v in _raw_meg("golden_values_dev_dgx_h100_2nd.json",
                                        "iteration-time").items() if s >= 51}}
    start = 1 + math.ceil(0.1 * 100)  # first step 1, last step 100, 10% warm-up
    med_a = np.median([v for s, v in ra.items() if s >= start])
    med_b = np.nanmedian([v for s, v in rb.items() if s >= start])
    assert st.warmup_end_step == start
    assert st.ratio == pytest.approx(med_b / med_a, abs=1e-12)


def test_recorded_comparison_run_has_difference_curves(db: dict[str, str]) -> None:
    from mlflow.tracking import MlflowClient

    cmp = compare(db["tt_cuda"], db["tt_rocm"], tracking_uri=db["uri"])
    run_id = record_comparison(cmp, tracking_uri=db["uri"],
                               spool_dir=Path(db["uri"][len("sqlite:///"):]).parent / "sp")
    client = MlflowClient(db["uri"])
    run = client.get_run(run_id)
    assert run.data.tags["refrun.role"] == "comparison"
    assert run.data.tags["refrun.compared.reference"] == db["tt_cuda"]
    assert run.data.tags["refrun.compared.candidate"] == db["tt_rocm"]
    hist = client.get_metric_history(run_id, "diff/loss")
    _, r = _raw_tt("llama3_cuda.txt")
    _, c = _raw_tt("llama3_rocm_mi350x.txt")
    got = np.array([h.value for h in sorted(hist, key=lambda h: h.step)])
    np.testing.assert_allclose(got, c - r, rtol=0, atol=1e-12)
    assert len(client.get_metric_history(run_id, "reldiff/loss")) == 100
    names = {f.path for f in client.list_artifacts(run_id, "refrun")}
    assert "refrun/comparison.json" in names

"""``refrun accept --axis``: a candidate with twice the global batch passes by samples, the
assessment records the axis and its source, a sign-off re-assesses on the same basis, and
an --axis that contradicts the criteria file is refused (exit 2, one line)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from acceptance_helpers import error_line, write_criteria
from conftest import Store
from mlflow.tracking import MlflowClient

from refrun import schema
from refrun.acceptance.signoff import sign_off, verify
from refrun.cli import main
from refrun.store.complete import (
    CompleteRun,
    curves_table,
    identity_tags,
    now_ms,
    write_complete_run,
)

CRITERIA = """
workload = "axis-accept"

[[criteria]]
id = "loss-close"
level = "L1"
kind = "closeness"
metric = "loss"
abs_tol = 0.001
rel_tol = 0.0
"""


def loss_at(samples: np.ndarray) -> np.ndarray:
    """The same curve as a function of data seen: the truth when aligned by samples."""
    return 2.0 * np.exp(-samples / 400.0) + 0.1


def record(store, role: str, batch: int, steps: int) -> str:
    """One finished run written in one pass (the importers' path: identity tags, the
    curves artifact, MLflow's metric history), much cheaper than a session's delivery."""
    samples = (np.arange(steps) + 1) * batch  # seen at the end of each step
    tags = identity_tags("axis-accept", role, hardware="cpu", backend="torch")
    tags.update({schema.TAG_GLOBAL_BATCH: str(batch), schema.TAG_PLANNED_STEPS: str(steps)})
    table = curves_table(["loss"] * steps, np.arange(steps), loss_at(samples), now_ms())
    return write_complete_run(CompleteRun(experiment="axis-accept", tags=tags, table=table,
                                          run_name=f"{role}-b{batch}"), store.tracking_uri)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """One sqlite store for the module: the two runs are recorded once (CI budget)."""
    tmp = tmp_path_factory.mktemp("accept-axis")
    return Store(tmp, f"sqlite:///{tmp}/mlflow.db", tmp / "spool")


@pytest.fixture(scope="module")
def pair(store: Store) -> tuple[str, str]:
    return record(store, "reference", 32, 40), record(store, "candidate", 64, 20)


def test_twice_the_batch_passes_by_samples_and_the_axis_is_recorded(
        store, pair, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref, cand = pair
    crit = write_criteria(tmp_path, CRITERIA)
    base = ["accept", "--criteria", str(crit), "--reference", ref, "--candidate", cand,
            "--tracking-uri", store.tracking_uri]
    # By step, step n of the candidate has seen twice the data: the curves differ by far
    # more than the tolerance (independent check with numpy).
    s = np.arange(20)
    assert np.abs(loss_at((s + 1) * 64) - loss_at((s + 1) * 32)).max() > 0.1
    assert main([*base, "--no-record", "--json", str(tmp_path / "step.json")]) == 1
    by_step = json.loads((tmp_path / "step.json").read_text())
    assert by_step["alignment"] == {"axis": "step", "source": "default"}
    # ... and the assessment says so in one line, with the axis that would compare them
    # as meant (issue 52 item 5); printed as a warning.
    hint = [w for w in by_step["warnings"] if "global batch" in w]
    assert hint == [f"the candidate's global batch ({schema.TAG_GLOBAL_BATCH}) is 64, the "
                    "references' 32, and runs are aligned by step: step n of each has seen "
                    "different numbers of samples; --axis samples compares them at equal "
                    "samples seen"], by_step["warnings"]
    assert f"WARNING: {hint[0]}" in capsys.readouterr().out

    out = tmp_path / "samples.json"
    assert main([*base, "--axis", "samples", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "aligned on samples (from --axis)" in text
    data = json.loads(out.read_text())
    assert data["verdict"] == "pass"
    assert not [w for w in data["warnings"] if "global batch" in w]  # aligned as meant
    assert data["alignment"] == {"axis": "samples", "source": "--axis"}
    comp = text.split("recorded on comparison run ")[1].split()[0]
    client = MlflowClient(store.tracking_uri)
    stored = json.loads(Path(client.download_artifacts(
        comp, "refrun/assessment.json", str(tmp_path / "dl"))).read_text())
    assert stored["alignment"] == {"axis": "samples", "source": "--axis"}
    comp_run = client.get_run(comp)
    assert comp_run.data.tags["refrun.hardware"] == "cpu"  # the candidate's hardware
    cand_name = client.get_run(cand).info.run_name
    assert comp_run.info.run_name == f"accept {cand_name} vs 1 ref: pass"
    # The sign-off re-assesses from the stored criteria copy on the recorded basis: no
    # change is found (re-assessing by step would turn the pass into a fail).
    sign_off(comp, "accept", by="reviewer", tracking_uri=store.tracking_uri)
    check = verify(comp, tracking_uri=store.tracking_uri)
    assert check.ok, check.text()


def test_axis_conflicting_with_the_criteria_file_is_refused(
        store, pair, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref, cand = pair
    body = CRITERIA.replace('workload = "axis-accept"\n',
                            'workload = "axis-accept"\n[settings]\naxis = "step"\n')
    crit = write_criteria(tmp_path, body)
    line_no = body.splitlines().index('axis = "step"') + 1
    base = ["accept", "--criteria", str(crit), "--reference", ref, "--candidate", cand,
            "--tracking-uri", store.tracking_uri]
    client = MlflowClient(store.tracking_uri)
    exp = client.get_experiment_by_name("axis-accept").experiment_id
    before = len(client.search_runs([exp]))
    assert main([*base, "--axis", "samples"]) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{crit}:{line_no}: [settings] axis = 'step' conflicts with --axis samples" in line
    assert len(client.search_runs([exp])) == before  # nothing recorded
    # the same axis on both sides is no conflict; the file is named as the source
    assert main([*base, "--axis", "step", "--no-record",
                 "--json", str(tmp_path / "a.json")]) == 1
    data = json.loads((tmp_path / "a.json").read_text())
    assert data["alignment"] == {"axis": "step", "source": "criteria"}


def test_report_with_criteria_names_its_run_like_accept(
        store, pair, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref, cand = pair
    crit = write_criteria(tmp_path, CRITERIA)  # by step (report --criteria: the file's axis)
    assert main(["report", "--criteria", str(crit), "--reference", ref, "--candidate", cand,
                 "--html", str(tmp_path / "r.html"), "--tracking-uri", store.tracking_uri]) == 0
    text = capsys.readouterr().out
    assert f"acceptance {cand}: verdict fail" in text
    comp = text.split("comparison run: ")[1].split()[0]
    client = MlflowClient(store.tracking_uri)
    run = client.get_run(comp)
    cand_name = client.get_run(cand).info.run_name
    assert run.info.run_name == f"accept {cand_name} vs 1 ref: fail"
    assert "**Verdict: FAIL**" in run.data.tags["mlflow.note.content"]
    assert "`loss-close`" in run.data.tags["mlflow.note.content"]  # the failing criterion
    assert run.data.tags["refrun.hardware"] == "cpu"


def test_batch_hint_only_where_data_per_step_differs_on_the_step_axis() -> None:
    """(global batch, tokens per sample) per run: a hint for another batch or another
    number of tokens per step on the step axis; none on another axis, for equal data per
    step, or where a run is not tagged."""
    from refrun.acceptance.alignment import batch_hint

    assert "--axis samples" in batch_hint("step", (64, None), [(32, None), (32, None)])
    assert "16, 32" in batch_hint("step", (64, None), [(32, None), (16, None)])
    tokens = batch_hint("step", (32, 256), [(32, 128)])
    assert tokens.startswith("the candidate processes 8192 tokens per step, the "
                             "references 4096") and "--axis tokens" in tokens
    assert batch_hint("samples", (64, None), [(32, None)]) == ""
    assert batch_hint("step", (32, 128), [(32, 128), (32, 128)]) == ""
    assert batch_hint("step", (32, 256), [(32, None)]) == ""  # tokens not known everywhere
    assert batch_hint("step", (None, None), [(32, None)]) == ""
    assert batch_hint("step", (64, None), [(None, None)]) == ""

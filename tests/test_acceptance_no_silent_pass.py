"""No silent way to a wrong "pass", on real runs in a real sqlite store: identity names
(backend, role, hardware) validated and normalised where a run starts and where a criteria
file is read; backend scopes that skip a criterion are visible; a candidate of another
workload is refused by accept, compare and report unless explicitly allowed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from acceptance_helpers import STEPS, N, base_loss, error_line, record, write_criteria
from mlflow.tracking import MlflowClient

import refrun
from refrun import identity
from refrun.acceptance import assess, load_criteria
from refrun.cli import main
from refrun.comparison import load_run
from refrun.errors import RefrunInputError

WARMUP = 5
# The issue's case: host syncs are recorded only by the PyTorch/XLA probe, so the criterion
# is scoped to torch_xla.
CRITERIA = f"""\
[settings]
warmup_steps = {WARMUP}

[[criteria]]
id = "loss"
level = "L1"
kind = "closeness"
metric = "loss"
abs_tol = 0.2

[[criteria]]
id = "host-syncs"
level = "L2"
kind = "host_transfers"
metrics = ["xfer/host_syncs"]
max = 0.5
backends = ["torch_xla"]
"""


def _loss(seed: int) -> np.ndarray:
    return base_loss() + np.random.default_rng(seed).normal(0, 0.02, N)


def _comparison_runs(uri: str) -> int:
    client = MlflowClient(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    return len(client.search_runs(exps, "tags.`refrun.role` = 'comparison'"))


# --- names at run start ------------------------------------------------------------------
def test_torch_xla_alias_is_normalised_and_the_host_sync_is_caught(store, tmp_path: Path,
                                                                    capsys) -> None:
    ref = record(store.tracking_uri, store.spool_dir, "reference", {"loss": _loss(0)},
                 backend="torch")
    # A .item() in every step: one host sync per step, as the XLA probe records it.
    cand = record(store.tracking_uri, store.spool_dir, "candidate",
                  {"loss": _loss(1), "xfer/host_syncs": np.ones(N)}, backend="torch-xla",
                  hardware="TPU_v5e", seed=1)
    tags = MlflowClient(store.tracking_uri).get_run(cand.run_id).data.tags
    assert tags["refrun.backend"] == "torch_xla" and tags["refrun.hardware"] == "tpu-v5e"
    crit = write_criteria(tmp_path, CRITERIA)
    out_json = tmp_path / "a.json"
    rc = main(["accept", "--criteria", str(crit), "--reference", ref.run_id, "--candidate",
               cand.run_id, "--json", str(out_json), "--no-record"])
    assert rc == 1, capsys.readouterr().out
    res = {r["id"]: r for r in json.loads(out_json.read_text())["results"]}
    assert res["host-syncs"]["outcome"] == "fail"
    # numpy on the logged values: mean syncs per step after warm-up
    assert res["host-syncs"]["evidence"]["value"] == pytest.approx(
        float(cand.metrics["xfer/host_syncs"][STEPS >= WARMUP].mean()))


@pytest.mark.parametrize(("kw", "text"), [
    ({"backend": "torchxla2"}, "backend: 'torchxla2' is not a known backend (valid: torch, "
                               "torch_xla, jax"),
    ({"role": "candiate"}, "role: 'candiate' is not a known role (valid: reference, "
                           "candidate"),
    ({"hardware": "NVIDIA A100 (80GB)"}, "hardware: 'NVIDIA A100 (80GB)' is not a hardware "
                                         "name"),
])
def test_unknown_names_are_refused_at_run_start(store, kw: dict, text: str) -> None:
    args = {"role": "candidate", "backend": "torch", "hardware": "cpu", **kw}
    with pytest.raises(RefrunInputError) as exc:
        refrun.start_run("accept-test", args.pop("role"), tracking_uri=store.tracking_uri,
                         spool_dir=store.spool_dir, snapshot_environment=False, **args)
    msg = str(exc.value)
    assert text in msg and "\n" not in msg
    # Nothing half-written: no spool entry, no MLflow run.
    assert not store.spool_dir.exists() or not any(store.spool_dir.iterdir())
    client = MlflowClient(store.tracking_uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    assert client.search_runs(exps) == []


def test_aliases_of_the_issue() -> None:
    for name in ("torch-xla", "pytorch_xla", "ptxla", "PyTorch-XLA", " torch_xla "):
        assert identity.normalize_backend(name) == "torch_xla"
    assert identity.normalize_backend("pytorch") == "torch"
    assert identity.normalize_backend("JAX") == "jax"
    assert identity.normalize_role("Ref") == "reference"
    assert identity.normalize_hardware("Nvidia L4") == "nvidia-l4"
    assert identity.normalize_hardware("a100-80gb") == "a100-80gb"  # open-ended, by pattern


# --- names in criteria files -------------------------------------------------------------
def test_criteria_backend_alias_normalised_and_unknown_refused(tmp_path: Path, store,
                                                               capsys) -> None:
    crit = load_criteria(write_criteria(tmp_path, CRITERIA.replace(
        'backends = ["torch_xla"]', 'backends = ["torch-xla"]')))
    assert crit.criterion("host-syncs").backends == ["torch_xla"]
    bad = write_criteria(tmp_path, CRITERIA.replace('backends = ["torch_xla"]',
                                                    'backends = ["tpu_xla"]'), "bad.toml")
    ref = record(store.tracking_uri, store.spool_dir, "reference", {"loss": _loss(0)})
    cand = record(store.tracking_uri, store.spool_dir, "candidate", {"loss": _loss(1)})
    assert main(["accept", "--criteria", str(bad), "--reference", ref.run_id,
                 "--candidate", cand.run_id]) == 2
    err = error_line(capsys.readouterr().err)
    line = 1 + CRITERIA.splitlines().index('backends = ["torch_xla"]')
    assert f"bad.toml:{line}: criteria[1].backends[0] (id 'host-syncs'): 'tpu_xla' is not " \
           "a known backend (valid: torch, torch_xla" in err
    assert _comparison_runs(store.tracking_uri) == 0


def test_criteria_price_keys_are_hardware_names(tmp_path: Path) -> None:
    body = CRITERIA + '\n[prices.hourly]\n"TPU_v5e" = 1.2\n'
    assert load_criteria(write_criteria(tmp_path, body)).prices.hourly == {"tpu-v5e": 1.2}
    with pytest.raises(RefrunInputError, match=r"prices\.hourly\.a100/80 \S*: 'a100/80' is not"
                                               r"|prices.hourly.*'a100/80' is not a hardware"):
        load_criteria(write_criteria(tmp_path, CRITERIA + '\n[prices.hourly]\n"a100/80" = 3\n',
                                     "p.toml"))


# --- backend scopes that skip are visible ------------------------------------------------
def test_scope_that_no_run_has_is_a_row_not_a_warning(store, tmp_path: Path) -> None:
    """Not applicable by design (a known backend no compared run has; an unknown scope is
    refused when the file is read): the row says so, no warning does (nothing to act on)."""
    ref = record(store.tracking_uri, store.spool_dir, "reference", {"loss": _loss(0)})
    cand = record(store.tracking_uri, store.spool_dir, "candidate", {"loss": _loss(1)}, seed=1)
    a = assess(load_criteria(write_criteria(tmp_path, CRITERIA)),
               [load_run(ref.run_id, tracking_uri=store.tracking_uri, progress=False)],
               load_run(cand.run_id, tracking_uri=store.tracking_uri, progress=False))
    r = a.result("host-syncs")
    assert r.outcome == "not_applicable"
    assert "scoped to torch_xla; no compared run has that backend (runs: torch)" in r.reason
    assert not any("host-syncs" in w for w in a.warnings)
    row = [line for line in a.table().splitlines() if "host-syncs" in line]
    assert len(row) == 1 and "NOT_APPLICABLE" in row[0] and "no compared run" in row[0]
    assert "WARNING" not in a.table()
    assert a.to_dict()["warnings"] == a.warnings


def test_stored_backend_tag_refrun_does_not_know_is_never_a_pass(store, tmp_path: Path
                                                                 ) -> None:
    """A run recorded before names were validated keeps its free-text tag."""
    ref = record(store.tracking_uri, store.spool_dir, "reference", {"loss": _loss(0)})
    cand = record(store.tracking_uri, store.spool_dir, "candidate",
                  {"loss": _loss(1), "xfer/host_syncs": np.ones(N)}, seed=1)
    client = MlflowClient(store.tracking_uri)
    crit = load_criteria(write_criteria(tmp_path, CRITERIA))
    refs = [load_run(ref.run_id, tracking_uri=store.tracking_uri, progress=False)]

    client.set_tag(cand.run_id, "refrun.backend", "torch-xla")  # an alias: applies
    a = assess(crit, refs, load_run(cand.run_id, tracking_uri=store.tracking_uri,
                                    progress=False))
    assert a.result("host-syncs").outcome == "fail" and a.verdict == "fail"

    client.set_tag(cand.run_id, "refrun.backend", "xla-torch-2")  # unknown: not evaluable
    a = assess(crit, refs, load_run(cand.run_id, tracking_uri=store.tracking_uri,
                                    progress=False))
    r = a.result("host-syncs")
    assert r.outcome == "not_evaluable" and "'xla-torch-2' is not a known backend" in r.reason
    assert a.verdict == "incomplete" and a.exit_code == 1


# --- one workload per verdict ------------------------------------------------------------
def _other_workload(store, seed: int) -> str:
    with refrun.start_run("other-workload", "candidate", hardware="cpu", backend="torch",
                          seed=seed, planned_steps=N, tracking_uri=store.tracking_uri,
                          spool_dir=store.spool_dir, snapshot_environment=False,
                          delivery="thread") as run:
        for i, v in enumerate(_loss(seed)):
            run.log_metrics(i, {"loss": float(v)})
    assert run.run_id is not None
    return run.run_id


def test_accept_refuses_another_workload(store, tmp_path: Path, capsys) -> None:
    ref = record(store.tracking_uri, store.spool_dir, "reference", {"loss": _loss(0)})
    cand = _other_workload(store, 1)
    crit = write_criteria(tmp_path, CRITERIA)
    args = ["accept", "--criteria", str(crit), "--reference", ref.run_id, "--candidate", cand]
    assert main(args) == 2
    err = error_line(capsys.readouterr().err)
    assert f"candidate {cand} is workload 'other-workload' but " \
        f"reference {ref.run_id} is 'accept-test'" in err and "--allow-cross-workload" in err
    assert _comparison_runs(store.tracking_uri) == 0
    out = tmp_path / "a.json"
    assert main([*args, "--allow-cross-workload", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "verdict: pass (cross-workload (candidate" in text
    data = json.loads(out.read_text())
    assert "allowed by --allow-cross-workload" in data["cross_workload"]
    assert data["warnings"][0] == data["cross_workload"]


def test_accept_refuses_criteria_of_another_workload(store, tmp_path: Path, capsys) -> None:
    ref = record(store.tracking_uri, store.spool_dir, "reference", {"loss": _loss(0)})
    cand = record(store.tracking_uri, store.spool_dir, "candidate", {"loss": _loss(1)}, seed=1)
    crit = write_criteria(tmp_path, 'workload = "digits-mlp"\n' + CRITERIA)
    assert main(["accept", "--criteria", str(crit), "--reference", ref.run_id,
                 "--candidate", cand.run_id]) == 2
    err = capsys.readouterr().err
    assert f"criteria file {crit} is for 'digits-mlp'" in err
    assert _comparison_runs(store.tracking_uri) == 0


def test_compare_and_report_refuse_another_workload(store, tmp_path: Path, capsys) -> None:
    ref = record(store.tracking_uri, store.spool_dir, "reference", {"loss": _loss(0)})
    cand = _other_workload(store, 1)
    base = ["--reference", ref.run_id, "--candidate", cand]
    assert main(["compare", *base, "--no-record"]) == 2
    assert "refusing to compare across workloads" in capsys.readouterr().err
    out = tmp_path / "c.json"
    assert main(["compare", *base, "--no-record", "--json", str(out),
                 "--allow-cross-workload"]) == 0
    assert "WARNING: cross-workload" in capsys.readouterr().out
    assert "other-workload" in json.loads(out.read_text())["cross_workload"]
    html = tmp_path / "r.html"
    assert main(["report", *base, "--html", str(html), "--no-record"]) == 2
    assert "refusing to compare across workloads" in capsys.readouterr().err
    assert not html.exists()
    crit = write_criteria(tmp_path, CRITERIA)
    assert main(["report", *base, "--html", str(html), "--no-record", "--criteria",
                 str(crit)]) == 2
    assert not html.exists()
    assert _comparison_runs(store.tracking_uri) == 0

"""``refrun accept`` at the cost of its work: ``--help`` imports nothing heavy, the
comparison run is written directly (no spool, no delivery process), and ``--candidate A B
C`` assesses a sweep in one process, loading each reference once.

Runs are written fast with the complete-run writer into a real sqlite store; the
expected verdicts come from how each candidate was built (a shifted loss must fail the
envelope; another seed must pass), not from the code under test.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from acceptance_helpers import error_line, loss_envelope_criteria

from refrun import schema
from refrun.acceptance.evidence import sha256_of
from refrun.acceptance.record import load_recorded
from refrun.cli import main
from refrun.store.complete import (
    CompleteRun,
    curves_table,
    identity_tags,
    now_ms,
    write_complete_run,
)

# The module itself: ``refrun.acceptance.assess`` as an attribute is the function.
assess_module = importlib.import_module("refrun.acceptance.assess")

N = 60
CRITERIA = loss_envelope_criteria("sweep-test")


def write_run(uri: str, role: str, seed: int, *, shift: float = 0.0,
              name: str | None = None, params: dict[str, str] | None = None,
              backend: str = "torch") -> str:
    rng = np.random.default_rng(seed)
    s = np.arange(N)
    loss = 2 * np.exp(-s / 20) + 0.3 + rng.normal(0, 0.01, N) + np.where(s >= N // 2, shift, 0)
    tags = identity_tags("sweep-test", role, hardware="cpu", backend=backend, seed=seed)
    tags[schema.TAG_PLANNED_STEPS] = str(N)
    table = curves_table(pd.Categorical(["loss"] * N), s, loss, now_ms())
    return write_complete_run(CompleteRun("sweep-test", tags, table, params=params or {},
                                          run_name=name), uri)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("sweep")
    uri = f"sqlite:///{tmp}/mlflow.db"
    refs = [write_run(uri, "reference", s) for s in range(4)]
    good = [write_run(uri, "candidate", 10 + i, name="jax seed 0") for i in range(2)]
    bad = write_run(uri, "candidate", 20, shift=0.5, name="jax seed 0")
    crit = tmp / "criteria.toml"
    crit.write_text(CRITERIA, encoding="utf-8")
    return {"uri": uri, "refs": refs, "good": good, "bad": bad, "crit": crit, "tmp": tmp}


def comparison_runs(uri: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("sweep-test")
    return client.search_runs([exp.experiment_id], f"tags.`{schema.TAG_ROLE}` = 'comparison'")


def test_help_and_version_import_nothing_heavy() -> None:
    """``refrun accept --help`` builds its parser without MLflow, pandas, SciPy or the
    assessment modules (on today's main it imported all of them: ~5 s)."""
    code = ("import sys\nfrom refrun.cli import main\n"
            "for argv in (['accept', '--help'], ['--version']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "heavy = ('mlflow', 'pandas', 'scipy', 'pyarrow', 'plotly', "
            "'refrun.acceptance.assess', 'refrun.comparison')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip().splitlines()[-1] == "[]", out
    assert "--candidate ID [ID ...]" in out


def test_sweep_one_line_each_summary_json_and_references_loaded_once(
        sweep: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    loaded: list[str] = []
    real_load_run = assess_module.load_run

    def counting_load_run(run_id: str, **kwargs: object):
        loaded.append(run_id)
        return real_load_run(run_id, **kwargs)

    monkeypatch.setattr(assess_module, "load_run", counting_load_run)
    spool = tmp_path / "spool"
    monkeypatch.setenv("REFRUN_SPOOL_DIR", str(spool))
    before = len(comparison_runs(sweep["uri"]))
    cands = [*sweep["good"], sweep["bad"]]
    out = tmp_path / "sweep.json"
    rc = main(["accept", "--criteria", str(sweep["crit"]), "--reference", *sweep["refs"],
               "--candidate", *cands, "--tracking-uri", sweep["uri"], "--json", str(out)])
    assert rc == 1  # one candidate fails
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4, lines
    for line, cid in zip(lines, cands, strict=False):
        assert line.startswith(cid)
    assert "  PASS  highest L1" in lines[0] and "  PASS  highest L1" in lines[1]
    assert "  FAIL  highest L0" in lines[2] and "failed: loss-envelope" in lines[2]
    assert lines[3].startswith("3 candidates: 2 pass, 1 fail, 0 incomplete")
    # Each reference loaded once for the whole sweep, each candidate once.
    assert sorted(loaded) == sorted([*sweep["refs"], *cands])

    doc = json.loads(out.read_text())
    assert doc["format"] == "refrun.accept.sweep" and doc["exit_code"] == 1
    assert doc["summary"] == {"candidates": 3, "pass": 2, "fail": 1, "incomplete": 0}
    assert [c["candidate"] for c in doc["candidates"]] == cands
    assert [c["verdict"] for c in doc["candidates"]] == ["pass", "pass", "fail"]

    # Every assessment recorded as a FINISHED comparison run, written directly: no spool
    # directory was made (a live session would have spooled and spawned its delivery).
    runs = {r.info.run_id: r for r in comparison_runs(sweep["uri"])}
    assert len(runs) == before + 3
    assert not spool.exists()
    for c in doc["candidates"]:
        run = runs[c["comparison_run_id"]]
        assert run.info.status == "FINISHED"
        tags = run.data.tags
        assert tags[schema.TAG_COMPARED_CANDIDATE] == c["candidate"]
        assert tags[schema.TAG_ACCEPTANCE_VERDICT] == c["verdict"]
        assert tags[schema.TAG_RUN_NAME] == f"accept jax seed 0 vs 4 refs: {c['verdict']}"
        rec = load_recorded(run.info.run_id, sweep["uri"])
        assert rec.criteria_bytes == sweep["crit"].read_bytes()
        assert rec.assessment["verdict"] == c["verdict"]
        # The evidence file hashes to the digest the run is tagged with.
        assert sha256_of(rec.evidence) == tags["refrun.acceptance.evidence_sha256"]


def test_sweep_bad_input_records_nothing(sweep: dict,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    before = len(comparison_runs(sweep["uri"]))
    base = ["accept", "--criteria", str(sweep["crit"]), "--reference", *sweep["refs"],
            "--tracking-uri", sweep["uri"], "--candidate"]
    good = sweep["good"][0]
    assert main([*base, good, "nope"]) == 2  # the bad id comes after a good candidate
    assert "'nope'" in error_line(capsys.readouterr().err)
    assert main([*base, good, sweep["bad"], good]) == 2
    assert f"--candidate {good}: given twice" in error_line(capsys.readouterr().err)
    assert main([*base, good, sweep["refs"][0]]) == 2
    assert "also given as a reference" in error_line(capsys.readouterr().err)
    assert len(comparison_runs(sweep["uri"])) == before


def test_lazy_package_keeps_its_names() -> None:
    """The package's names load on first use; ``assess`` stays the function although the
    import system binds the loaded submodule of that name to the package."""
    import refrun.acceptance as acceptance

    assert callable(assess_module.assess) and assess_module.__name__ == "refrun.acceptance.assess"
    from refrun.acceptance import assess

    assert assess is assess_module.assess
    for name in acceptance.__all__:
        assert getattr(acceptance, name) is not None


def test_report_of_a_sweep_links_each_comparison_run_to_the_mlflow_ui(
        sweep: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import re

    from mlflow.tracking import MlflowClient

    cands = [*sweep["good"], sweep["bad"]]
    base = ["report", "--reference", *sweep["refs"], "--candidate", *cands,
            "--tracking-uri", sweep["uri"], "--criteria", str(sweep["crit"])]
    before = len(comparison_runs(sweep["uri"]))
    assert main([*base, "--html", str(tmp_path / "x.html"), "--mlflow-ui", "ftp://x"]) == 2
    assert "--mlflow-ui ftp://x: not an http(s) address" in error_line(capsys.readouterr().err)
    assert len(comparison_runs(sweep["uri"])) == before  # refused before anything
    out = tmp_path / "sweep.html"
    assert main([*base, "--html", str(out), "--mlflow-ui", "http://127.0.0.1:5000/"]) == 0
    printed = capsys.readouterr().out
    run_ids = re.findall(r"comparison run: (\w+)", printed)
    assert len(run_ids) == 3
    html = out.read_text(encoding="utf-8")
    links = re.findall(r'<a class="mlflow" href="([^"]+)"', html)
    client = MlflowClient(sweep["uri"])
    assert links == [f"http://127.0.0.1:5000/#/experiments/"
                     f"{client.get_run(r).info.experiment_id}/runs/{r}" for r in run_ids]
    # Three runs named alike, differing in nothing but the seed tag: the labels say so.
    table = re.search(r'id="candidate-matrix">(.*?)</table>', html, re.S).group(1)
    labels = re.findall(r'<a href="#cand-\d">([^<]+)</a>', table)
    assert len(set(labels)) == 3 and all(lab.startswith("jax seed 0 · seed=") for lab in labels)


# What calibrate writes for the integrity evidence only PyTorch/XLA's probe records.
XLA_ONLY = """
[[criteria]]
id = "host-copies-per-step"
kind = "host_transfers"
level = "L2"
metrics = ["xfer/d2h"]
statistic = "mean"
max = 0.5
backends = ["torch_xla"]

[[criteria]]
id = "no-cpu-fallback"
kind = "fallback"
level = "L2"
allow = []
backends = ["torch_xla"]
"""


def test_a_sweep_of_jax_candidates_prints_one_line_each_and_no_scope_warning(
        sweep: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """30 JAX candidates against criteria two of which apply to PyTorch/XLA only: 30
    lines and the summary, no warning; each skip is a row of its assessment."""
    cands = [write_run(sweep["uri"], "candidate", 100 + i, name=f"jax {i}", backend="jax")
             for i in range(30)]
    crit = tmp_path / "criteria.toml"
    crit.write_text(CRITERIA + XLA_ONLY, encoding="utf-8")
    out = tmp_path / "sweep.json"
    rc = main(["accept", "--criteria", str(crit), "--reference", *sweep["refs"],
               "--candidate", *cands, "--tracking-uri", sweep["uri"], "--json", str(out),
               "--no-record"])
    printed = capsys.readouterr()
    assert rc == 0, printed
    lines = printed.out.strip().splitlines()
    assert len(lines) == 31 and lines[-1].startswith("30 candidates: 30 pass, 0 fail")
    assert [line.split()[0] for line in lines[:30]] == cands
    assert "warning" not in (printed.out + printed.err).lower()
    assert "scoped" not in printed.out + printed.err
    for c in json.loads(out.read_text())["candidates"]:
        assert c["warnings"] == []
        skipped = {r["id"]: r for r in c["results"] if r["outcome"] == "not_applicable"}
        assert set(skipped) == {"host-copies-per-step", "no-cpu-fallback"}
        assert all("no compared run has that backend (runs: jax, torch)" in r["reason"]
                   for r in skipped.values())


def test_a_warning_to_act_on_is_printed_once_after_the_summary(
        sweep: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A warning the user should act on (a candidate whose stored backend tag refrun does
    not know: the scoped criteria are not evaluable for it) is counted on its line and
    printed once after the summary, naming the candidates it concerns."""
    from mlflow.tracking import MlflowClient

    cands = [write_run(sweep["uri"], "candidate", 200 + i, name=f"jax {i}", backend="jax")
             for i in range(3)]
    MlflowClient(sweep["uri"]).set_tag(cands[1], schema.TAG_BACKEND, "tpu-thing")
    crit = tmp_path / "criteria.toml"
    crit.write_text(CRITERIA + XLA_ONLY, encoding="utf-8")
    rc = main(["accept", "--criteria", str(crit), "--reference", *sweep["refs"],
               "--candidate", *cands, "--tracking-uri", sweep["uri"], "--no-record"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 1  # not evaluable is no pass
    assert [line.split()[0] for line in lines[:3]] == cands
    assert "warning" not in lines[0] + lines[2] and "2 warning(s)" in lines[1]
    assert lines[3].startswith("3 candidates: 2 pass, 0 fail, 1 incomplete")
    assert lines[4:] == [
        f"WARNING (1 of 3 candidates: {cands[1][:8]}): candidate backend 'tpu-thing' is not "
        f"a known backend name; criterion '{cid}' (scoped to torch_xla) not evaluable"
        for cid in ("host-copies-per-step", "no-cpu-fallback")]

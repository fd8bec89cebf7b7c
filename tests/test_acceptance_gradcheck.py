"""The ``gradcheck`` criterion: ``refrun accept`` finds the gradient-check runs recorded for
the candidate (role gradcheck, tag ``refrun.gradcheck.candidate``) in a real sqlite store;
passed -> exit 0, failed -> exit 1, none -> exit 1 (never a silent pass), and a check
recorded for another candidate does not count.  ``refrun calibrate --require-gradcheck``
writes the criterion (off by default)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import refrun
from refrun.cli import main
from refrun.gradcheck.parity import compare_by_name
from refrun.gradcheck.record import record_gradcheck

# Records 7 runs and 4 gradcheck runs into one module-scoped store (in-process delivery):
# ~15 s quiet, ~70 s on the loaded 2-core machine.
pytestmark = pytest.mark.slow

CRITERIA = """version = 1
workload = "gc-demo"

[[criteria]]
id = "gradient-checks"
kind = "gradcheck"
level = "L1"
labels = ["parity/grads"]
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REFRUN_DELIVERY", "thread")  # in-process delivery: a cheap fixture
        return _store(tmp_path_factory.mktemp("gc"))


def _store(tmp: Path) -> dict[str, object]:
    uri = f"sqlite:///{tmp}/mlflow.db"

    def rec(role: str, seed: int) -> str:
        rng = np.random.default_rng(seed)
        with refrun.start_run("gc-demo", role, seed=seed, backend="torch", planned_steps=20,
                              tracking_uri=uri, spool_dir=tmp / "spool",
                              snapshot_environment=False) as run:
            for s in range(20):
                run.log(s, loss=2.0 * np.exp(-s / 8) + rng.normal(0, 0.01))
        return run.run_id

    ids = {name: rec(role, i) for i, (name, role) in enumerate(
        [("r0", "reference"), ("r1", "reference"), ("r2", "reference"), ("good", "candidate"),
         ("bad", "candidate"), ("none", "candidate"), ("later", "candidate")])}
    g = {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    ok = compare_by_name(g, {k: v.copy() for k, v in g.items()}, label="parity/grads")
    wrong = compare_by_name(g, {"w": 0.25 * g["w"], "b": g["b"]}, label="parity/grads")
    assert ok.passed and not wrong.passed
    record_gradcheck([ok], workload="gc-demo", tracking_uri=uri, spool_dir=tmp / "spool",
                     candidate_run_id=ids["good"], plot=False)
    record_gradcheck([wrong], workload="gc-demo", tracking_uri=uri, spool_dir=tmp / "spool",
                     candidate_run_id=ids["bad"], plot=False)
    record_gradcheck([ok], workload="gc-demo", tracking_uri=uri, spool_dir=tmp / "spool",
                     candidate_run_id=ids["later"], plot=False)
    crit = tmp / "gc.toml"
    crit.write_text(CRITERIA, encoding="utf-8")
    return {"uri": uri, "ids": ids, "crit": crit, "tmp": tmp, "wrong": wrong}


def _accept(store: dict, cand: str, out: Path) -> tuple[int, dict]:
    ids = store["ids"]
    rc = main(["accept", "--criteria", str(store["crit"]), "--reference", ids["r0"], ids["r1"],
               "--candidate", ids[cand], "--tracking-uri", str(store["uri"]),
               "--json", str(out), "--no-record"])
    doc = json.loads(out.read_text(encoding="utf-8"))
    return rc, next(r for r in doc["results"] if r["id"] == "gradient-checks")


def test_passed_check_accepts(store: dict, tmp_path: Path) -> None:
    rc, r = _accept(store, "good", tmp_path / "a.json")
    assert rc == 0 and r["outcome"] == "pass"
    assert r["evidence"]["labels"] == ["parity/grads"]
    assert len(r["evidence"]["gradcheck_runs"]) == 1


def test_failed_check_rejects(store: dict, tmp_path: Path, capsys) -> None:
    rc, r = _accept(store, "bad", tmp_path / "a.json")
    assert rc == 1 and r["outcome"] == "fail"
    assert "parity/grads" in r["reason"]
    assert "gradient-checks" in capsys.readouterr().out


def test_missing_check_is_a_failure_not_a_pass(store: dict, tmp_path: Path) -> None:
    # 'none' has no gradcheck run of its own; the runs recorded for 'good' and 'bad'
    # (same experiment) must not count for it.
    rc, r = _accept(store, "none", tmp_path / "a.json")
    assert rc == 1 and r["outcome"] == "fail"
    assert "no gradient-check run" in r["reason"]
    assert r["evidence"]["gradcheck_runs"] == []


def test_calibrate_require_gradcheck_off_by_default(store: dict, tmp_path: Path) -> None:
    ids, uri = store["ids"], str(store["uri"])
    refs = [ids["r0"], ids["r1"], ids["r2"]]
    plain, req = tmp_path / "plain.toml", tmp_path / "req.toml"
    # These runs log only a loss: the project's goal is stated (no L3 could be derived).
    goal = ["--goal", "loss<=10"]
    assert main(["calibrate", "--reference", *refs, "--tracking-uri", uri, "-o",
                 str(plain), *goal]) == 0
    assert main(["calibrate", "--reference", *refs, "--tracking-uri", uri, "-o", str(req),
                 "--require-gradcheck", *goal]) == 0
    import tomllib

    p = tomllib.loads(plain.read_text(encoding="utf-8"))
    q = tomllib.loads(req.read_text(encoding="utf-8"))
    assert "gradcheck" not in {c["kind"] for c in p["criteria"]}
    assert "require_gradcheck" not in p["calibration"]
    assert q["calibration"]["require_gradcheck"] is True
    gc = [c for c in q["criteria"] if c["kind"] == "gradcheck"]
    assert len(gc) == 1 and gc[0]["level"] == "L1"


def test_candidate_run_id_must_be_a_run_id(store: dict) -> None:
    from refrun.errors import RefrunInputError

    g = {"w": np.ones(2)}
    with pytest.raises(RefrunInputError, match="candidate_run_id"):
        record_gradcheck([compare_by_name(g, g)], workload="gc-demo",
                         tracking_uri=str(store["uri"]), candidate_run_id="nope", plot=False)


def test_verify_sees_a_failed_check_recorded_after_the_sign_off(store: dict, capsys) -> None:
    import re

    ids, uri = store["ids"], str(store["uri"])
    assert main(["accept", "--criteria", str(store["crit"]), "--reference", ids["r0"],
                 ids["r1"], "--candidate", ids["later"], "--tracking-uri", uri]) == 0
    comparison = re.search(r"recorded on comparison run ([0-9a-f]{32})",
                           capsys.readouterr().out).group(1)
    assert main(["signoff", "--comparison", comparison, "--decision", "accept",
                 "--by", "Ada", "--tracking-uri", uri]) == 0
    verify = ["verify", comparison, "--criteria", str(store["crit"]), "--tracking-uri", uri]
    assert main(verify) == 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REFRUN_DELIVERY", "thread")
        record_gradcheck([store["wrong"]], workload="gc-demo", tracking_uri=uri,
                         spool_dir=store["tmp"] / "spool", candidate_run_id=ids["later"],
                         plot=False)
    assert main(verify) == 1
    assert "gradient-checks" in capsys.readouterr().out

"""mlruns.example cannot go stale: the committed store's content description (run names,
descriptions, acceptance tags, tag/param/metric names, report structure; see
pipelines/example_store.py) must be what the *current* code produces.

* From the store's training runs: a copy of the store is re-assessed and reported by the
  current pipeline code (no training) and described again; any difference fails, naming
  the entries.
* From scratch: the generator assesses, in a scratch directory, the reduced plan trained
  anew by its own training step (once per session, into the cached build of
  tests/builds.py that the digits pipeline's tests read too); what the training records
  (every run's metric, tag and param names, its curves) and each candidate's acceptance
  must be the committed store's.  This is what catches a probe that records a new
  metric, which re-assessing old training runs cannot.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from builds import TrainedStore, script

from pipelines import example_store as ex

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "mlruns.example"


def reassessed(tmp: Path, monkeypatch: pytest.MonkeyPatch,
               only: tuple[str, ...] | None = None) -> tuple[dict, dict]:
    """(description of the copy as committed, description after re-assessing the copy's
    training runs with the current code) -- restricted to candidates ``only``."""
    from pipelines.demo import CRITERIA_QUICK, assess_all

    clone = tmp / "clone"
    shutil.copytree(STORE, clone / "mlruns.example")
    crit = CRITERIA_QUICK.relative_to(ROOT)
    (clone / crit).parent.mkdir(parents=True)
    shutil.copyfile(CRITERIA_QUICK, clone / crit)
    monkeypatch.chdir(clone)  # the store's artifact locations are relative to the clone
    store = clone / "mlruns.example"
    gen = script("make_example_store")
    plan = gen.reduced_plan(only or gen.CANDIDATES)
    training = ex.training_ids(store)
    before = ex.describe(store, training, ex.comparison_ids(store, training))
    assess_all(plan, training, uri=f"sqlite:///{store}/mlflow.db", reports=tmp / "reports",
               criteria=crit, logged_plotlyjs=gen.PLOTLY_FROM_REPORT)
    after = ex.describe(store, training, ex.comparison_ids(store, training))
    if only:
        for d in (before, after):
            d["comparison_runs"] = {k: v for k, v in d["comparison_runs"].items()
                                    if k in only}
    return before, after


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_example_store_is_what_the_current_code_makes(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    committed_digest = (STORE / ex.DIGEST).read_text().strip()
    import json

    committed = json.loads((STORE / ex.DESCRIPTION).read_text(encoding="utf-8"))
    assert ex.digest(committed) == committed_digest, "DESCRIPTION.json edited by hand"
    before, after = reassessed(tmp_path, monkeypatch)
    # the store is what its description says (nothing edited after generation) ...
    assert not ex.differences(committed, before), ex.differences(committed, before)
    # ... and what the current code makes from its training runs
    diff = ex.differences(committed, after)
    assert not diff, ("mlruns.example is stale: regenerate it with "
                      "`.venv/bin/python scripts/make_example_store.py`:\n  "
                      + "\n  ".join(diff[:20]))
    assert ex.digest(after) == committed_digest


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_code_change_after_generation_is_caught(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """What an outdated store looks like: the code that names comparison runs changed
    after the store was made.  The description of the re-assessed copy then differs from
    the committed one at exactly that entry."""
    from refrun.store import mlflow_ui

    real = mlflow_ui.comparison_run_name
    monkeypatch.setattr(mlflow_ui, "comparison_run_name",
                        lambda *a, **k: "renamed: " + real(*a, **k))
    before, after = reassessed(tmp_path, monkeypatch, only=("xla-host-sync",))
    diff = ex.differences(before, after)
    assert diff and all(d.startswith("comparison_runs.xla-host-sync.") for d in diff), diff
    assert any(d.startswith("comparison_runs.xla-host-sync.name: ") and "renamed: " in d
               for d in diff), diff
    assert ex.digest(before) != ex.digest(after)


_DEVICE = re.compile(r"Device: [^\n]*?\.(?=\s|$)")
# System metrics sampled per accelerator of the machine (sys/gpu0_util_pct on a machine
# with an NVIDIA GPU, sys/tpu0_* on a TPU host): a store made there names them, one made
# on a CPU-only machine does not.
_ACCELERATOR_SAMPLES = re.compile(r"^sys/(gpu|tpu)\d+_")


def _regenerable(description: dict) -> dict:
    """The parts of a description that a store trained anew on another machine must
    reproduce: the generator's inputs, everything about the training runs (names only,
    no values; the machine their description names replaced), and each candidate's
    acceptance and report structure.  Left out: the
    comparison runs' descriptions and the report's ranking, which quote measured values
    (another CPU's float kernels can move the last digits); the re-assessment test above
    checks those exactly on the committed training runs."""
    out = {"generator": description["generator"],
           # the run description names the machine's CPUs ("Device: cpu: x86_64 x2.")
           "training_runs": {v: {**t, "description": _DEVICE.sub("Device: <machine>.",
                                                                 t["description"]),
                                 "curves": [c for c in t["curves"]
                                            if not _ACCELERATOR_SAMPLES.match(c)]}
                             for v, t in description["training_runs"].items()}}
    out["comparison_runs"] = {
        v: {**{k: c[k] for k in ("name", "acceptance", "tags", "params", "metrics")},
            "report": {k: c["report"][k] for k in ("headings", "table_headers")}
            if c["report"] else None}
        for v, c in description["comparison_runs"].items()}
    return out


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1200)  # its setup may train the cached runs (tests/builds.py)
def test_a_store_made_now_records_what_the_committed_one_does(
        tmp_path: Path, example_training: TrainedStore) -> None:
    out = tmp_path / "store"
    # The generator's training step ran once this session into the cached store
    # (tests/builds.py: its own train_reduced, recorded as it records, keyed by the code);
    # the generator assesses, stages, scrubs and describes a copy of those runs.
    made = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_example_store.py"),
                           "--out", str(out), "--no-notebook", "--jobs", "2",
                           "--trained", str(example_training.path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert made.returncode == 0, made.stdout[-4000:] + made.stderr[-4000:]
    committed = json.loads((STORE / ex.DESCRIPTION).read_text(encoding="utf-8"))
    now = json.loads((out / ex.DESCRIPTION).read_text(encoding="utf-8"))
    diff = ex.differences(_regenerable(committed), _regenerable(now))
    assert not diff, ("mlruns.example is stale: the current code records other runs; "
                      "regenerate it with `.venv/bin/python scripts/make_example_store.py`:"
                      "\n  " + "\n  ".join(diff[:20]))
    # What a store made before a probe recorded a metric looks like: one reference's curves
    # without the learning rate.  Its description names exactly that run's curves.
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    ids = ex.training_ids(out)
    rid = ids["reference-seed0"]
    (curves,) = out.glob(f"artifacts/*/{rid}/artifacts/refrun/curves.parquet")
    table = pq.read_table(curves)
    assert "opt/lr" in table["metric"].to_pylist()  # the probe records it
    pq.write_table(table.filter(pc.not_equal(table["metric"], "opt/lr")), curves)
    old = _regenerable(ex.describe(out, ids, ex.comparison_ids(out, ids)))
    stale = ex.differences(old, _regenerable(now))
    assert stale == ["training_runs.reference-seed0.curves: only in the committed store "
                     "[], only in the current code's ['opt/lr']"], stale

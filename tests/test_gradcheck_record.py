"""Recording gradient checks as an MLflow `gradcheck` run; the pytest plugin; light imports."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from refrun import schema
from refrun.gradcheck import check_objective, compare_by_name, objective_from_callables
from refrun.gradcheck.record import record_gradcheck
from refrun.schema import ARTIFACT_GRADCHECK as ARTIFACT_JSON
from refrun.schema import ARTIFACT_GRADCHECK_FD_HTML as ARTIFACT_FD_HTML
from refrun.schema import TAG_GRADCHECK_FAILED as TAG_FAILED
from refrun.schema import TAG_GRADCHECK_PASSED as TAG_PASSED
from refrun.schema import TAG_GRADCHECK_VERDICT as TAG_VERDICT


def fd_result(scale: float):
    x0 = {"x": np.linspace(0.1, 1.0, 20)}
    obj = objective_from_callables(lambda p: float(np.sum(np.exp(p["x"]))),
                                   lambda p: {"x": scale * np.exp(p["x"])}, x0,
                                   label=f"exp x{scale}")
    return check_objective(obj, directions=2)


def test_record_gradcheck_run(store):
    good, bad = fd_result(1.0), fd_result(0.0)
    parity = compare_by_name({"w": np.ones(3)}, {"w": np.ones(3)}, label="parity w")
    run_id = record_gradcheck([good, bad, parity], workload="wl", tracking_uri=store.tracking_uri,
                              spool_dir=store.spool_dir, backend="numpy")
    client = store.client()
    run = client.get_run(run_id)
    tags = run.data.tags
    assert tags[schema.TAG_ROLE] == "gradcheck" and tags[schema.TAG_WORKLOAD] == "wl"
    assert tags[TAG_PASSED] == "false"
    assert tags[TAG_FAILED] == "exp x0.0"
    assert tags[TAG_VERDICT] == "wrong"
    assert run.info.status == "FINISHED"
    # the checks ran in this process: its environment is recorded, as for a live run
    assert tags[schema.TAG_FW_PREFIX + "numpy"] == np.__version__ and tags[schema.TAG_HOST]
    m = run.data.metrics
    assert m["gradcheck/exp x1.0/passed"] == 1.0 and m["gradcheck/exp x0.0/passed"] == 0.0
    assert m["gradcheck/parity w/w/rel_error"] == 0.0
    hist = client.get_metric_history(run_id, "gradcheck/exp x1.0/fd/d0/rel_error")
    assert [p.step for p in sorted(hist, key=lambda p: p.step)] == list(range(10))
    assert [p.value for p in sorted(hist, key=lambda p: p.step)] == pytest.approx(
        list(good.curves[0].rel_error))
    steps = client.get_metric_history(run_id, "gradcheck/exp x1.0/fd/step_size")
    assert sorted(p.value for p in steps)[-1] == pytest.approx(1e-2)
    local = client.download_artifacts(run_id, "refrun", str(store.tmp / "dl"))
    data = json.loads((store.tmp / "dl" / "refrun" / "gradcheck.json").read_text())
    assert data["failed"] == ["exp x0.0"]
    assert [r["kind"] for r in data["results"]] == ["finite_diff", "finite_diff", "parity"]
    html = (store.tmp / "dl" / ARTIFACT_FD_HTML).read_text()
    assert "plotly" in html and "exp x0.0" in html
    assert local and ARTIFACT_JSON.startswith("refrun/")
    assert (store.tmp / "dl" / schema.ARTIFACT_ENVIRONMENT).is_file()


def test_importing_refrun_gradcheck_and_the_plugin_loads_no_framework():
    code = ("import sys, refrun.testing, refrun.gradcheck, refrun.cli.gradcheck;"
            "print(sorted(m for m in ('torch', 'jax', 'plotly') if m in sys.modules));"
            "import refrun.cli; refrun.cli.build_parser();"
            "print(sorted(m for m in ('torch', 'jax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.split() == ["[]", "[]"]


PLUGIN_TESTS = textwrap.dedent('''
    import jax, jax.numpy as jnp
    from refrun.gradcheck import stop_gradient_mutation

    def loss(w, x, y):
        return jnp.mean((w * x - y) ** 2)

    def broken(w, x, y):
        return loss(jax.lax.stop_gradient(w), x, y)

    def oracle(fn, gate):
        return gate.known_answer(params=1.0, args=([1.0, 2.0], [0.0, 0.0]), expected_loss=2.5,
                                 expected_grad=5.0, jax_fn=fn, root="w")

    def test_good(refrun_gradcheck):
        oracle(loss, refrun_gradcheck)
        refrun_gradcheck.finite_diff(loss, 1.0, ([1.0, 2.0], [0.0, 0.0]), framework="jax")

    def test_broken(refrun_gradcheck):
        oracle(broken, refrun_gradcheck)

    def test_gate_rejects(refrun_gradcheck):
        from refrun.gradcheck import check_known_answer
        check = lambda fn: check_known_answer(params=1.0, args=([1.0, 2.0], [0.0, 0.0]),
                                              expected_loss=2.5, expected_grad=5.0, jax_fn=fn)
        refrun_gradcheck.rejects(check, loss, [stop_gradient_mutation()])
''')


def test_pytest_plugin_fixture_and_recording(tmp_path):
    pytest.importorskip("jax", reason="JAX is an optional extra")
    (tmp_path / "test_gate.py").write_text(PLUGIN_TESTS)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--rootdir={tmp_path}", str(tmp_path / "test_gate.py"),
               f"--refrun-gradcheck-record={uri}", "--refrun-gradcheck-workload=plug"]
    import os
    env = dict(os.environ, REFRUN_SPOOL_DIR=str(tmp_path / "spool"))
    proc = subprocess.run(env_cmd, capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300, check=False)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "2 passed" in out and "1 failed" in out
    assert "FAILED test_gate.py::test_broken" in out
    assert "JAX gradient oracle [w]: 0 vs expected 5" in out
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("plug")
    runs = client.search_runs([exp.experiment_id])
    by_test = {r.data.tags["refrun.gradcheck.test"].split("::")[-1]: r for r in runs}
    assert set(by_test) == {"test_good", "test_broken", "test_gate_rejects"}
    assert by_test["test_broken"].data.tags[TAG_PASSED] == "false"
    assert by_test["test_good"].data.tags[TAG_PASSED] == "true"
    assert by_test["test_good"].data.tags[TAG_VERDICT] == "verified"
    assert all(r.data.tags[schema.TAG_ROLE] == "gradcheck" for r in runs)

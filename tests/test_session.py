"""The run session against a real sqlite MLflow store, with a real PyTorch loop."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import refrun
from refrun import schema
from refrun.cli import main as cli_main
from refrun.errors import RefrunInputError
from refrun.store.curves import read_curves


def _download_curves(client, run_id: str, tmp: Path) -> pd.DataFrame:
    path = client.download_artifacts(run_id, schema.ARTIFACT_CURVES, str(tmp))
    return read_curves(Path(path))


def _train(run, steps: int, fail_at: int | None = None) -> list[float]:
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = x @ torch.randn(8, 1) + 0.1 * torch.randn(64, 1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        if step == fail_at:
            raise RuntimeError("boom")
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        value = loss.item()  # the test's own loop; the session only sees Python floats
        losses.append(value)
        run.log(step, loss=value)
        if step % 10 == 9:
            run.log_eval(step, mse=value * 2)
    return losses


def test_real_torch_loop_is_recorded_exactly(store, tmp_path):
    with refrun.start_run(workload="tiny-regression", role="reference", hardware="cpu",
                          backend="torch", seed=0, chips=1, global_batch=64,
                          params={"lr": 0.05}, tags={"team": "infra"},
                          flush_interval_s=0.05) as run:
        losses = _train(run, 60)
    client = store.client()
    r = client.get_run(run.run_id)
    assert r.info.status == "FINISHED"
    assert client.get_experiment(r.info.experiment_id).name == "tiny-regression"
    tags = r.data.tags
    assert tags[schema.TAG_SCHEMA] == schema.SCHEMA_VERSION
    assert tags[schema.TAG_WORKLOAD] == "tiny-regression"
    assert tags[schema.TAG_ROLE] == "reference"
    assert tags[schema.TAG_HARDWARE] == "cpu"
    assert tags[schema.TAG_BACKEND] == "torch"
    assert tags[schema.TAG_SEED] == "0" and tags[schema.TAG_CHIPS] == "1"
    assert tags[schema.TAG_GLOBAL_BATCH] == "64"
    assert tags[schema.TAG_FW_PREFIX + "torch"] == torch.__version__.split("+")[0]
    assert tags[schema.TAG_STEPS_COUNT] == "60" and tags[schema.TAG_STEPS_LAST] == "59"
    assert tags["team"] == "infra"
    assert r.data.params["lr"] == "0.05"

    history = client.get_metric_history(run.run_id, "loss")
    got = {m.step: m.value for m in history}
    assert len(history) == 60
    assert [got[s] for s in range(60)] == losses  # bit-exact floats
    evals = client.get_metric_history(run.run_id, "eval/mse")
    assert sorted(m.step for m in evals) == list(range(9, 60, 10))

    curves = _download_curves(client, run.run_id, tmp_path)
    loss = curves[curves.metric == "loss"].sort_values("seq")
    assert loss["step"].tolist() == list(range(60))
    assert loss["value"].tolist() == losses
    assert (curves["seq"].diff().dropna() > 0).all()
    env = json.loads(Path(client.download_artifacts(run.run_id, schema.ARTIFACT_ENVIRONMENT,
                                                    str(tmp_path))).read_text())
    assert env["packages"]["torch"].startswith("2.")


def test_exception_leaves_run_failed_with_every_point(store, tmp_path):
    with pytest.raises(RuntimeError, match="boom"), refrun.start_run(
        workload="w", role="candidate", flush_interval_s=0.05
    ) as run:
        _train(run, 100, fail_at=37)
    client = store.client()
    losses = _download_curves(client, run.run_id, tmp_path)
    r = client.get_run(run.run_id)
    assert r.info.status == "FAILED"
    steps = sorted(m.step for m in client.get_metric_history(run.run_id, "loss"))
    assert steps == list(range(37))
    assert len(losses[losses.metric == "loss"]) == 37


def test_keyboard_interrupt_is_killed(store):
    # The typed form: identity and recording options as two values.
    ident = refrun.RunIdentity(workload="w", role="cand", seed=4)
    with pytest.raises(KeyboardInterrupt), refrun.start_run(
            ident, options=refrun.RecordingOptions(experiment="typed")) as run:
        run.log(0, loss=1.0)
        raise KeyboardInterrupt
    got = store.client().get_run(run.run_id)
    assert got.info.status == "KILLED"
    assert (got.data.tags[schema.TAG_ROLE], got.data.tags[schema.TAG_SEED]) == ("candidate", "4")
    assert store.client().get_experiment(got.info.experiment_id).name == "typed"


def test_keywords_build_the_same_two_values_as_the_typed_form(monkeypatch, tmp_path):
    from refrun.recording.config import from_keywords

    monkeypatch.setenv("REFRUN_CLOSE_TIMEOUT_S", "7")  # a default read from the environment
    monkeypatch.setenv("REFRUN_SPOOL_DIR", str(tmp_path))
    monkeypatch.delenv("REFRUN_START_WAIT_S", raising=False)  # settings' own default: 3 s
    ident, opts = from_keywords("w", "ref", None, {"seed": 1, "flush_interval_s": 0.5,
                                                   "start_wait_s": None})
    assert ident == refrun.RunIdentity(workload="w", role="reference", seed=1)
    assert opts == refrun.RecordingOptions(flush_interval_s=0.5)
    assert (opts.close_timeout_s, opts.start_wait_s, opts.spool_root) == (7.0, 3.0, tmp_path)
    with pytest.raises(TypeError, match=r"unexpected keyword argument.*'sede'"):
        from_keywords("w", "reference", None, {"sede": 1})
    with pytest.raises(TypeError, match="not both"):
        from_keywords(ident, None, None, {"seed": 2})
    with pytest.raises(TypeError, match="not both"):
        from_keywords("w", "reference", opts, {"mlflow_every": 2})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"workload": "", "role": "reference"}, "workload"),
        ({"workload": "w", "role": "referee"}, "role"),
        ({"workload": "w", "role": "reference", "seed": "zero"}, "seed"),
        ({"workload": "w", "role": "reference", "tracking_uri": "mlruns"}, "tracking URI"),
        ({"workload": "w", "role": "reference", "mlflow_every": 0}, "mlflow_every"),
        ({"workload": "w", "role": "reference", "flush_interval_s": 0}, "flush_interval_s"),
        ({"workload": "w", "role": "reference", "max_queue": 0}, "max_queue"),
    ],
)
def test_bad_start_arguments_raise_clear_errors(store, kwargs, match):
    with pytest.raises(RefrunInputError, match=match):
        refrun.start_run(**kwargs)
    assert not store.spool_dir.exists() or not any(store.spool_dir.iterdir())


def test_bad_points_are_recorded_never_raised(store, capsys):
    with refrun.start_run(workload="w", role="candidate", flush_interval_s=0.05) as run:
        run.log(0, loss=1.0)
        run.log(1, loss=float("nan"))
        run.log(2, loss=float("inf"))
        run.log(2, loss=0.5)  # repeated step
        run.log(1, loss=0.4)  # backwards
        run.log(3, loss=torch.tensor(1.0))  # device-like value: refused, not synced
        run.log(3, **{"bad\tname": 1.0})
        run.log("four", loss=1.0)
        run.log(4, loss=np.float32(0.25))
    run.log(5, loss=1.0)  # after the end
    messages = " | ".join(w["message"] for w in run.warnings)
    for needle in ("non-finite", "repeated", "backwards", "Tensor", "names may only contain",
                   "'four' is not an integer", "after the run ended"):
        assert needle in messages
    r = store.client().get_run(run.run_id)
    assert r.data.tags[schema.TAG_NONFINITE] == "2"
    assert r.data.tags[schema.TAG_STEPS_REPEATED] == "1"
    assert r.data.tags[schema.TAG_STEPS_BACKWARDS] == "1"
    history = store.client().get_metric_history(run.run_id, "loss")
    values = [m.value for m in sorted(history, key=lambda m: (m.timestamp, m.step))]
    assert len(history) == 6
    assert any(math.isnan(v) for v in values)
    curves = _download_curves(store.client(), run.run_id, store.tmp / "dl")
    assert np.isinf(curves["value"]).sum() == 1  # the artifact keeps inf as inf
    assert not run.spool.path.exists()  # delivered spools are removed

    assert cli_main(["runs", "--workload", "w"]) == 0
    out = capsys.readouterr().out
    header, row = out.splitlines()[:2]
    cols = dict(zip(header.split(), row.split(), strict=False))
    assert cols["repeated"] == "1" and cols["backwards"] == "1" and cols["nonfinite"] == "2"


def test_mlflow_metrics_thinned_artifact_never(store, tmp_path):
    with refrun.start_run(workload="w", role="reference", mlflow_every=10) as run:
        for s in range(100):
            run.log(s, loss=float(s))
        run.log_eval(5, acc=0.5)
    client = store.client()
    assert sorted(m.step for m in client.get_metric_history(run.run_id, "loss")) == list(
        range(0, 100, 10))
    assert len(client.get_metric_history(run.run_id, "eval/acc")) == 1
    curves = _download_curves(client, run.run_id, tmp_path)
    assert (curves.metric == "loss").sum() == 100


def test_git_commit_of_training_code_is_recorded(store, tmp_path):
    repo = tmp_path / "code"
    repo.mkdir()
    script = repo / "train.py"
    script.write_text(textwrap.dedent(f"""
        import refrun
        with refrun.start_run(workload="gitw", role="reference",
                              tracking_uri={store.tracking_uri!r},
                              spool_dir={str(tmp_path / 'sp')!r}) as run:
            run.log(0, loss=1.0)
        print(run.run_id)
    """))
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout.strip().splitlines()[-1]
    tags = store.client().get_run(out).data.tags
    assert tags[schema.TAG_GIT_COMMIT] == head
    assert tags[schema.TAG_GIT_DIRTY] == "false"


def test_cli_exit_codes(store, capsys):
    with refrun.start_run(workload="w", role="reference") as run:
        run.log(0, loss=1.0)
    assert cli_main(["runs", "--workload", "nothing-here"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing-here" in err
    with pytest.raises(SystemExit) as exc:
        cli_main(["runs"])
    assert exc.value.code == 2
    proc = subprocess.run([sys.executable, "-m", "refrun", "--help"], capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "sync" in proc.stdout and "runs" in proc.stdout


def test_run_left_open_is_closed_at_interpreter_exit(store, tmp_path):
    script = tmp_path / "open.py"
    script.write_text(textwrap.dedent("""
        import refrun
        run = refrun.start_run(workload="open", role="reference")
        for s in range(20):
            run.log(s, loss=float(s))
        print(run.run_id)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         cwd=tmp_path, check=True)
    run_id = out.stdout.strip().splitlines()[-1]
    assert "not written" not in out.stderr
    client = store.client()
    assert client.get_run(run_id).info.status == "FINISHED"
    curves = _download_curves(client, run_id, tmp_path)
    assert curves["step"].tolist() == list(range(20))


def test_probe_left_open_is_closed_by_the_run(store):
    import refrun.torch

    with refrun.start_run(workload="hook", role="reference") as run:
        probe = refrun.torch.instrument(run, model=torch.nn.Linear(3, 1), monitors=None)
        for n in range(5):
            with probe.step(n):
                probe.log(loss=torch.tensor(float(n) / 2))
    history = store.client().get_metric_history(run.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(n, n / 2) for n in range(5)]


def test_the_run_says_how_long_refruns_own_start_up_took(store) -> None:
    """The run's start time is taken before refrun's own start-up (the spool, the
    environment snapshot, the store's opening and the run's creation), which depends on
    how the run is recorded (an MLflow import, a store created), not on the workload: the
    run records its length, and a run's hours (L4 cost) leave it out."""
    from refrun.acceptance.runview import run_hours
    from refrun.comparison import load_run

    before = time.time_ns() // 1_000_000
    with refrun.start_run(workload="tiny-regression", role="reference", hardware="cpu",
                          backend="torch", seed=0, tracking_uri=store.tracking_uri) as run:
        returned = time.time_ns() // 1_000_000
        _train(run, 5)
    r = store.client().get_run(run.run_id)
    start_up_ms = 1e3 * float(r.data.tags[schema.TAG_RECORDING_START_S])
    close_ms = 1e3 * float(r.data.tags[schema.TAG_RECORDING_CLOSE_S])
    assert before <= r.info.start_time <= returned
    # measured from the start time to just before start_run returned
    assert 0 <= returned - r.info.start_time - start_up_ms <= 1000
    hours, how = run_hours(load_run(run.run_id, tracking_uri=store.tracking_uri), "run_wall")
    wall_ms = r.info.end_time - r.info.start_time
    assert hours == pytest.approx((wall_ms - start_up_ms - close_ms) / 3.6e6, rel=1e-9)
    assert "less refrun's own start-up" in how


def test_the_run_says_how_long_refruns_own_close_took(store) -> None:
    """The run's end time is taken after the probes' close (their pending values read,
    their summaries written): the run records how long that took, from the call of close
    (the workload's end) to its end time, and a run's hours leave it out, so that they run
    from start_run's return to the workload's end, as the test's own clock reads them."""
    from refrun.acceptance.runview import run_hours
    from refrun.comparison import load_run

    with refrun.start_run(workload="tiny-regression", role="reference", hardware="cpu",
                          backend="torch", seed=0, tracking_uri=store.tracking_uri) as run:
        returned = time.time_ns() // 1_000_000
        _train(run, 5)
        closing = {}

        def slow_close() -> None:  # a probe's close with 1 s of work to do
            closing["entered"] = time.time_ns() // 1_000_000
            deadline = time.perf_counter() + 1.0
            while time.perf_counter() < deadline:
                pass

        run.add_close_hook(slow_close)
        left = time.time_ns() // 1_000_000
    r = store.client().get_run(run.run_id)
    close_ms = 1e3 * float(r.data.tags[schema.TAG_RECORDING_CLOSE_S])
    # from the call of close (after the block was left, before the hook ran) to the end
    assert closing["entered"] - left + 1000 <= close_ms + 1
    assert close_ms <= r.info.end_time - left + 1
    hours, how = run_hours(load_run(run.run_id, tracking_uri=store.tracking_uri), "run_wall")
    # the workload's own time by the test's clock, start_run's return to the block's end
    # (with the close's second counted, it would be at least 1000 ms longer)
    own_ms = hours * 3.6e6
    assert left - returned - 5 <= own_ms <= left - returned + 500
    assert "and close" in how


class _SlowStop:
    """A utilisation source whose ``stop`` has 1 s of work to do at the probe's close (as
    the chip-busy monitor reads its last profile window there)."""

    name = "slow-stop"

    def sample(self) -> dict[str, float]:
        return {}

    def stop(self) -> None:
        deadline = time.perf_counter() + 1.0
        while time.perf_counter() < deadline:
            pass

    def close(self) -> None:
        pass


def test_a_probe_closed_inside_the_run_counts_its_close_as_refruns_own(store) -> None:
    """A probe closed before the run's own close (inside the ``with`` block, as a loop
    that closes its probe when training ends does) reads its pending values and writes
    its summaries then: that time is refrun's too, added to the close tag, and the run's
    hours end where the probe's close began, by the test's own clock."""
    import refrun.torch
    from refrun.acceptance.runview import run_hours
    from refrun.comparison import load_run

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with refrun.start_run(workload="tiny-regression", role="reference", hardware="cpu",
                          backend="torch", seed=0, tracking_uri=store.tracking_uri) as run:
        returned = time.time_ns() // 1_000_000
        probe = refrun.torch.instrument(run, model=model, optimizer=opt,
                                        monitors=[_SlowStop()])
        for n in range(5):
            with probe.step(n):
                opt.zero_grad()
                loss = model(torch.ones(8, 4)).pow(2).mean()
                loss.backward()
                opt.step()
                probe.log(loss=loss)
        closing = time.time_ns() // 1_000_000
        probe.close()
        left = time.time_ns() // 1_000_000
    r = store.client().get_run(run.run_id)
    close_ms = 1e3 * float(r.data.tags[schema.TAG_RECORDING_CLOSE_S])
    assert left - closing >= 1000 and 1000 <= close_ms <= r.info.end_time - closing + 1
    hours, _ = run_hours(load_run(run.run_id, tracking_uri=store.tracking_uri), "run_wall")
    own_ms = hours * 3.6e6  # start_run's return to the probe's close (not 1 s after it)
    assert closing - returned - 5 <= own_ms <= closing - returned + 500

"""The detection benchmark's variants of the digits and charlm pipelines: the digits
reference resumes from a checkpoint and replays exactly what it would have done; the host
transfer defects leave the numbers alone (they cost a transfer, not a result); bfloat16
matmuls move them by more than float32 rounding.

Expected values are the same pipeline's uninterrupted run (a resume must reproduce it) and
the float32 port's own numbers; real torch and JAX runs recorded into a sqlite store.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

STEPS = 40


def _store(tmp: Path) -> str:
    return f"sqlite:///{tmp}/mlflow.db"


def _series(run_id: str, tmp: Path, metric: str) -> dict[int, float]:
    """Step -> value (the last one written for a step: a resumed run writes some twice)."""
    from mlflow.tracking import MlflowClient

    hist = MlflowClient(_store(tmp)).get_metric_history(run_id, metric)
    return {m.step: m.value for m in sorted(hist, key=lambda m: (m.step, m.timestamp))}


def test_digits_reference_resumes_and_replays_its_steps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    from pipelines.demo import init_store
    from pipelines.digits import train_torch

    monkeypatch.setenv("REFRUN_DELIVERY", "thread")
    init_store(_store(tmp_path), "digits-mlp")
    common = ["--seed", "2", "--steps", str(STEPS), "--eval-every", "10", "--quiet",
              "--tracking-uri", _store(tmp_path), "--spool-dir", str(tmp_path / "spool")]
    ids = []
    for extra in ([], ["--resume", "15,25"]):
        assert train_torch.main([*common, *extra]) == 0
        ids.append(re.findall(r"\] run ([0-9a-f]{32}) ", capsys.readouterr().out)[-1])
    plain, resumed = ids
    for metric in ("loss", "grad_norm/fc1.weight", "eval/val_loss", "eval/final_val_loss"):
        a, b = _series(plain, tmp_path, metric), _series(resumed, tmp_path, metric)
        assert sorted(a) == sorted(b) and a, metric
        np.testing.assert_allclose([b[k] for k in sorted(a)], [a[k] for k in sorted(a)],
                                   rtol=1e-6, err_msg=metric)
    hist = MlflowClient(_store(tmp_path)).get_metric_history(resumed, "loss")
    assert len(hist) == STEPS + 10  # steps 16..25 logged twice
    # the momentum buffer was restored too: without it step 16's replay would differ
    assert _series(resumed, tmp_path, "loss")[16] == pytest.approx(
        _series(plain, tmp_path, "loss")[16], rel=1e-7)


def test_digits_resume_is_refused_where_no_checkpoint_is_written() -> None:
    from pipelines.digits import cli

    with pytest.raises(SystemExit):
        cli.parse(["--resume", "5,10"], "jax", "x")
    with pytest.raises(SystemExit):
        cli.parse(["--resume", "10,5"], "torch", "x")
    with pytest.raises(SystemExit):  # known-good evidence is a same-seed pair
        cli.parse(["--known-good", "why"], "torch", "x")
    assert cli.parse(["--resume", "5,10"], "torch", "x").step_order()[:13] == \
        [*range(11), 6, 7]


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["digits", "charlm"])
def test_jax_host_read_leaves_the_numbers_and_bf16_moves_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, workload: str) -> None:
    """``float_loss`` reads the loss on the host and changes nothing it computes;
    ``bf16_matmul`` changes the loss by more than float32 rounding from the first step."""
    import importlib

    from pipelines.demo import init_store

    monkeypatch.setenv("REFRUN_DELIVERY", "thread")
    exp = {"digits": "digits-mlp", "charlm": "charlm"}[workload]
    init_store(_store(tmp_path), exp)
    port = importlib.import_module(f"pipelines.{workload}.train_jax")
    common = ["--seed", "0", "--steps", "12", "--quiet", "--tracking-uri", _store(tmp_path),
              "--spool-dir", str(tmp_path / "spool")]
    ids = {}
    for name, extra in (("plain", []), ("float_loss", ["--defect", "float_loss"]),
                        ("bf16", ["--defect", "bf16_matmul"])):
        assert port.main([*common, *extra]) == 0
        ids[name] = re.findall(r"\] run ([0-9a-f]{32}) ", capsys.readouterr().out)[-1]
    plain = _series(ids["plain"], tmp_path, "loss")
    assert len(plain) == 12
    assert _series(ids["float_loss"], tmp_path, "loss") == plain
    bf16 = _series(ids["bf16"], tmp_path, "loss")
    gap = max(abs(bf16[k] - plain[k]) for k in plain)
    assert 1e-5 < gap < 0.1 * abs(plain[0]), gap

"""Criteria scoped to some backends (``backends = [...]``), on real recorded runs: not
applicable to another backend's candidate (no level blocked, exit 0), still evaluated for a
listed backend (pass and fail, evidence against numpy), the typo check kept for applicable
criteria, the outcome in the JSON, the recorded tags and the HTML report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from acceptance_helpers import STEPS, Logged, N, base_loss, record, write_criteria
from mlflow.tracking import MlflowClient

from refrun.acceptance import assess, load_criteria
from refrun.cli import main
from refrun.comparison import load_run
from refrun.errors import RefrunInputError
from refrun.report.assessment import assessment_section

WARMUP = 5

# Host syncs and CPU fallbacks are recorded only by the PyTorch/XLA probe.
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
backends = ["TORCH_XLA"]

[[criteria]]
id = "no-fallback"
level = "L2"
kind = "fallback"
backends = ["torch_xla"]

[[criteria]]
id = "goal"
level = "L3"
kind = "claim"
metric = "eval/accuracy"
at_least = 0.8
"""


class World:
    uri: str
    spool: Path
    ref: Logged
    torch: Logged
    xla_good: Logged
    xla_bad: Logged
    untagged: Logged


def _common(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"loss": base_loss() + rng.normal(0, 0.02, N), "eval/accuracy": np.full(N, 0.86)}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    tmp = tmp_path_factory.mktemp("backends")
    w = World()
    w.uri, w.spool = f"sqlite:///{tmp}/mlflow.db", tmp / "spool"
    w.ref = record(w.uri, w.spool, "reference", _common(0), backend="torch")
    w.torch = record(w.uri, w.spool, "candidate", _common(1), backend="torch", seed=1)
    # Benign XLA port: syncs only during warm-up, no fallback op.
    syncs_good = np.where(STEPS < WARMUP, 2.0, 0.0)
    w.xla_good = record(w.uri, w.spool, "candidate",
                        {**_common(2), "xfer/host_syncs": syncs_good}, backend="torch_xla",
                        hardware="tpu-v5e", seed=2, tags={"refrun.fallback.ops": "{}"})
    # A .item() inside every step (two on every third step), and an op falling back.
    syncs_bad = np.where(STEPS % 3 == 0, 2.0, 1.0)
    w.xla_bad = record(w.uri, w.spool, "candidate",
                       {**_common(3), "xfer/host_syncs": syncs_bad}, backend="torch_xla",
                       hardware="tpu-v5e", seed=3,
                       tags={"refrun.fallback.ops": '{"aten::nonzero": 6}'})
    w.untagged = record(w.uri, w.spool, "candidate", _common(4), backend=None, seed=4)
    return w


def _assess(w: World, tmp: Path, cand: Logged, body: str = CRITERIA):
    crit = load_criteria(write_criteria(tmp, body))
    return assess(crit, [load_run(w.ref.run_id, tracking_uri=w.uri, progress=False)],
                  load_run(cand.run_id, tracking_uri=w.uri, progress=False))


def test_not_applicable_to_another_backend(world: World, tmp_path: Path) -> None:
    a = _assess(world, tmp_path, world.torch)
    for cid in ("host-syncs", "no-fallback"):
        r = a.result(cid)
        assert r.outcome == "not_applicable", r
        assert "'torch'" in r.reason and "torch_xla" in r.reason.lower()
        assert r.evidence["candidate_backend"] == "torch"
    l2 = a.level("L2")
    assert l2.status == "not_applicable" and l2.not_applicable == 2
    assert l2.passed == l2.failed == l2.not_evaluable == 0
    # L2 is transparent: the walk goes on to L3, and nothing blocks the verdict.
    assert a.highest_level == "L3"
    assert a.verdict == "pass" and a.exit_code == 0
    assert "NOT_APPLICABLE" in a.table()


def test_mixed_level_ignores_not_applicable(world: World, tmp_path: Path) -> None:
    body = CRITERIA + ('\n[[criteria]]\nid = "l2-loss"\nlevel = "L2"\nkind = "closeness"\n'
                       'metric = "loss"\nabs_tol = 0.2\n')
    a = _assess(world, tmp_path, world.torch, body)
    l2 = a.level("L2")
    assert (l2.status, l2.passed, l2.not_applicable) == ("pass", 1, 2)
    assert a.highest_level == "L3" and a.verdict == "pass"


def test_still_evaluated_for_a_listed_backend(world: World, tmp_path: Path) -> None:
    good = _assess(world, tmp_path, world.xla_good)
    syncs = good.result("host-syncs")
    assert syncs.outcome == "pass"
    after = world.xla_good.metrics["xfer/host_syncs"][STEPS >= WARMUP]
    assert syncs.evidence["per_step_mean"] == pytest.approx(float(after.mean()))
    assert syncs.evidence["steps_after_warmup"] == N - WARMUP
    assert good.result("no-fallback").outcome == "pass"
    assert good.level("L2").status == "pass" and good.highest_level == "L3"
    assert good.verdict == "pass"

    bad = _assess(world, tmp_path, world.xla_bad)
    syncs = bad.result("host-syncs")
    after = world.xla_bad.metrics["xfer/host_syncs"][STEPS >= WARMUP]
    assert syncs.outcome == "fail"
    assert syncs.evidence["value"] == pytest.approx(float(after.mean()))
    assert float(after.mean()) > 0.5
    fb = bad.result("no-fallback")
    assert fb.outcome == "fail" and fb.evidence["outside_allowlist"] == {"aten::nonzero": 6}
    assert bad.level("L2").status == "fail" and bad.highest_level == "L1"
    assert bad.verdict == "fail" and bad.exit_code == 1


def test_candidate_without_backend_tag_is_not_evaluable(world: World, tmp_path: Path) -> None:
    a = _assess(world, tmp_path, world.untagged)
    r = a.result("no-fallback")
    assert r.outcome == "not_evaluable" and "refrun.backend" in r.reason
    assert a.level("L2").status == "not_evaluable" and a.highest_level == "L1"
    assert a.verdict == "incomplete" and a.exit_code == 1


def test_l4_not_applicable_even_when_held_back(world: World, tmp_path: Path) -> None:
    body = CRITERIA.replace("at_least = 0.8", "at_least = 0.99") + (
        '\n[[criteria]]\nid = "speed"\nlevel = "L4"\nkind = "step_time"\nmax_ratio = 1.5\n'
        'backends = ["jax"]\n')
    a = _assess(world, tmp_path, world.torch, body)
    assert a.level("L3").status == "fail"
    r = a.result("speed")
    assert r.outcome == "not_applicable" and r.evaluated is True
    assert a.level("L4").status == "not_applicable"


def test_cli_accept_exit_codes_json_and_tags(world: World, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    crit = write_criteria(tmp_path, CRITERIA)
    args = ["accept", "--criteria", str(crit), "--reference", world.ref.run_id,
            "--tracking-uri", world.uri]
    out = tmp_path / "a.json"
    # No run of this comparison has xfer/host_syncs: the scoped criterion is no typo.
    assert main([*args, "--candidate", world.torch.run_id, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "NOT_APPLICABLE" in text and "highest level reached: L3" in text
    data = json.loads(out.read_text())
    assert data["verdict"] == "pass"
    outcomes = {r["id"]: r["outcome"] for r in data["results"]}
    assert outcomes["host-syncs"] == outcomes["no-fallback"] == "not_applicable"
    l2 = next(lv for lv in data["levels"] if lv["level"] == "L2")
    assert l2["status"] == "not_applicable" and l2["not_applicable"] == 2
    comp_id = text.split("recorded on comparison run ")[1].split()[0]
    tags = MlflowClient(world.uri).get_run(comp_id).data.tags
    assert tags["refrun.acceptance.L2"] == "not_applicable"
    assert tags["refrun.acceptance.verdict"] == "pass"
    assert main([*args, "--candidate", world.xla_bad.run_id, "--no-record"]) == 1
    assert main([*args, "--candidate", world.xla_good.run_id, "--no-record"]) == 0


@pytest.mark.parametrize(("scope", "candidate", "rc"), [
    ("", "torch", 2),                              # applies to every backend: a typo
    ('backends = ["torch_xla"]\n', "xla_good", 2),  # applies to this candidate: a typo
    ('backends = ["torch_xla"]\n', "torch", 0),     # not applicable: not checked
])
def test_typo_check_only_for_applicable_criteria(world: World, tmp_path: Path, scope: str,
                                                 candidate: str, rc: int,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    body = CRITERIA + ('\n[[criteria]]\nid = "typo"\nlevel = "L2"\nkind = "host_transfers"\n'
                       f'metrics = ["xfer/host_sycns"]\nmax = 0.5\n{scope}')
    crit = write_criteria(tmp_path, body)
    cand: Logged = getattr(world, candidate)
    got = main(["accept", "--criteria", str(crit), "--reference", world.ref.run_id,
                "--candidate", cand.run_id, "--tracking-uri", world.uri, "--no-record"])
    assert got == rc
    err = capsys.readouterr().err
    if rc == 2:
        assert "criteria[4].metrics (id 'typo'): metric 'xfer/host_sycns' is not recorded" \
            in err


@pytest.mark.parametrize(("value", "text"), [
    ('"torch_xla"', "criteria[0].backends (id 'c'): expected an array of strings, "
                    "got a string 'torch_xla'"),
    ("[1]", "criteria[0].backends (id 'c'): expected an array of strings"),
    ("[]", "criteria[0].backends (id 'c'): needs at least 1 item(s)"),
    ('["torch", " "]', "criteria[0].backends[1] (id 'c'): must not be empty"),
])
def test_bad_backends_value(tmp_path: Path, value: str, text: str) -> None:
    p = write_criteria(tmp_path, '[[criteria]]\nid = "c"\nlevel = "L2"\nkind = "fallback"\n'
                                 f"backends = {value}\n")
    with pytest.raises(RefrunInputError) as exc:
        load_criteria(p)
    assert str(exc.value).startswith(f"{p}:5: ") and text in str(exc.value), str(exc.value)


def test_report_shows_not_applicable(world: World, tmp_path: Path) -> None:
    a = _assess(world, tmp_path, world.torch)
    html = str(assessment_section(a.to_dict()))
    assert '<span class="badge not_applicable">not applicable</span>' in html
    assert "2 not applicable" in html

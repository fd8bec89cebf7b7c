"""Resuming from a checkpoint: what the probes record stays true, and the restore is judged.

Issue 52: a run that reloaded model, optimizer and scheduler state from a checkpoint and
replayed steps failed the learning-rate criteria, because ``Optimizer.load_state_dict``
replaces ``param_groups`` and the probe kept reading the old list (the recorded rate froze
at its value at load time).  Here real runs resume through a real checkpoint file
(``torch.save`` / ``torch.load``; JAX: optax state restored into a new pytree) and replay
steps into a real sqlite store; every recorded point of the rate and of the optimizer's
update count is checked against the schedule's formula, computed here.  Then calibrate
writes the ``restore`` criterion from reference seeds, and it fails resumes that lost the
optimizer's moments or the scheduler's position and passes a faithful one.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
torch = pytest.importorskip("torch")
try:  # the XLA device must exist before the process's first backward pass
    import torch_xla

    XLA_DEVICE = torch_xla.device()
except ImportError:
    torch_xla = XLA_DEVICE = None

import refrun  # noqa: E402
import refrun.torch  # noqa: E402
from refrun import schema  # noqa: E402
from refrun.acceptance.assess import assess_ids  # noqa: E402
from refrun.acceptance.calibration import CalibrationOptions, calibrate_ids, write_file  # noqa: E402
from refrun.acceptance.criteria import load_criteria  # noqa: E402
from refrun.comparison import compare, load_run  # noqa: E402
from refrun.report import build_report  # noqa: E402

STEPS, CHECKPOINT, INTERRUPT = 40, 15, 27  # checkpoint after step 15, crash after 27
BASE, BASE_PG1 = 0.05, 0.02
ORDER = list(range(INTERRUPT + 1)) + list(range(CHECKPOINT + 1, STEPS))


def factor(s: int) -> float:
    """The LambdaLR factor after ``s`` scheduler steps: 5 steps of warmup, then decay."""
    return min(1.0, (s + 1) / 5) * 0.93 ** s


def points(store, run_id: str, metric: str) -> list[tuple[int, float]]:
    """Every recorded point of ``metric`` (the curves artifact), in logging order."""
    steps, values, seq = load_run(run_id, tracking_uri=store.tracking_uri).series(metric)
    order = np.argsort(seq)
    return list(zip(steps[order].tolist(), values[order].tolist(), strict=True))


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(STEPS, 16, 6, generator=g)
    return x, torch.sin(x.sum(-1, keepdim=True))


def build(seed: int, sgd: bool = False, device: object = "cpu"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1)).to(device)
    groups = [{"params": model[0].parameters()},
              {"params": model[2].parameters(), "lr": BASE_PG1}]
    opt = torch.optim.SGD(groups, lr=BASE, momentum=0.9) if sgd else \
        torch.optim.Adam(groups, lr=BASE)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train(store, tmp: Path, *, seed: int = 0, role: str = "reference", resume: str | None = None,
          sgd: bool = False, xla: bool = False, give_optimizer: bool = True) -> str:
    """One run; with ``resume``, a checkpoint file after CHECKPOINT, a crash after INTERRUPT
    and a restart from the checkpoint (``ORDER``), restored as ``resume`` says:

    * ``faithful``: ``load_state_dict`` of model, optimizer and scheduler into the objects
      the probe was given;
    * ``rebuilt``: model, optimizer and scheduler built anew and loaded, the probe told
      (``probe.observe``); ``new_optimizer``: the optimizer and scheduler built anew over
      the same model and loaded, the probe not told (it follows the new optimizer);
    * ``no_moments``: the checkpoint's parameter groups without the optimizer's state (the
      moments dropped, the schedule intact); ``fresh_optimizer``: a new optimizer and
      scheduler after the reload, nothing of the optimizer's checkpoint loaded;
    * ``no_scheduler``: model and optimizer restored, the scheduler starts again."""
    device = XLA_DEVICE if xla else "cpu"
    model, opt, sched = build(seed, sgd, device)
    x, y = (t.to(device) for t in data(seed))
    path = tmp / f"ckpt-{seed}-{resume}-{role}.pt"
    with refrun.start_run("resume-test", role, hardware="cpu", seed=seed, chips=1,
                          backend="torch_xla" if xla else "torch", planned_steps=STEPS,
                          tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                          snapshot_environment=False, delivery="thread") as run:
        if xla:
            from refrun.xla import instrument as xla_instrument

            probe = xla_instrument(run, model=model, optimizer=opt if give_optimizer else None)
        else:
            probe = refrun.torch.instrument(run, model=model,
                                            optimizer=opt if give_optimizer else None)
        crashed = False
        for n in (ORDER if resume else range(STEPS)):
            with probe.step(n):
                loss = torch.nn.functional.mse_loss(model(x[n]), y[n])
                loss.backward()
                opt.step()
                opt.zero_grad()
                probe.log(loss=loss.detach())
                if xla:  # a step's graph cut where a PyTorch/XLA loop cuts it (without it
                    torch_xla.sync()  # the whole run is one graph, compiled at close)
            sched.step()
            if resume and n == CHECKPOINT and not crashed:
                state = {"model": model.state_dict(), "opt": opt.state_dict(),
                         "sched": sched.state_dict()}
                if xla:
                    import torch_xla.core.xla_model as xm

                    xm.save(state, str(path))
                else:
                    torch.save(state, path)
            if resume and n == INTERRUPT and not crashed:
                crashed = True
                model, opt, sched = restore(resume, path, model, opt, sched, probe, seed,
                                            sgd, device)
        probe.log_eval(STEPS - 1, val_loss=float(loss.detach()))  # one L3 value for calibrate
        probe.close()
    return run.run_id


def restore(how: str, path: Path, model, opt, sched, probe, seed: int, sgd: bool, device):
    ckpt = torch.load(path, weights_only=False)
    if how in ("rebuilt", "new_optimizer", "fresh_optimizer"):
        new_model, new_opt, new_sched = build(seed, sgd, device)
        if how != "rebuilt":  # the same model: only the optimizer and scheduler are new
            new_opt = type(opt)([{"params": model[0].parameters()},
                                 {"params": model[2].parameters(), "lr": BASE_PG1}],
                                lr=BASE, **({"momentum": 0.9} if sgd else {}))
            new_sched = torch.optim.lr_scheduler.LambdaLR(new_opt, factor)
            new_model = model
        new_model.load_state_dict(ckpt["model"])
        if how != "fresh_optimizer":
            new_opt.load_state_dict(ckpt["opt"])
            new_sched.load_state_dict(ckpt["sched"])
        if how == "rebuilt":
            probe.observe(model=new_model, optimizer=new_opt)
        return new_model, new_opt, new_sched
    model.load_state_dict(ckpt["model"])
    if how == "no_moments":
        opt.load_state_dict({"state": {}, "param_groups": ckpt["opt"]["param_groups"]})
    else:
        opt.load_state_dict(ckpt["opt"])
    if how != "no_scheduler":
        sched.load_state_dict(ckpt["sched"])
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor, last_epoch=-1)
    return model, opt, sched


def assert_true_rates(store, run_id: str, counts: bool = True) -> None:
    """Every recorded point of each group's rate is the schedule's rate for that step's
    update, and of the update count the number of updates after that step (one per step),
    across the replay: what a faithful resume's optimizer holds."""
    for metric, base in ((schema.M_LR, BASE), (f"{schema.M_LR}/pg1", BASE_PG1)):
        got = points(store, run_id, metric)
        assert [s for s, _ in got] == ORDER, metric
        assert [v for _, v in got] == pytest.approx([base * factor(s) for s in ORDER],
                                                    rel=1e-12), metric
    if counts:
        got = points(store, run_id, schema.M_OPT_STEPS)
        assert got == [(s, float(s + 1)) for s in ORDER]


@pytest.mark.parametrize("how", ["faithful", "rebuilt", "new_optimizer"])
def test_a_resumed_torch_run_records_the_optimizers_rate_and_count_at_every_step(
        store, tmp_path: Path, how: str) -> None:
    """The rate recorded at every step, replayed steps included, is the optimizer's:
    reloaded into the same optimizer (``param_groups`` replaced), into a rebuilt one the
    probe was told about, or into a new one over the same model it was not told about."""
    run_id = train(store, tmp_path, resume=how)
    assert_true_rates(store, run_id)
    warnings = store.artifact_text(run_id, schema.ARTIFACT_WARNINGS)
    assert ("a new optimizer over the model's parameters stepped" in warnings) == \
        (how == "new_optimizer")


def test_a_resumed_xla_run_records_the_optimizers_rate_and_count_at_every_step(
        store, tmp_path: Path) -> None:
    """PyTorch/XLA (the block path of the probe): the same, through an ``xm.save``
    checkpoint reloaded into the optimizer the probe was given."""
    if torch_xla is None:
        pytest.skip("torch_xla is not installed")
    import torch_xla.debug.metrics as met

    def counts() -> dict[str, int]:
        return {k: met.counter_value(name) or 0 for k, name in (
            ("syncs", "aten::_local_scalar_dense"), ("to_cpu", "xla::_to_cpu"),
            ("exec", "ExecuteComputation"))}

    deltas = {}
    for give in (True, False):  # the same resumed run, probed with and without the optimizer
        before = counts()
        run_id = train(store, tmp_path, resume="faithful", xla=True, give_optimizer=give,
                       seed=0 if give else 1)
        deltas[give] = {k: v - before[k] for k, v in counts().items()}
        if give:
            assert_true_rates(store, run_id)
    # reading the rates and the count (host numbers) adds no sync, copy or execution
    assert deltas[True] == deltas[False], deltas


def restore_result(assessment):
    return next(r for r in assessment.results if r.kind == "restore")


def test_calibrate_writes_the_restore_criterion_and_it_judges_resumes(store,
                                                                       tmp_path: Path) -> None:
    """Three reference seeds; `refrun calibrate` writes the restore criterion (no known-good
    pair: bit for bit) and no criterion on the update count.  A faithful resume passes it
    and every learning-rate criterion; resumes that lost the optimizer's moments (its
    state dropped, or a fresh optimizer) or the scheduler's position fail it, each for its
    reason; a run that never resumed is not judged by it."""
    refs = [train(store, tmp_path, seed=s) for s in range(3)]
    cal = calibrate_ids(refs, store.tracking_uri, CalibrationOptions(group_size=2))
    out = tmp_path / "criteria.toml"
    write_file(cal, str(out))
    crit = load_criteria(out)
    kinds = {c.id: c for c in crit.criteria}
    rc = kinds["resume-reproduces"]
    assert (rc.KIND, rc.level, rc.metric, rc.band_steps) == ("restore", "L2", "loss", None)
    assert not [c for c in crit.criteria if getattr(c, "metric", None) == schema.M_OPT_STEPS]
    lr_ids = [c.id for c in crit.criteria if getattr(c, "metric", "") == schema.M_LR]
    assert lr_ids

    def judge(**kw):
        cand = train(store, tmp_path, seed=3, role="candidate", **kw)
        a, _ = assess_ids(crit, refs[:2], cand, store.tracking_uri)
        return a, restore_result(a)

    a, r = judge(resume="faithful")
    assert r.outcome == "pass", r.reason
    assert [x.outcome for x in a.results if x.id in lr_ids] == ["pass"] * len(lr_ids)
    rec = r.evidence["restores"]
    assert len(rec) == 1 and (rec[0]["step"], rec[0]["after_step"]) == (CHECKPOINT + 1,
                                                                        INTERRUPT)
    assert rec[0]["identical"] and rec[0]["replayed"] == INTERRUPT - CHECKPOINT
    state = {s["metric"]: s for s in rec[0]["state"]}
    assert state[schema.M_OPT_STEPS]["replay_at_restore"] == CHECKPOINT + 2
    assert state[schema.M_LR]["replay_at_restore"] == pytest.approx(
        BASE * factor(CHECKPOINT + 1), rel=1e-12)

    _, r = judge(resume="no_moments")
    assert r.outcome == "fail"
    assert f"{schema.M_OPT_STEPS} at replayed step {CHECKPOINT + 1} is 1 where the first " \
           f"pass had {CHECKPOINT + 2}" in r.reason
    assert "the optimizer's state was not restored" in r.reason

    _, r = judge(resume="fresh_optimizer")
    assert r.outcome == "fail" and "did not reproduce" in r.reason

    a, r = judge(resume="no_scheduler")
    assert r.outcome == "fail"
    assert f"{schema.M_LR} at replayed step {CHECKPOINT + 1}" in r.reason
    assert "the scheduler's position was not restored" in r.reason
    # The report shows the restore: where, and the state it resumed with.
    html = build_report(compare(refs[:2], a.candidate_id, tracking_uri=store.tracking_uri),
                        assessment=a, plotlyjs="cdn").html
    table = html[html.index('id="restores"'):]
    table = table[:table.index("</table>")]
    numbers = [c.split('"', 1)[0] for c in table.split('data-value="')[1:]]
    assert numbers[:3] == [str(CHECKPOINT + 1), str(INTERRUPT), str(INTERRUPT - CHECKPOINT)]
    # the loss: its first difference and largest one; then the rate it resumed with (the
    # restarted scheduler's) and the first pass's
    assert f"differs from step {CHECKPOINT + 2}, max |diff| " in table
    assert [float(x) for x in numbers[4:6]] == pytest.approx(
        [BASE * factor(0), BASE * factor(CHECKPOINT + 1)], rel=1e-12)
    assert f"differs from step {CHECKPOINT + 1}</span>" in table  # the rate's cell

    a, r = judge()
    assert r.outcome == "not_applicable", r.reason
    assert "replays no step" in r.reason


def test_sgd_momentum_lost_in_a_resume_fails_by_the_replayed_loss(store,
                                                                   tmp_path: Path) -> None:
    """SGD keeps no update count: a resume that dropped the momentum buffers is caught by
    the replayed loss, which differs from the first pass from the second replayed step on
    (the first replayed step's loss comes from restored weights, before any update); the
    faithful one repeats it bit for bit."""
    crit_text = """version = 1
workload = "resume-test"
[[criteria]]
id = "resume-reproduces"
level = "L2"
kind = "restore"
metric = "loss"
"""
    path = tmp_path / "c.toml"
    path.write_text(crit_text)
    crit = load_criteria(path)
    ref = train(store, tmp_path, seed=0, sgd=True)
    outcomes = {}
    for how in ("faithful", "no_moments"):
        cand = train(store, tmp_path, seed=1, role="candidate", resume=how, sgd=True)
        a, _ = assess_ids(crit, [ref], cand, store.tracking_uri)
        outcomes[how] = restore_result(a)
    assert outcomes["faithful"].outcome == "pass", outcomes["faithful"].reason
    bad = outcomes["no_moments"]
    assert bad.outcome == "fail"
    assert f"replayed loss differs from the first pass from step {CHECKPOINT + 2} on" \
        in bad.reason
    # SGD records no update count: the state compared is the two groups' rates.
    assert [s["metric"] for s in bad.evidence["restores"][0]["state"]] == \
        [schema.M_LR, f"{schema.M_LR}/pg1"]


def test_observe_refuses_what_a_torch_probe_cannot_read(store) -> None:
    from refrun.errors import RefrunInputError

    with refrun.start_run("resume-test", "reference", hardware="cpu", backend="torch",
                          tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                          snapshot_environment=False, delivery="thread") as run, \
            refrun.torch.instrument(run) as probe:
        with pytest.raises(RefrunInputError, match=r"optimizer: expected a torch\.optim"):
            probe.observe(optimizer="adam")
        with pytest.raises(RefrunInputError, match="params: the torch probe reads model="):
            probe.observe(params={})

"""Reduced precision in a same-seed pair: a platform's default numerics told apart from a
port defect by a precision twin (refrun.acceptance.precision; docs/acceptance.md,
"Reduced precision: precision twins").

One world on the tiny torch MLP of tests/test_acceptance_paired.py: 5 reference seeds in
float32 on the CPU, the known-good rerun of seed 0 (input features permuted), criteria
from `refrun calibrate`; then ports of seed 2, each recorded through refrun's probe, whose
numerics configuration is read and recorded by refrun itself:

* **JAX on an emulated TPU.**  XLA:CPU ignores ``jax_default_matmul_precision``
  (tests/test_numerics.py checks it), so the TPU's arithmetic is emulated where the
  platform applies it: while the precision in force is JAX's default, every matmul of the
  port, and of its gradient, is one bfloat16 pass with float32 accumulation (what the
  TPU's matrix unit does at DEFAULT); at ``highest`` it is float32.  The precision is set
  the way users set it (left unset, ``jax.config.update``, a context manager) and read by
  refrun; only ``refrun.numerics.jax.platform`` is set to ``tpu`` after recording (the CPU
  is what ran).  The four runs measured on the TPU v5e: the exact port and a port casting
  its matmuls to bfloat16, each at default and at highest precision.
* **PyTorch at ``torch.set_float32_matmul_precision('medium')``** on this CPU: real
  reduced precision where oneDNN has bfloat16 matmul kernels (AVX512-BF16 / AMX), nothing
  emulated; on a CPU without them ``medium`` is float32 and the test asserts that
  instead (decided by measuring a matmul, independently of refrun).

Expected outcomes, written before the first assessment (2026-12-06): the exact port at
default precision alone leaves the band (its divergence is the bfloat16 port's), is
accepted through its twin at highest precision with a reason naming the precision; the
bfloat16 port is rejected at both precisions; without a twin the failure names the
precision and the rerun.  Divergence ratios are recomputed with numpy from the logged
losses and the criteria file's band, independently of refrun.acceptance.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

import refrun
import refrun.jax
import refrun.torch
from refrun import numerics, schema
from refrun.acceptance.calibration import CalibrationOptions, calibrate_ids, write_file
from refrun.acceptance.signoff import sign_off, verify
from refrun.cli import main
from refrun.comparison import compare
from refrun.errors import RefrunInputError
from refrun.pairing import pair_tags
from refrun.report import build_report
from tests.conftest import migrated_sqlite
from tests.test_acceptance_paired import (
    EVAL_X,
    EVAL_Y,
    STEPS,
    World,
    assess_run,
    make_world,
    mlp,
    train,
)

WORKLOAD = "paired-mlp"
SEED = 2  # the seed every port here starts from
BF16, F32 = jnp.bfloat16, jnp.float32


# --- the emulated TPU: one bfloat16 pass per float32 matmul at JAX's default precision ----
def _one_pass(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a.astype(BF16), b.astype(BF16), preferred_element_type=F32)


@jax.custom_vjp
def tpu_default_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """A float32 dot as a TPU computes it at DEFAULT precision: inputs rounded to bfloat16,
    products accumulated in float32; its gradient's dots alike."""
    return _one_pass(a, b)


def _fwd(a: jax.Array, b: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _one_pass(a, b), (a, b)


def _bwd(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    a, b = res
    return _one_pass(g, b.T).astype(a.dtype), _one_pass(a.T, g).astype(b.dtype)


tpu_default_dot.defvjp(_fwd, _bwd)


def platform_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """The emulated TPU's dot at the precision in force when the step is traced."""
    if jax.config.jax_default_matmul_precision in (None, "default", "bfloat16"):
        return tpu_default_dot(a, b)
    return jnp.dot(a, b, preferred_element_type=F32)


def jax_port(seed: int, defect: bool) -> Callable[[Any], np.ndarray]:
    """The JAX port of :func:`tests.test_acceptance_paired.mlp` (seed): its weights and
    batches, SGD with torch's momentum rule; ``defect``: every matmul's inputs cast to
    bfloat16 in the code (a mixed-precision port).  Returns ``train(probe)``: the
    per-step losses, each logged through ``probe``, then the final evaluation's."""
    m = mlp(seed)
    params = {k: jnp.asarray(getattr(m, k).detach().numpy()) for k in ("w1", "b1", "w2", "b2")}
    xs, ys = jnp.asarray(m.xs.numpy()), jnp.asarray(m.ys.numpy())

    def mm(a: jax.Array, b: jax.Array) -> jax.Array:
        if defect:
            a, b = a.astype(BF16), b.astype(BF16)
        return platform_dot(a, b).astype(F32)

    def loss_fn(p: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
        logits = mm(jnp.tanh(mm(x, p["w1"].T) + p["b1"]), p["w2"].T) + p["b2"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    @jax.jit
    def step(p: dict[str, jax.Array], buf: dict[str, jax.Array], x: jax.Array,
             y: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        buf = {k: 0.9 * buf[k] + g[k] for k in p}
        return {k: p[k] - 0.2 * buf[k] for k in p}, buf, loss

    def run(probe: Any) -> np.ndarray:
        p, buf = dict(params), {k: jnp.zeros_like(v) for k, v in params.items()}
        losses = []
        for s in range(STEPS):
            with probe.step(s):
                p, buf, loss = step(p, buf, xs[s], ys[s])
                probe.log(loss=loss)
            losses.append(loss)
        val = jax.jit(loss_fn)(p, jnp.asarray(EVAL_X.numpy()), jnp.asarray(EVAL_Y.numpy()))
        probe.log_eval(STEPS - 1, val_loss=val)  # the final evaluation, as the seeds'
        return np.array([float(x) for x in [*losses, val]])

    return run


def record_ref(w: World, name: str, role: str, seed: int, losses: np.ndarray,
               tags: dict[str, str] | None = None) -> str:
    """:func:`tests.test_acceptance_paired._record` with this process's environment tags,
    so the references record their numerics configuration (torch's, at ``highest``)."""
    with refrun.start_run(WORKLOAD, role, backend="torch", hardware="cpu", seed=seed,
                          planned_steps=STEPS, tracking_uri=w.uri, spool_dir=w.tmp / "spool",
                          tags=tags or {}, delivery="thread") as run:
        for s, v in enumerate(losses[:-1]):
            run.log(s, loss=float(v))
        run.log_eval(len(losses) - 2, val_loss=float(losses[-1]))
    assert run.run_id is not None
    w.losses[name] = losses
    return run.run_id


def torch_train(seed: int, mode: str, probe: Any) -> np.ndarray:
    """:func:`tests.test_acceptance_paired.train`'s training (``fp32``, or ``bf16``: every
    matmul in bfloat16) with each step recorded through ``probe``; the same operations in
    the same order, so at ``highest`` precision its losses are the reference's, bit for
    bit, then the final evaluation's."""
    m = mlp(seed)
    w1, b1, w2, b2, opt, xs, ys = m.w1, m.b1, m.w2, m.b2, m.opt, m.xs, m.ys

    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a.bfloat16() @ b.bfloat16()).float() if mode == "bf16" else a @ b

    losses = []
    for s in range(STEPS):
        with probe.step(s):
            loss = torch.nn.functional.cross_entropy(
                mm(torch.tanh(mm(xs[s], w1.T) + b1), w2.T) + b2, ys[s])
            opt.zero_grad()
            loss.backward()
            opt.step()
            probe.log(loss=loss.detach())
        losses.append(loss.item())
    with torch.no_grad():
        val = torch.nn.functional.cross_entropy(
            mm(torch.tanh(mm(EVAL_X, w1.T) + b1), w2.T) + b2, EVAL_Y)
    probe.log_eval(STEPS - 1, val_loss=val)
    return np.r_[losses, val.item()]


def record_jax(w: World, name: str, defect: bool, precision: str, how: str,
               tags: dict[str, str]) -> str:
    """Record the JAX port of seed 2 at ``precision`` set ``how`` (``unset``, ``config``:
    jax.config.update, ``context``: a context manager around the loop), then mark the run
    as a TPU's (the emulated platform)."""
    train_fn = jax_port(SEED, defect)
    jax.config.update("jax_default_matmul_precision", None)
    try:
        if how == "config":
            jax.config.update("jax_default_matmul_precision", precision)
        with refrun.start_run(WORKLOAD, "candidate", backend="jax", hardware="cpu",
                              seed=SEED, planned_steps=STEPS, tracking_uri=w.uri,
                              spool_dir=w.tmp / "spool", tags=tags,
                              delivery="thread") as run:
            if how == "context":
                with jax.default_matmul_precision(precision):
                    probe = refrun.jax.instrument(run, monitors=None)
                    losses = train_fn(probe)
            else:
                probe = refrun.jax.instrument(run, monitors=None)
                losses = train_fn(probe)
            probe.close()
    finally:
        jax.config.update("jax_default_matmul_precision", None)
    assert run.run_id is not None
    MlflowClient(w.uri).set_tag(run.run_id, schema.TAG_NUMERICS_JAX_PLATFORM, "tpu")
    w.losses[name] = losses
    w.runs[name] = run.run_id
    return run.run_id


def torch_bf16_cpu() -> bool:
    """Whether ``medium`` really computes float32 matmuls in bfloat16 here: a product's
    error against float64 grows by orders of magnitude (measured, not asked of torch)."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(64, 256, generator=g), torch.randn(256, 64, generator=g)
    exact = a.double() @ b.double()
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        medium = float((a @ b - exact).abs().max())
    finally:
        torch.set_float32_matmul_precision(old)
    return medium > 100 * float((a @ b - exact).abs().max())


def record_torch(w: World, name: str, mode: str, precision: str, port: str) -> str:
    """Record the reference code of seed 2 (``mode`` ``fp32``, or ``bf16``: its matmuls
    cast to bfloat16) at torch float32 matmul precision ``precision``, through the probe."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        with refrun.start_run(WORKLOAD, "candidate", backend="torch", hardware="cpu",
                              seed=SEED, planned_steps=STEPS, tracking_uri=w.uri,
                              spool_dir=w.tmp / "spool",
                              tags=pair_tags(SEED, port=port), delivery="thread") as run:
            probe = refrun.torch.instrument(run, monitors=None)
            losses = torch_train(SEED, mode, probe)
            probe.close()
    finally:
        torch.set_float32_matmul_precision(old)
    assert run.run_id is not None
    w.losses[name] = losses
    w.runs[name] = run.run_id
    return run.run_id


@dataclass
class Precision(World):
    torch_bf16: bool = False
    band: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Precision:
    tmp = tmp_path_factory.mktemp("precision")

    def extra(w: Precision) -> None:
        exact, bf16 = pair_tags(SEED, port="mlp-jax"), pair_tags(SEED, port="mlp-jax+bf16")
        record_jax(w, "exact@default", False, "default", "unset", exact)
        record_jax(w, "exact@highest", False, "highest", "context", exact)
        record_jax(w, "bf16@default", True, "default", "unset", bf16)
        record_jax(w, "bf16@highest", True, "highest", "config", bf16)
        record_jax(w, "exact@default-no-port", False, "default", "unset", pair_tags(SEED))
        w.torch_bf16 = torch_bf16_cpu()
        record_torch(w, "torch@medium", "fp32", "medium", "mlp-torch")
        record_torch(w, "torch@highest", "fp32", "highest", "mlp-torch")
        record_torch(w, "torch-bf16@medium", "bf16", "medium", "mlp-torch+bf16")
        record_torch(w, "torch-bf16@highest", "bf16", "highest", "mlp-torch+bf16")

    w = make_world(Precision(uri=migrated_sqlite(tmp / "mlflow.db", tmp_path_factory),
                             tmp=tmp), record_ref, train, extra)
    (w.band,) = [c for c in tomllib.loads(w.path.read_text())["criteria"]
                 if c["kind"] == "paired" and c["metric"] == "loss"]
    return w


def ratio(w: Precision, name: str, pair: str = f"seed{SEED}") -> float:
    """max_t |D(t)| / envelope(t): the run's running max |loss - pair's loss| over the
    criteria file's known-good envelope (its knots held as a step function), recomputed."""
    d = np.maximum.accumulate(np.abs(w.losses[name][:STEPS] - w.losses[pair][:STEPS]))
    ks, kv = np.array(w.band["band_steps"]), np.array(w.band["band_values"])
    env = kv[np.clip(np.searchsorted(ks, np.arange(STEPS), side="right") - 1, 0, None)]
    return float(np.max(d / env))


def paired(w: Precision, name: str, **kw: Any) -> Any:
    a, _ = assess_run(w, name, **kw)
    return a, a.result("loss-paired")


def test_the_exact_port_at_the_tpu_default_is_accepted_through_its_twin(
        world: Precision) -> None:
    limit = world.band["max_ratio"]
    # Alone it leaves the band like the bfloat16 port (as on the TPU v5e: 985x and 872x) ...
    alone, defect = ratio(world, "exact@default"), ratio(world, "bf16@default")
    assert alone > 10 * limit and defect > 10 * limit and 0.1 < alone / defect < 10
    # ... and at highest precision it stays inside (the twin that separates the two).
    assert ratio(world, "exact@highest") < limit
    a, p = paired(world, "exact@default")
    assert p.outcome == "pass", p.reason
    assert a.verdict == "pass", a.table()  # every seed band passes the bfloat16 arithmetic too
    assert "ran at reduced precision (float32 matmuls and convolutions as 1-pass bfloat16 " \
           "where its pair's ran as float32; jax_default_matmul_precision=default on tpu)" \
        in p.reason
    twin = world.runs["exact@highest"]
    assert f"its precision twin {twin}" in p.reason and \
        "the difference is the platform's precision" in p.reason
    num = p.evidence["numerics"]
    assert num["attribution"] == "platform precision" and num["reduced"] is True
    assert num["twin"]["run_id"] == twin and num["twin"]["source"] == "store"
    assert num["twin"]["judgement"]["first_divergence_step"] is None
    assert num["twin"]["judgement"]["max_ratio_observed"] == pytest.approx(
        ratio(world, "exact@highest"), rel=1e-6)
    assert p.evidence["max_ratio_observed"] == pytest.approx(alone, rel=1e-6)
    # |candidate - twin|: what the precision alone does to this port.
    between = np.abs(world.losses["exact@default"][:STEPS]
                     - world.losses["exact@highest"][:STEPS]).max()
    assert num["twin"]["precision_divergence"] == pytest.approx(between, rel=1e-6)
    assert "JAX_DEFAULT_MATMUL_PRECISION=highest" in num["rerun"]


def test_the_bf16_port_is_rejected_at_both_precisions(world: Precision) -> None:
    limit = world.band["max_ratio"]
    assert ratio(world, "bf16@highest") > 10 * limit
    a, p = paired(world, "bf16@default")
    assert p.outcome == "fail" and a.verdict == "fail"
    twin = world.runs["bf16@highest"]
    assert f"and its precision twin {twin}" in p.reason
    assert p.reason.endswith("a port defect, not the platform's precision")
    assert p.evidence["numerics"]["attribution"] == "port"
    assert p.evidence["numerics"]["twin"]["judgement"]["max_ratio_observed"] == pytest.approx(
        ratio(world, "bf16@highest"), rel=1e-6)
    b, q = paired(world, "bf16@highest")
    assert q.outcome == "fail" and b.verdict == "fail"
    # the summary goes on with XLA_FLAGS when this worker imported torch_xla first (it sets
    # --xla_cpu_enable_fast_math=false in the process's environment, which JAX reads too)
    assert "it ran as precisely as its pair (float32 matmuls: 6-pass bfloat16 (~float32) " \
           "(jax_default_matmul_precision=highest on tpu, set by jax.config.update" \
           in q.reason and q.reason.endswith("not the platform's precision")
    assert q.evidence["numerics"]["attribution"] == "port"


def test_without_a_twin_the_failure_names_the_precision_and_the_rerun(
        world: Precision) -> None:
    a, p = paired(world, "exact@default-no-port")
    assert p.outcome == "fail" and a.verdict == "fail"
    assert "ran at reduced precision (float32 matmuls and convolutions as 1-pass bfloat16" \
        in p.reason
    assert "re-run the same code and seed on the same hardware with " \
           "JAX_DEFAULT_MATMUL_PRECISION=highest" in p.reason
    assert f"declares no port ({schema.TAG_PAIR_PORT}" in p.reason
    assert p.evidence["numerics"]["attribution"] == "undetermined"
    # Named on the command line, the twin decides as one found in the store does.
    b, q = paired(world, "exact@default-no-port", twin_id=world.runs["exact@highest"])
    assert b.verdict == "pass" and q.outcome == "pass"
    assert q.evidence["numerics"]["twin"]["source"] == "--twin"
    # A run at reduced precision, or of another pair, is no twin: one line, exit 2.
    with pytest.raises(RefrunInputError, match="it ran at reduced precision too"):
        paired(world, "exact@default-no-port", twin_id=world.runs["bf16@default"])
    with pytest.raises(RefrunInputError, match="it declares another pair"):
        paired(world, "exact@default-no-port", twin_id=world.refs[3])


def test_the_numerics_configuration_is_recorded_as_identity(world: Precision) -> None:
    client = MlflowClient(world.uri)
    tags = {n: client.get_run(world.runs[n]).data.tags
            for n in ("exact@default", "exact@highest", "bf16@highest")}
    assert tags["exact@default"][schema.TAG_NUMERICS_JAX_MATMUL] == "default"
    assert tags["exact@default"][schema.TAG_NUMERICS_JAX_MATMUL_SET_BY] == "unset"
    assert tags["bf16@highest"][schema.TAG_NUMERICS_JAX_MATMUL] == "highest"
    assert tags["bf16@highest"][schema.TAG_NUMERICS_JAX_MATMUL_SET_BY] == "jax.config.update"
    # The context manager wrapped the loop, not start_run: the start said "default", the
    # probe's readings inside it "highest", before any step ran with "default".
    hi = tags["exact@highest"]
    assert hi[schema.TAG_NUMERICS_JAX_MATMUL] == "highest"
    assert hi[schema.TAG_NUMERICS_JAX_MATMUL_SET_BY] == "context manager"
    changes = json.loads(hi[schema.TAG_NUMERICS_CHANGES])
    assert {(c["tag"], c["from"], c["to"], c["before_training"]) for c in changes} == {
        (schema.TAG_NUMERICS_JAX_MATMUL, "default", "highest", True)}
    assert numerics.of_run(hi).matmul == numerics.BF16_6X  # on the (emulated) TPU
    assert numerics.of_run(hi).changes == ()  # no step ran with the earlier value
    assert numerics.of_run(tags["exact@default"]).matmul == numerics.BF16
    assert tags["exact@default"][schema.TAG_NUMERICS_JAX_X64] == "false"


def test_accept_prints_the_numerics_that_differ_and_the_twin(
        world: Precision, capsys: pytest.CaptureFixture[str]) -> None:
    refs = [world.refs[s] for s in range(4)]
    rc = main(["accept", "--criteria", str(world.path), "--reference", *refs,
               "--candidate", world.runs["exact@default"], "--no-record",
               "--tracking-uri", world.uri])
    out = capsys.readouterr().out
    assert rc == 0, out
    twin = world.runs["exact@highest"]
    assert "loss-paired: ran at reduced precision: float32 matmuls and convolutions as " \
           "1-pass bfloat16 where its pair's ran as float32" in out
    assert f"loss-paired: precision twin {twin} (store; jax_default_matmul_precision=" \
           "highest on tpu, set by context manager: float32 matmuls as 6-pass bfloat16 " \
           "(~float32)): never left the band; attribution: platform precision" in out
    assert "numerics differ from the references' (refrun.numerics.*):" in out
    assert "  float32 matmuls and convolutions: candidate 1-pass bfloat16 (jax_default_" \
           "matmul_precision=default on tpu); references: float32 (torch float32_matmul_" \
           "precision=highest on cpu)" in out
    # A JAX setting of the references' processes says nothing about their arithmetic.
    assert schema.TAG_NUMERICS_JAX_MATMUL not in out.split("numerics differ")[1]


def test_the_report_shows_the_numerics_and_the_twin(world: Precision) -> None:
    a, _ = assess_run(world, "exact@default")
    cmp = compare([world.refs[s] for s in range(4)], world.runs["exact@default"],
                  tracking_uri=world.uri, progress=False)
    html = build_report(cmp, assessment=a, plotlyjs="cdn").html
    table = html.split('id="numerics"')[1].split("</table>")[0]
    assert "1-pass bfloat16 (jax_default_matmul_precision=default on tpu)" in table
    assert schema.TAG_NUMERICS_JAX_MATMUL in table
    row = next(r for r in table.split("<tr>") if "float32 matmuls" in r)
    assert 'class="warn"' in row  # differs from the references'
    pairs = html.split('id="paired"')[1].split("</table>")[0]
    assert world.runs["exact@highest"] in pairs and "platform precision" in pairs


def test_calibrate_leaves_reduced_precision_evidence_out(
        world: Precision, tmp_path: Path) -> None:
    """Known-good evidence at the TPU's default precision would widen the band to
    bfloat16's, accepting the bfloat16 port: calibrate says so and leaves it out."""
    record_jax(world, "known-good@default", False, "default", "unset",
               pair_tags(SEED, port="mlp-jax", known_good="the JAX port at the TPU's "
                         "default precision"))
    try:
        c = calibrate_ids([world.refs[s] for s in range(5)], world.uri,
                          CalibrationOptions(group_size=4))
        (p,) = [d.table for d in c.criteria if d.table["kind"] == "paired"
                and d.table["metric"] == "loss"]
        assert p["band_values"] == world.band["band_values"]  # the float32 evidence only
        note = " ".join(c.notes)
        assert f"{world.runs['known-good@default']}: ran at reduced precision (float32 " \
               "matmuls and convolutions as 1-pass bfloat16 where its pair's ran as " \
               "float32" in note
        write_file(c, str(tmp_path / "c.toml"))  # said in the file's header, too
        header = " ".join(line.lstrip("#").strip() for line in
                          (tmp_path / "c.toml").read_text().splitlines())
        assert "a band from it would accept that precision, a bfloat16 defect with it" \
            in header
    finally:  # other tests calibrate from the same store
        MlflowClient(world.uri).delete_run(world.runs.pop("known-good@default"))


def test_sign_off_covers_the_twin(world: Precision, capsys: pytest.CaptureFixture[str]
                                  ) -> None:
    refs = [world.refs[s] for s in range(4)]
    rc = main(["accept", "--criteria", str(world.path), "--reference", *refs,
               "--candidate", world.runs["exact@default-no-port"], "--twin",
               world.runs["exact@highest"], "--tracking-uri", world.uri])
    out = capsys.readouterr().out
    assert rc == 0, out
    comparison = out.split("recorded on comparison run ")[1].split()[0]
    sign_off(comparison, "accept", "Ada", tracking_uri=world.uri)  # re-assessed alike
    # The twin's evidence changing after the sign-off is named by verify.
    twin = world.runs["exact@highest"]
    host = MlflowClient(world.uri).get_run(twin).data.tags[schema.TAG_HOST]
    MlflowClient(world.uri).set_tag(twin, schema.TAG_HOST, "elsewhere")
    try:
        changes = verify(comparison, world.uri).changes
        assert any(twin in c["key"] and "(twin)" in c["key"] for c in changes), changes
        # ... and one that is no longer a twin (now at reduced precision) stops it.
        MlflowClient(world.uri).set_tag(twin, schema.TAG_NUMERICS_JAX_MATMUL, "default")
        changes = verify(comparison, world.uri).changes
        assert any("it ran at reduced precision too" in c["change"] for c in changes), \
            changes
    finally:
        MlflowClient(world.uri).set_tag(twin, schema.TAG_HOST, host)
        MlflowClient(world.uri).set_tag(twin, schema.TAG_NUMERICS_JAX_MATMUL, "highest")


def test_torch_at_medium_precision_on_this_cpu(world: Precision) -> None:
    """Real reduced precision, nothing emulated: where this CPU has bfloat16 matmul
    kernels, ``medium`` is the platform's reduced precision and the twin decides; where
    it has none, ``medium`` is float32 and the port passes on its own."""
    limit = world.band["max_ratio"]
    a, p = paired(world, "torch@medium")
    assert p.outcome == "pass" and a.verdict == "pass", p.reason
    tags = MlflowClient(world.uri).get_run(world.runs["torch@medium"]).data.tags
    assert tags[schema.TAG_NUMERICS_TORCH_MATMUL] == "medium"
    if world.torch_bf16:
        assert tags[schema.TAG_NUMERICS_TORCH_DEVICE] == "cpu, bf16 matmul kernels"
        assert ratio(world, "torch@medium") > 10 * limit  # alone: the bfloat16 port's place
        assert p.evidence["numerics"]["attribution"] == "platform precision"
        assert "torch float32_matmul_precision=medium on a cpu with bfloat16 matmul " \
               "kernels" in p.reason
        assert world.runs["torch@highest"] in p.reason
    else:
        assert tags[schema.TAG_NUMERICS_TORCH_DEVICE] == "cpu"
        assert ratio(world, "torch@medium") < limit
        assert "reduced precision" not in p.reason
    for name in ("torch-bf16@medium", "torch-bf16@highest"):
        b, q = paired(world, name)
        assert q.outcome == "fail" and b.verdict == "fail", (name, q.reason)
        assert ratio(world, name) > 10 * limit
    _, q = paired(world, "torch-bf16@medium")
    if world.torch_bf16:
        assert q.reason.endswith("a port defect, not the platform's precision")
        assert world.runs["torch-bf16@highest"] in q.reason

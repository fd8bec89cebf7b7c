"""Known-good evidence by hardware (issue 51): a correct port on another hardware kind is
judged against known-good evidence recorded on that hardware, never against the references'
hardware alone, and that evidence widens no other hardware's band.

The curves are synthetic (a pair's divergence is set exactly: ``g(t) = 1e-7 exp(t / 25)``
for the known-good rerun on the references' CPU, 50 g for the same known-good port on a
TPU), recorded through the real recording stack into a real sqlite store, calibrated with
``refrun calibrate``'s code and assessed; the expected bands are the running max |diff|
computed here with numpy."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import refrun
from refrun import schema
from refrun.acceptance.assess import assess_ids
from refrun.acceptance.calibration import CalibrationOptions, calibrate_ids, write_file
from refrun.acceptance.criteria import load_criteria, parse_criteria
from refrun.acceptance.paired import STRUCTURAL_MAX_RATIO, derive_band
from refrun.comparison import RunData
from refrun.errors import RefrunInputError
from refrun.pairing import pair_tags
from tests.conftest import migrated_sqlite

STEPS = 200
T = np.arange(STEPS)
G = 1e-7 * np.exp(T / 25)  # the CPU known-good pair's |diff|, increasing: its running max
TPU_FACTOR = 50.0  # the TPU known-good port's divergence, in units of G


def reference(seed: int) -> np.ndarray:
    """Seed ``seed``'s training loss: a decay plus the seed's own noise (seeds differ by
    ~0.05 at every step, far more than any pair below)."""
    return np.exp(-T / 40) + 0.05 * np.random.default_rng(seed).standard_normal(STEPS)


@dataclass
class World:
    uri: str = ""
    tmp: Path = Path()
    refs: dict[int, str] = field(default_factory=dict)
    runs: dict[str, str] = field(default_factory=dict)
    path: Path = Path()


def _record(w: World, name: str, role: str, seed: int, hardware: str, backend: str,
            losses: np.ndarray, tags: dict[str, str] | None = None) -> str:
    with refrun.start_run("paired-hw", role, backend=backend, hardware=hardware, seed=seed,
                          planned_steps=STEPS, tracking_uri=w.uri, spool_dir=w.tmp / "spool",
                          tags=tags or {}, snapshot_environment=False,
                          delivery="thread") as run:
        for s, v in enumerate(losses):
            run.log(s, loss=float(v))
            if backend == "jax":  # what the JAX probe records, judged for JAX candidates
                run.log(s, **{schema.M_HOST_SYNCS: 0.0})
        run.log_eval(STEPS - 1, val_loss=float(losses[-1]))
    assert run.run_id is not None
    w.runs[name] = run.run_id
    return run.run_id


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    tmp = tmp_path_factory.mktemp("paired-hw")
    w = World(uri=migrated_sqlite(tmp / "mlflow.db", tmp_path_factory), tmp=tmp)
    for s in range(5):
        w.refs[s] = _record(w, f"seed{s}", "reference", s, "cpu", "torch", reference(s))
    # Known-good evidence of seed 1: a rerun on the references' CPU, and the same known-good
    # JAX port on the TPU at full precision (its divergence 50 x the CPU rerun's).
    _record(w, "kg_cpu", "candidate", 1, "cpu", "torch", reference(1) + G,
            pair_tags(1, known_good="reference code, summation order changed"))
    _record(w, "kg_tpu", "candidate", 1, "tpu-v5e", "jax",
            reference(1) - TPU_FACTOR * G,
            pair_tags(1, known_good="the JAX port at highest precision on the TPU"))
    # Ports of seed 0: 500 g is outside the CPU band (90.5 g) and inside the TPU band
    # (90.5 x 50 g); 1e5 g (a bfloat16-like start, capped) is outside both.
    port = reference(0) + 500 * G
    _record(w, "tpu_port", "candidate", 0, "tpu-v5e", "jax", port, pair_tags(0))
    _record(w, "cpu_port", "candidate", 0, "cpu", "jax", port, pair_tags(0))
    _record(w, "tpu_bf16", "candidate", 0, "tpu-v5e", "jax",
            reference(0) + np.minimum(1e5 * G, 0.3), pair_tags(0))
    # Another TPU kind with no evidence of its own: the references' band.
    _record(w, "v4_port", "candidate", 0, "tpu-v4", "jax", port, pair_tags(0))
    w.path = tmp / "criteria.toml"
    write_file(calibrate_ids([w.refs[s] for s in range(5)], w.uri,
                             CalibrationOptions(group_size=4)), str(w.path))
    return w


def _held(steps: list[int], values: list[float]) -> np.ndarray:
    return np.array(values)[np.searchsorted(steps, T, side="right") - 1]


def test_calibrate_writes_a_band_per_hardware_from_that_hardwares_evidence(
        world: World) -> None:
    doc = tomllib.loads(world.path.read_text())
    (p,) = [c for c in doc["criteria"] if c["id"] == "loss-paired"]
    # The references' band rests on the CPU evidence alone: the TPU port's larger
    # divergence does not widen it, and max_ratio is not raised by comparing one
    # hardware's evidence with another's.
    cpu_env = np.maximum.accumulate(G)
    held = _held(p["band_steps"], p["band_values"])
    assert np.all(held <= cpu_env * 1.001) and np.all(held >= cpu_env / 1.1 / 1.001)
    assert p["max_ratio"] == pytest.approx(STRUCTURAL_MAX_RATIO, rel=1e-5)
    # The TPU's band: the envelope of both (here the TPU's, 50 g), structural ratio.
    assert set(p["hardware_bands"]) == {"tpu-v5e"}
    tpu = p["hardware_bands"]["tpu-v5e"]
    env = np.maximum(cpu_env, np.maximum.accumulate(TPU_FACTOR * G))
    held = _held(tpu["band_steps"], tpu["band_values"])
    assert np.all(held <= env * 1.001) and np.all(held >= env / 1.1 / 1.001)
    assert tpu["max_ratio"] == pytest.approx(STRUCTURAL_MAX_RATIO, rel=1e-5)
    assert world.runs["kg_tpu"] in p["description"] and "on tpu-v5e" in p["description"]


def _paired(world: World, name: str):
    a, _ = assess_ids(load_criteria(world.path), [world.refs[s] for s in range(4)],
                      world.runs[name], world.uri)
    return a.result("loss-paired")


def test_a_port_is_judged_by_its_own_hardwares_known_good_evidence(world: World) -> None:
    r = _paired(world, "tpu_port")
    assert r.outcome == "pass", r.reason
    assert r.evidence["band_hardware"] == "tpu-v5e"
    assert "known-good envelope on tpu-v5e" in r.reason
    # The same divergence on the references' CPU fails: TPU evidence widens no other band.
    r = _paired(world, "cpu_port")
    assert r.outcome == "fail", r.reason
    assert "band_hardware" not in r.evidence
    assert "no known-good run on" not in r.reason  # the pair's own hardware: no hint
    band = STRUCTURAL_MAX_RATIO * _held(*_band(world, None))
    first = int(np.argmax(band < 500 * G))
    assert r.evidence[schema.EV_FIRST_DIVERGENCE_STEP] == first
    # A TPU kind without evidence of its own is judged by the references' band.
    r = _paired(world, "v4_port")
    assert r.outcome == "fail" and "band_hardware" not in r.evidence, r.reason
    # ... and its reason says what would tell a port defect from that hardware's numerics.
    assert r.reason.endswith(
        "; the band is known-good evidence from cpu only: no known-good run on tpu-v4 was "
        "calibrated, and a correct port can diverge more there; record one (a known-good "
        "port on tpu-v4, another seed, at full precision) and calibrate again to tell a "
        "port defect from the hardware's numerics"), r.reason


def _band(world: World, hw: str | None) -> tuple[list[int], list[float]]:
    c = load_criteria(world.path).criterion("loss-paired")
    if hw is None:
        return c.band_steps, c.band_values
    b = c.hardware_bands[hw]
    return b.band_steps, b.band_values


def test_a_defect_on_that_hardware_still_fails_its_band(world: World) -> None:
    r = _paired(world, "tpu_bf16")
    assert r.outcome == "fail" and r.evidence["band_hardware"] == "tpu-v5e", r.reason
    env = _held(*_band(world, "tpu-v5e"))
    div = np.maximum.accumulate(np.minimum(1e5 * G, 0.3))
    first = int(np.argmax(div > STRUCTURAL_MAX_RATIO * env))
    assert r.evidence[schema.EV_FIRST_DIVERGENCE_STEP] == first
    assert r.evidence["max_ratio_observed"] == pytest.approx(float(np.max(div / env)),
                                                             rel=1e-3)


def _mem(run_id: str, values: np.ndarray, tags: dict[str, str]) -> RunData:
    return RunData.from_curves(pd.DataFrame({"metric": "loss", "step": T, "value": values}),
                               run_id, tags)


def test_two_pairs_on_one_hardware_are_judged_against_each_other_only() -> None:
    refs = [_mem(f"r{s}", reference(s), {schema.TAG_SEED: str(s),
                                          schema.TAG_HARDWARE: "cpu"}) for s in range(3)]
    kg = [_mem("c0", reference(0) + G, {**pair_tags(0, known_good="rerun"),
                                        schema.TAG_HARDWARE: "cpu"}),
          _mem("t1", reference(1) + 50 * G, {**pair_tags(1, known_good="port"),
                                             schema.TAG_HARDWARE: "tpu-v5e"}),
          # Another TPU pair 200 x the first: the TPU evidence itself disagrees by that much.
          _mem("t2", reference(2) + 1e4 * G, {**pair_tags(2, known_good="port"),
                                              schema.TAG_HARDWARE: "tpu-v5e"})]
    band, _ = derive_band(kg, refs, "loss")
    assert band is not None and band.needs == [] and band.max_ratio == STRUCTURAL_MAX_RATIO
    tpu = band.hardware["tpu-v5e"]
    # Leave-one-out within the TPU's two pairs only: 200 x and 1/200 x (knots round down
    # by at most 10 %); the CPU pair is no third vote against them.
    assert len(tpu.needs) == 2
    assert 200 * (1 - 1e-9) <= max(tpu.needs) <= 220 * (1 + 1e-9)
    assert tpu.max_ratio >= max(tpu.needs)
    assert [p[0] for p in tpu.pairs] == ["c0", "t1", "t2"]
    # Evidence only on another hardware than the references': one band, as before.
    only, _ = derive_band(kg[1:2], refs, "loss")
    assert only is not None and only.hardware == {}
    np.testing.assert_allclose(_held(only.band_steps, only.band_values) / (50 * G), 1,
                               rtol=0.1)


BASE = ('[[criteria]]\nid = "p"\nkind = "paired"\nlevel = "L1"\nmax_ratio = 90.5\n'
        'band_steps = [0, 5]\nband_values = [1e-7, 1e-6]\n')


def _with_band(table: str, key: str = "tpu-v5e") -> object:
    """``BASE`` with one hardware band whose keys are ``table``, parsed."""
    return parse_criteria(f"{BASE}[criteria.hardware_bands.{key}]\n{table}", "c.toml")


def test_hardware_bands_validation_names_the_key() -> None:
    ok = _with_band("band_steps = [0]\nband_values = [1e-5]\nmax_ratio = 90.5\n", "TPU_v5e")
    assert list(ok.criterion("p").hardware_bands) == ["tpu-v5e"]  # the canonical name
    cases = [
        ("band_steps = [0]\nband_values = [1e-5]\n",
         r"c\.toml:\d+: criteria\[0\]\.hardware_bands\.tpu-v5e\.max_ratio \(id 'p'\): "
         "required"),
        ("band_steps = [3, 3]\nband_values = [1e-5, 1e-4]\nmax_ratio = 90.5\n",
         r"hardware_bands\.tpu-v5e\.band_steps \(id 'p'\): must be strictly increasing"),
        ("band_steps = [0]\nband_values = [1e-5]\nmax_ratio = 0.5\n",
         r"hardware_bands\.tpu-v5e\.max_ratio \(id 'p'\): must be > 1"),
        ("band_step = [0]\nband_values = [1e-5]\nmax_ratio = 90.5\n",
         r"hardware_bands\.tpu-v5e\.band_step \(id 'p'\): unknown key"),
    ]
    for table, message in cases:
        with pytest.raises(RefrunInputError, match=message):
            _with_band(table)
    with pytest.raises(RefrunInputError, match=r"hardware_bands\.tpu v5e!.*not a hardware "
                                               "name"):
        _with_band("band_steps = [0]\nband_values = [1e-5]\nmax_ratio = 90.5\n",
                   '"tpu v5e!"')

"""Same-seed paired comparison on a tiny real torch model (CPU): 5 reference seeds, a
known-good rerun of seed 0 with a declared perturbation (input features permuted, so every
first-layer dot product sums in another order), a benign port of seed 4 (first-layer
products accumulated in float64), and a port of seed 2 computing its matmuls in bfloat16.

The seed-band criteria `refrun calibrate` writes accept the bfloat16 port (its effect is
far below the seeds' spread); the `paired` criterion it writes from the known-good rerun
rejects it and accepts the benign port.  Expected numbers are recomputed here with numpy
from the logged losses, independently of refrun.acceptance.paired."""

from __future__ import annotations

import contextlib
import json
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

import refrun
from refrun import schema
from refrun.acceptance.assess import assess_ids
from refrun.acceptance.calibration import CalibrationOptions, calibrate_ids, write_file
from refrun.acceptance.criteria import load_criteria, parse_criteria
from refrun.acceptance.paired import STRUCTURAL_MAX_RATIO, derive_band
from refrun.acceptance.signoff import sign_off, verify
from refrun.cli import main
from refrun.comparison import RunData, compare
from refrun.errors import RefrunInputError
from refrun.pairing import pair_tags
from refrun.report import build_report
from tests.conftest import Store, migrated_sqlite

STEPS, D, H, K, B = 200, 16, 64, 4, 32
W_TRUE = torch.randn(D, K, generator=torch.Generator().manual_seed(99))


EVAL_X = torch.randn(1024, D, generator=torch.Generator().manual_seed(98))
EVAL_Y = (EVAL_X @ W_TRUE + torch.randn(1024, K, generator=torch.Generator().manual_seed(97))
          ).argmax(1)


@dataclass
class Mlp:
    """Seed ``seed``'s 2-layer tanh MLP, its optimizer and its batches: fresh noisy batches
    in the seed's own data order, labels 1 std of noise from a linear teacher (so the loss
    stays noisy and seeds differ at every step), and the seed's input permutation."""

    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor
    opt: torch.optim.Optimizer
    xs: torch.Tensor
    ys: torch.Tensor
    perm: torch.Tensor


def mlp(seed: int) -> Mlp:
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(H, D, generator=g) / D ** 0.5).requires_grad_()
    b1 = torch.zeros(H, requires_grad=True)
    w2 = (torch.randn(K, H, generator=g) / H ** 0.5).requires_grad_()
    b2 = torch.zeros(K, requires_grad=True)
    opt = torch.optim.SGD([w1, b1, w2, b2], lr=0.2, momentum=0.9)
    order = torch.Generator().manual_seed(seed + 100)
    xs = torch.randn(STEPS, B, D, generator=order)
    ys = (xs @ W_TRUE + torch.randn(STEPS, B, K, generator=order)).argmax(2)
    perm = torch.from_numpy(np.random.default_rng(seed + 7).permutation(D))
    return Mlp(w1, b1, w2, b2, opt, xs, ys, perm)


def train(seed: int, mode: str = "fp32") -> np.ndarray:
    """Per-step training losses, then the final evaluation loss, of :func:`mlp` (seed).
    ``mode``: ``fp32`` the reference, ``perm`` input features permuted (the same sums
    in another order), ``f64`` first layer accumulated in float64, ``bf16`` every matmul
    in bfloat16."""
    m = mlp(seed)
    w1, b1, w2, b2, opt, xs, ys, perm = m.w1, m.b1, m.w2, m.b2, m.opt, m.xs, m.ys, m.perm

    def layer1(x: torch.Tensor) -> torch.Tensor:
        if mode == "perm":
            return x[:, perm] @ w1[:, perm].T + b1
        if mode == "f64":
            return (x.double() @ w1.double().T).float() + b1
        if mode == "bf16":
            return (x.bfloat16() @ w1.bfloat16().T).float() + b1
        return x @ w1.T + b1

    def layer2(h: torch.Tensor) -> torch.Tensor:
        if mode == "bf16":
            return (h.bfloat16() @ w2.bfloat16().T).float() + b2
        return h @ w2.T + b2

    losses = np.empty(STEPS)
    for s in range(STEPS):
        x, y = xs[s], ys[s]
        loss = torch.nn.functional.cross_entropy(layer2(torch.tanh(layer1(x))), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses[s] = loss.item()
    with torch.no_grad():  # the final evaluation, appended after the training losses
        ev = torch.nn.functional.cross_entropy(layer2(torch.tanh(layer1(EVAL_X))), EVAL_Y)
    return np.r_[losses, ev.item()]


@dataclass
class World:
    uri: str = ""
    tmp: Path = Path()
    refs: dict[int, str] = field(default_factory=dict)  # seed -> run id
    runs: dict[str, str] = field(default_factory=dict)  # name -> run id
    losses: dict[str, np.ndarray] = field(default_factory=dict)
    path: Path = Path()


def _record(w: World, name: str, role: str, seed: int, losses: np.ndarray,
            tags: dict[str, str] | None = None) -> str:
    with refrun.start_run("paired-mlp", role, backend="torch", hardware="cpu", seed=seed,
                          planned_steps=STEPS, tracking_uri=w.uri, spool_dir=w.tmp / "spool",
                          tags=tags or {}, snapshot_environment=False,
                          delivery="thread") as run:
        for s, v in enumerate(losses[:-1]):
            run.log(s, loss=float(v))
        run.log_eval(len(losses) - 2, val_loss=float(losses[-1]))
    assert run.run_id is not None
    w.losses[name] = losses
    return run.run_id


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """torch on one thread (its matmuls' summation order fixed) for the block."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def record_pairs(w: Any, record: Callable[..., str], train: Callable[..., Any]) -> None:
    """Record, with ``record(w, name, role, seed, curves, tags)``, the five reference seeds,
    the known-good evidence (the reference code of seed 0, summation order changed) and the
    benign port of seed 4 (first layer in float64), ``train(seed, mode)`` giving curves."""
    for s in range(5):
        w.refs[s] = record(w, f"seed{s}", "reference", s, train(s))
    w.runs["known_good"] = record(
        w, "known_good", "candidate", 0, train(0, "perm"),
        pair_tags(0, known_good="reference code, input features permuted: the same "
                                "first-layer sums in another order"))
    w.runs["benign"] = record(w, "benign", "candidate", 4, train(4, "f64"), pair_tags(4))


def make_world(w: Any, record: Callable[..., str], train: Callable[..., Any],
               extra: Callable[[Any], None]) -> Any:
    """``w`` (a :class:`World` with ``uri`` and ``tmp`` set) filled: :func:`record_pairs`,
    then the runs ``extra(w)`` records, all on one thread, then the criteria `refrun
    calibrate` writes from the five reference seeds (groups of 4) in ``w.path``."""
    with single_thread():
        record_pairs(w, record, train)
        extra(w)
    w.path = w.tmp / "criteria.toml"
    write_file(calibrate_ids([w.refs[s] for s in range(5)], w.uri,
                             CalibrationOptions(group_size=4)), str(w.path))
    return w


def assess_run(w: Any, name: str, **kw: Any):
    """Assess run ``name`` with ``w``'s criteria against reference seeds 0-3 (seed 4, the
    benign port's, is not among them: its pair is found in the store)."""
    refs = [w.refs[s] for s in range(4)]
    return assess_ids(load_criteria(w.path), refs, w.runs[name], w.uri, **kw)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    tmp = tmp_path_factory.mktemp("paired")

    def extra(w: World) -> None:
        w.runs["bf16"] = _record(w, "bf16", "candidate", 2, train(2, "bf16"), pair_tags(2))
        # Curves of runs above: what matters here is what they declare.
        w.runs["unpaired"] = _record(w, "unpaired", "candidate", 7, w.losses["seed3"])
        w.runs["lost_pair"] = _record(w, "lost_pair", "candidate", 42, w.losses["benign"],
                                      pair_tags(42))

    return make_world(World(uri=migrated_sqlite(tmp / "mlflow.db", tmp_path_factory),
                            tmp=tmp), _record, train, extra)



def _running_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Running max of |a - b| over the training losses (the last entry is the eval)."""
    return np.maximum.accumulate(np.abs(a[:-1] - b[:-1]))


def test_calibrate_writes_the_band_from_the_known_good_rerun(world: World) -> None:
    doc = tomllib.loads(world.path.read_text())
    (p,) = [c for c in doc["criteria"] if c["kind"] == "paired"]
    assert p["metric"] == "loss" and p["level"] == "L1"
    # One known-good pair: the structural factor, and the band is its running max |diff|.
    assert p["max_ratio"] == pytest.approx(STRUCTURAL_MAX_RATIO, rel=1e-5)
    e = _running_div(world.losses["known_good"], world.losses["seed0"])
    floor = e[e > 0].min()
    expect = np.maximum(e, floor)
    steps = np.array(p["band_steps"])
    vals = np.array(p["band_values"])
    # Every knot is the envelope's value at its step (4 significant digits) ...
    np.testing.assert_allclose(vals, expect[steps], rtol=1e-3)
    # ... and between knots the step function stays within the 10 % thinning of it.
    held = vals[np.searchsorted(steps, np.arange(STEPS), side="right") - 1]
    assert np.all(held <= expect * 1.001) and np.all(held >= expect / 1.1 / 1.001)
    assert world.runs["known_good"] in p["description"]
    assert doc["calibration"]["runs"] == sorted(world.refs[s] for s in range(5))  # not the pair


def test_seed_bands_accept_the_bf16_port_and_the_paired_criterion_rejects_it(
        world: World) -> None:
    a, _ = assess_run(world, "bf16")
    by_kind: dict[str, list] = {}
    for r in a.results:
        by_kind.setdefault(r.kind, []).append(r)
    # Every seed-band criterion calibrate wrote accepts the bfloat16 port ...
    bands = [r for r in a.results if r.kind in ("envelope", "closeness", "equivalence")]
    assert {r.metric for r in bands} >= {"loss", "eval/val_loss"}
    assert bands and all(r.outcome == "pass" for r in bands), \
        [(r.id, r.reason) for r in bands if r.outcome != "pass"]
    # ... the paired one does not, and says where the pair first diverged.
    (p,) = by_kind["paired"]
    assert p.outcome == "fail" and a.verdict == "fail"
    assert p.evidence["pair_run"] == world.refs[2]
    assert p.evidence["pair"]["source"] == "references"
    crit = load_criteria(world.path).criterion(p.id)
    div = _running_div(world.losses["bf16"], world.losses["seed2"])
    env = np.array(crit.band_values)[np.searchsorted(crit.band_steps, np.arange(STEPS),
                                                     side="right") - 1]
    first = int(np.argmax(div > crit.max_ratio * env))
    assert p.evidence[schema.EV_FIRST_DIVERGENCE_STEP] == first
    assert f"first diverges at step {first}" in p.reason
    assert p.evidence["divergence_at_first"] == pytest.approx(div[first])
    # Orders of magnitude beyond the known-good pair, not a borderline call.
    assert p.evidence["max_ratio_observed"] > 10 * crit.max_ratio
    # The report's acceptance section shows the pair and where it first diverged.
    cmp = compare([world.refs[s] for s in range(4)], world.runs["bf16"],
                  tracking_uri=world.uri, progress=False)
    html = build_report(cmp, assessment=a, plotlyjs="cdn").html
    table = html.split('id="paired"')[1].split("</table>")[0]
    assert f"step {first}" in table and world.refs[2] in table and "(references)" in table


def test_the_benign_port_passes_with_its_pair_from_the_store(world: World) -> None:
    a, evidence = assess_run(world, "benign")
    p = a.result("loss-paired")
    assert p.outcome == "pass", p.reason
    assert a.verdict == "pass", a.table()
    # Seed 4 is not among the references: found in the store by its seed.
    assert p.evidence["pair_run"] == world.refs[4]
    assert p.evidence["pair"]["source"] == "store"
    div = _running_div(world.losses["benign"], world.losses["seed4"])
    assert p.evidence["divergence_at_last"] == pytest.approx(div[-1])
    assert p.evidence[schema.EV_FIRST_DIVERGENCE_STEP] is None
    # The pair's run is part of the evidence (verify covers it).
    assert evidence["runs"][world.refs[4]]["role"] == "pair"


def test_no_pair_is_said_plainly_and_a_lost_pair_is_not_a_pass(world: World) -> None:
    a, _ = assess_run(world, "unpaired")
    p = a.result("loss-paired")
    assert p.outcome == "not_applicable"
    assert p.reason.startswith("no same-seed pair: candidate") and "\n" not in p.reason
    assert any("loss-paired" in x and "no same-seed pair" in x for x in a.warnings)
    b, _ = assess_run(world, "lost_pair")
    q = b.result("loss-paired")
    assert q.outcome == "not_evaluable" and b.verdict == "incomplete"
    assert "seed 42" in q.reason and "no finished reference run" in q.reason


def test_pair_on_the_command_line_and_verify_covers_the_pair(
        world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The unpaired run declared nothing; --pair names seed 4's run (a wrong pair, so the
    # paired criterion fails: seeds diverge by the whole training noise).
    out = tmp_path / "a.json"
    rc = main(["accept", "--criteria", str(world.path), "--reference",
               *[world.refs[s] for s in range(4)], "--candidate", world.runs["benign"],
               "--pair", world.refs[4], "--json", str(out), "--tracking-uri", world.uri])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert f"loss-paired: pair {world.refs[4]} (--pair); never left the band" in text
    doc = json.loads(out.read_text())
    assert doc["pair"]["source"] == "--pair" and doc["pair"]["run_id"] == world.refs[4]
    comparison = text.split("recorded on comparison run ")[1].split()[0]
    # sign_off re-assesses (the pair looked up again by the recorded --pair) and refuses
    # when the evidence differs from the recorded one.
    sign_off(comparison, "accept", "Ada", tracking_uri=world.uri)
    # Changing the pair's data after the assessment is named by verify.
    from mlflow.tracking import MlflowClient

    MlflowClient(world.uri).log_metric(world.refs[4], "loss", 9.0, step=STEPS - 1)
    changes = verify(comparison, world.uri).changes
    assert any(world.refs[4] in c["key"] and "(pair)" in c["key"] for c in changes), changes


def test_pair_option_contradicting_the_declared_seed_is_one_line_exit_2(
        world: World, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["accept", "--criteria", str(world.path), "--reference",
               *[world.refs[s] for s in range(4)], "--candidate", world.runs["bf16"],
               "--pair", world.refs[3], "--no-record", "--tracking-uri", world.uri])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"--pair {world.refs[3]}: seed 3, but candidate" in err


def test_calibrate_without_known_good_evidence_says_why(store: Store) -> None:
    w = World(uri=store.tracking_uri, tmp=store.tmp)
    rng = np.random.default_rng(0)
    ids = [_record(w, f"s{s}", "reference", s, 1.0 + rng.normal(0, 0.1, 40))
           for s in range(3)]  # 39 training losses, then an evaluation
    c = calibrate_ids(ids, w.uri, CalibrationOptions())
    assert not [d for d in c.criteria if d.table["kind"] == "paired"]
    said = [n for n in c.notes if "paired" in n]  # (the other notes: other kinds)
    assert len(said) == 1 and said[0].startswith("no paired criterion: the store holds no "
                                                 "known-good")
    assert "#   no paired criterion: the store holds no known-good" in c.text()
    # A rerun that declares a pair is never taken as a seed.
    with pytest.raises(RefrunInputError, match="declare a same-seed pair"):
        calibrate_ids([*ids, _record(w, "r", "reference", 0, 1.0 + rng.normal(0, 0.1, 40),
                                     pair_tags(0))], w.uri)


def test_paired_criterion_validation_names_the_key() -> None:
    base = ('[[criteria]]\nid = "p"\nkind = "paired"\nlevel = "L1"\nmax_ratio = 90.5\n')
    with pytest.raises(RefrunInputError, match=r":6: criteria\[0\]\.band_steps \(id 'p'\): "
                                               "must be strictly increasing"):
        parse_criteria(base + "band_steps = [0, 5, 5]\nband_values = [1e-7, 1e-6, 1e-5]\n",
                       "c.toml")
    with pytest.raises(RefrunInputError, match=r"band_values\[1\] \(id 'p'\): must be > 0"):
        parse_criteria(base + "band_steps = [0, 5]\nband_values = [1e-7, 0.0]\n", "c.toml")
    with pytest.raises(RefrunInputError, match="has 1 values for 2 band_steps"):
        parse_criteria(base + "band_steps = [0, 5]\nband_values = [1e-7]\n", "c.toml")


def _mem(run_id: str, values: np.ndarray, tags: dict[str, str]) -> RunData:
    t = np.arange(len(values))
    return RunData.from_curves(pd.DataFrame({"metric": "loss", "step": t, "value": values}),
                               run_id, tags)


def test_disagreeing_known_good_pairs_raise_max_ratio_to_their_worst_need() -> None:
    t = np.arange(120)
    base = np.exp(-t / 40)
    refs = [_mem(f"r{s}", base + 0.1 * s, {schema.TAG_SEED: str(s)}) for s in range(3)]
    growth = 1e-7 * np.exp(t / 20)
    kg = [_mem("kg0", base + growth, pair_tags(0, known_good="rerun, order reversed")),
          # 200 x the first pair's divergence at every step: a worse "known-good" pair.
          _mem("kg1", base + 0.1 + 200 * growth, pair_tags(1, known_good="port B")),
          _mem("kg2", base + 0.2, pair_tags(2, known_good="changed nothing"))]
    band, note = derive_band(kg, refs, "loss")
    assert band is not None
    assert "kg2: identical to r2 at every step" in note
    # kg1 needs 200 x kg0's envelope (up to 10 % more where the band's knots round down);
    # kg0 needs 1/200 of kg1's.
    assert 200 * (1 - 1e-9) <= max(band.needs) <= 220 * (1 + 1e-9)
    assert min(band.needs) <= 1 / 200 * 1.1
    assert band.max_ratio >= max(band.needs) > STRUCTURAL_MAX_RATIO
    # The envelope is the larger pair's running max |diff|, held between knots.
    env = 200 * growth  # increasing: its own running max
    held = np.array(band.band_values)[np.searchsorted(band.band_steps, t, side="right") - 1]
    assert np.all(held <= env * (1 + 1e-9)) and np.all(held >= env / 1.1 * (1 - 1e-9))
    # No evidence at all: said, and nothing written.
    assert derive_band([], refs, "loss")[0] is None

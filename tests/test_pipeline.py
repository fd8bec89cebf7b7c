"""The digits pipeline end to end (reduced: --quick steps): every silent defect is caught by
the criterion it was built to trip, and every benign candidate fails no criterion.

Real subprocess training with torch, JAX (4 CPU devices) and PyTorch/XLA (PJRT CPU), a
real sqlite MLflow store in tmp_path, the real acceptance engine and report writer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from builds import TrainedStore

from pipelines.digits.config import load_config
from pipelines.digits.data import batch_indices, load
from pipelines.digits.model import init_params
from pipelines.digits.variants import plan


def test_split_and_batches_are_fixed_and_shared() -> None:
    """The split depends only on split_seed; batches only on the training seed."""
    cfg = load_config()
    a, b = load(cfg.split_seed, cfg.n_train, cfg.n_val), load(cfg.split_seed, cfg.n_train,
                                                              cfg.n_val)
    assert np.array_equal(a.train.x, b.train.x) and len(a.test.y) == 1797 - 500 - 400
    assert a.train.x.max() <= 1.0 and a.train.x.dtype == np.float32
    b0 = batch_indices(0, 20, cfg.batch, cfg.n_train)
    assert np.array_equal(b0, batch_indices(0, 20, cfg.batch, cfg.n_train))
    assert not np.array_equal(b0, batch_indices(1, 20, cfg.batch, cfg.n_train))
    # the first epoch's batches are a permutation: no index repeats within it
    first_epoch = b0.reshape(-1)[: cfg.n_train]
    assert len(np.unique(first_epoch)) == cfg.n_train


def test_digits_are_read_as_scikit_learn_ships_them() -> None:
    """The bundled file read without importing scikit-learn gives load_digits' arrays."""
    from sklearn.datasets import load_digits

    from pipelines.digits.data import raw_digits

    x, y = raw_digits()
    ds = load_digits()
    assert np.array_equal(x, ds.data) and np.array_equal(y, ds.target)


def test_initial_weights_are_torch_default_init_by_name() -> None:
    """Names and layouts follow torch.nn.Linear; bounds are ±1/sqrt(fan_in)."""
    import torch

    from pipelines.digits.train_torch import MLP

    cfg = load_config()
    p = init_params(cfg.sizes, 0)
    model = MLP(cfg.sizes)
    assert set(p) == set(model.state_dict())
    for k, v in model.state_dict().items():
        assert tuple(v.shape) == p[k].shape
    fan_in = cfg.sizes[0]
    assert np.abs(p["fc1.weight"]).max() <= 1 / np.sqrt(fan_in)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in p.items()})
    assert torch.equal(model.fc1.weight, torch.from_numpy(p["fc1.weight"]))


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1200)  # its setup may train the cached digits runs (tests/builds.py)
def test_reduced_pipeline_catches_every_defect_and_passes_benign(
        tmp_path, monkeypatch: pytest.MonkeyPatch, digits_quick: TrainedStore) -> None:
    from mlflow.tracking import MlflowClient

    from pipelines.demo import CRITERIA_QUICK, assess_all, table

    monkeypatch.chdir(tmp_path)  # nothing may land in the repository's working tree
    # The plan's runs come trained from the session's cached store (tests/builds.py: the
    # same train_all, --quick; the seven of mlruns.example as its generator records them);
    # the subject here is detection, so the candidates are assessed into a copy of it.
    p = plan()
    uri = digits_quick.copy_to(tmp_path)
    ids = {v.name: digits_quick.ids[v.name] for v in p.all}
    outcomes = assess_all(p, ids, uri=uri, reports=tmp_path / "reports",
                          criteria=CRITERIA_QUICK)
    by_name = {o.variant.name: o for o in outcomes}
    assert len(outcomes) == len(p.candidates)
    for o in outcomes:
        failed = {cid for cid, _ in o.failing}
        if o.variant.kind == "defect":
            missing = set(o.variant.expect) - failed
            assert not missing, f"{o.variant.name}: {missing} did not fail ({o.failing})"
        else:
            assert not failed, f"benign {o.variant.name} failed {o.failing}"
            # nothing left unevaluated either: a benign candidate passes up to L3
            assert (o.verdict, o.highest_level) == ("pass", "L3"), \
                f"benign {o.variant.name}: {o.verdict} {o.highest_level} {o.not_evaluable}"
        assert o.report is not None and o.report.stat().st_size > 10_000
    # the evidence names the mechanism, not just a level
    storm = dict(by_name["xla-shape-storm"].failing)["compilations-after-warmup"]
    assert "compilation(s) after warm-up" in storm
    # the scoped criteria are not_applicable (not missing evidence) off their backends:
    # exactly those whose scope leaves JAX out
    from refrun.acceptance.criteria import load_criteria

    criteria = load_criteria(CRITERIA_QUICK).criteria
    off_jax = {c.id for c in criteria if c.backends is not None and "jax" not in c.backends}
    assert "no-cpu-fallback" in off_jax and "opt-lr-envelope" in off_jax
    # and the restore criterion, on every candidate: none of them resumed
    restore = {c.id for c in criteria if c.kind == "restore"}
    assert restore == {"resume-reproduces"}
    assert set(by_name["jax-1dev"].not_applicable) == off_jax | restore
    text = table(outcomes)
    assert all(o.variant.name in text for o in outcomes) and " NO " not in text

    # every artifact is next to the store, none in the working tree of the repository
    # (init_store put them next to the store it trained into; the copy keeps that layout)
    built = MlflowClient(digits_quick.uri).get_experiment_by_name("digits-mlp")
    assert built.artifact_location.startswith((digits_quick.path / "mlruns").as_uri())
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("digits-mlp")
    assert exp.artifact_location.startswith((tmp_path / "mlruns").as_uri())
    # the on-disk report loads the shared plotly.js; the logged copy embeds it, so it
    # opens standalone from the MLflow UI's artifact view
    o = by_name["jax-sum-loss"]
    on_disk = o.report.read_text(encoding="utf-8")
    assert 'src="plotly.min.js"' in on_disk and (o.report.parent / "plotly.min.js").is_file()
    cmp_run = client.search_runs([exp.experiment_id],
                                 f"tags.`refrun.compared.candidate` = '{o.run_id}'")[0]
    logged = Path(client.download_artifacts(cmp_run.info.run_id, "refrun/report.html",
                                            str(tmp_path)))
    html = logged.read_text(encoding="utf-8")
    assert 'src="plotly.min.js"' not in html and 'src="https://cdn.plot.ly' not in html
    assert len(html) > len(on_disk) + 3_000_000  # plotly.js itself (~4.8 MB) is inside

"""The charlm workload: its three ports do the same math, its defects change what they
should, and a benign port stays within the reference seeds' spread.

Expected values come from an independent NumPy implementation of the model (written here
from the architecture in ``pipelines/charlm/model.py``'s docstring), from
``torch.optim.Adam`` itself, and from the reference seeds' own curves; never from the code
under test.  Real torch, JAX and PyTorch/XLA (PJRT's CPU device); real training runs
recorded into a sqlite MLflow store in tmp_path.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipelines.charlm.config import load_config
from pipelines.charlm.data import VOCAB, batch_starts, dropout_mask, encode, load, windows
from pipelines.charlm.model import init_params, param_shapes

REPO = Path(__file__).resolve().parents[1]
CFG = load_config()


# --- an independent NumPy model ------------------------------------------------------------
def _ln(h: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    mu = h.mean(-1, keepdims=True)
    var = h.var(-1, keepdims=True)
    return (h - mu) / np.sqrt(var + 1e-5) * w + b


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def numpy_loss(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, keep: np.ndarray
               ) -> float:
    """Mean next-character cross-entropy of the pre-LN GPT, float64, loops over heads."""
    p = {k: v.astype(np.float64) for k, v in p.items()}
    t = x.shape[1]
    d, nh = CFG.d_model, CFG.n_head
    dh = d // nh
    h = (p["tok_emb.weight"][x] + p["pos_emb.weight"][:t]) * keep
    future = np.triu(np.ones((t, t), dtype=bool), 1)
    for i in range(CFG.n_layer):
        pre = f"blocks.{i}."
        a = _ln(h, p[pre + "ln1.weight"], p[pre + "ln1.bias"])
        qkv = a @ p[pre + "attn.qkv.weight"].T + p[pre + "attn.qkv.bias"]
        heads = []
        for j in range(nh):
            q = qkv[..., j * dh:(j + 1) * dh]
            k = qkv[..., d + j * dh:d + (j + 1) * dh]
            v = qkv[..., 2 * d + j * dh:2 * d + (j + 1) * dh]
            s = q @ k.transpose(0, 2, 1) / np.sqrt(dh)
            s[:, future] = -np.inf
            s = np.exp(s - s.max(-1, keepdims=True))
            heads.append((s / s.sum(-1, keepdims=True)) @ v)
        h = h + np.concatenate(heads, -1) @ p[pre + "attn.proj.weight"].T \
            + p[pre + "attn.proj.bias"]
        m = _ln(h, p[pre + "ln2.weight"], p[pre + "ln2.bias"])
        m = _gelu_tanh(m @ p[pre + "mlp.fc.weight"].T + p[pre + "mlp.fc.bias"])
        h = h + m @ p[pre + "mlp.proj.weight"].T + p[pre + "mlp.proj.bias"]
    logits = _ln(h, p["ln_f.weight"], p["ln_f.bias"]) @ p["head.weight"].T + p["head.bias"]
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(logits, y[..., None], -1)[..., 0]
    return float((lse - picked).mean())


def _first_batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    corpus = load(CFG.files, CFG.val_fraction, CFG.test_fraction)
    starts = batch_starts(seed, 1, CFG.batch, len(corpus.train), CFG.context)[0]
    x, y = windows(corpus.train, starts, CFG.context)
    return x, y, dropout_mask(seed, 0, (*x.shape, CFG.d_model), CFG.dropout)


def _weights(seed: int, scale: float) -> dict[str, np.ndarray]:
    """Initial weights, every matrix scaled by ``scale`` so that attention is far from
    uniform (at GPT-2's initial 0.02 every model's loss is ~log(97))."""
    w = init_params(VOCAB, CFG.context, CFG.d_model, CFG.n_layer, CFG.mlp_ratio, seed)
    return {k: (v * scale if v.ndim == 2 else v).astype(np.float32) for k, v in w.items()}


# --- the three ports do the same math ------------------------------------------------------
@pytest.mark.parametrize("scale", [1.0, 25.0])
def test_three_ports_start_from_the_same_weights_and_agree_with_numpy(scale: float) -> None:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import jax
    import jax.numpy as jnp
    import torch
    import torch_xla

    from pipelines.charlm.train_jax import forward as jax_forward
    from pipelines.charlm.train_jax import lm_loss as jax_loss
    from pipelines.charlm.train_torch import build_model, lm_loss

    x, y, keep = _first_batch()
    w = _weights(0, scale)
    expected = numpy_loss(w, x, y, keep)
    if scale == 1.0:  # GPT-2 init: the first loss is that of a uniform guess, log(97)
        assert expected == pytest.approx(math.log(VOCAB), abs=0.02)

    model = build_model(CFG, 0)
    # the names and layouts are the NumPy dictionary's: loading it by name is exact
    assert set(model.state_dict()) == set(w) == set(param_shapes(
        VOCAB, CFG.context, CFG.d_model, CFG.n_layer, CFG.mlp_ratio))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()})
    xt, yt, kt = torch.from_numpy(x).long(), torch.from_numpy(y).long(), torch.from_numpy(keep)
    with torch.no_grad():
        torch_value = float(lm_loss(model(xt, kt), yt))
        dev = torch_xla.device()
        xla_model = model.to(dev)
        xla_value = float(lm_loss(xla_model(xt.to(dev), kt.to(dev)), yt.to(dev)).cpu())
    jax_value = float(jax.jit(lambda p, a, b, c: jax_loss(jax_forward(p, a, c, CFG), b))(
        {k: jnp.asarray(v) for k, v in w.items()}, x, y, keep))

    for name, got in (("torch", torch_value), ("jax", jax_value), ("torch_xla", xla_value)):
        assert got == pytest.approx(expected, rel=2e-5, abs=2e-5), (name, got, expected)


def test_adam_update_is_torch_optim_adam() -> None:
    """The written-out Adam (shared by the torch and XLA ports) against torch.optim.Adam."""
    import torch

    from pipelines.charlm.train_torch import adam_update, schedule

    gen = torch.Generator().manual_seed(0)
    a = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    b = [t.clone().requires_grad_(True) for t in a]
    a = [t.clone().requires_grad_(True) for t in a]
    m = [torch.zeros_like(t) for t in a]
    v = [torch.zeros_like(t) for t in a]
    ref = torch.optim.Adam(b, lr=1.0, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps)
    for step in range(4):
        grads = [torch.randn(t.shape, generator=gen) for t in a]
        lr, bc1, bc2 = torch.from_numpy(schedule(CFG, step, warmup=True))
        for group in ref.param_groups:
            group["lr"] = float(lr)
        for p, q, g in zip(a, b, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        adam_update(a, m, v, lr, bc1, bc2, CFG)
        ref.step()
        for p, q in zip(a, b, strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7)


def test_schedule_warms_up_then_decays_to_the_floor() -> None:
    lrs = [CFG.learning_rate(s) for s in range(CFG.steps)]
    assert lrs[0] == pytest.approx(CFG.lr / CFG.warmup_steps)
    assert lrs[CFG.warmup_steps - 1] == pytest.approx(CFG.lr)
    assert lrs[-1] == pytest.approx(CFG.lr * CFG.min_lr_fraction)
    assert CFG.learning_rate(0, warmup=False) == pytest.approx(CFG.lr)  # the defect


def test_corpus_is_python_stdlib_text_with_a_fixed_vocabulary() -> None:
    import sysconfig

    corpus = load(CFG.files, CFG.val_fraction, CFG.test_fraction)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "abc.py").read_text(encoding="utf-8")
    ids = encode(text[:200])
    # the first split starts with abc.py (files sorted by name); ids index the alphabet
    assert np.array_equal(corpus.train[:200], ids)
    assert "".join(chr(32 + i - 1) if i else "\n" for i in ids[:40]) == text[:40]
    assert len(corpus.val) == len(corpus.test) > 1000
    assert corpus.train.max() < VOCAB


# --- a defect changes what it should -------------------------------------------------------
@pytest.mark.parametrize("port", ["torch", "jax"])
def test_causal_leak_lets_a_position_see_the_character_it_predicts(port: str) -> None:
    """Changing the input at position 11 must not move the logits at any earlier position,
    unless the mask leaks; with the leak it moves the last ``n_layer`` positions before it
    (one per layer) and no earlier one (checked on both model implementations)."""
    x, _, keep = _first_batch()
    w = _weights(1, 10.0)
    x2 = x.copy()
    x2[:, 11] = (x2[:, 11] + 7) % VOCAB

    def logits(leak: bool, inp: np.ndarray) -> np.ndarray:
        if port == "torch":
            import torch

            from pipelines.charlm.train_torch import build_model

            model = build_model(CFG, 0, frozenset({"causal_leak"} if leak else ()))
            model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()})
            with torch.no_grad():
                return model(torch.from_numpy(inp).long(), torch.from_numpy(keep)).numpy()
        import jax.numpy as jnp

        from pipelines.charlm.train_jax import forward

        p = {k: jnp.asarray(v) for k, v in w.items()}
        return np.asarray(forward(p, jnp.asarray(inp), jnp.asarray(keep), CFG, leak=leak))

    for leak in (False, True):
        a, b = logits(leak, x), logits(leak, x2)
        moved = np.abs(a - b).max(axis=(0, 2))[:11]  # per position before the change
        if leak:  # each layer lets information flow one position back: n_layer positions
            assert np.all(moved[11 - CFG.n_layer:] > 1e-3), moved
            assert np.all(moved[:11 - CFG.n_layer] == 0.0), moved
        else:
            assert np.all(moved == 0.0), moved


# --- real recorded runs --------------------------------------------------------------------
# The [quick] run (150 steps): the leak needs ~100 steps to show (until the model has
# learnt to read the next position, both curves are the same).
STEPS = load_config(quick=True).steps


def _store(tmp: Path) -> str:
    return f"sqlite:///{tmp}/mlflow.db"


def _args(tmp: Path, *args: str) -> list[str]:
    return ["--steps", str(STEPS), "--eval-every", "25", "--quiet", "--tracking-uri",
            _store(tmp), "--spool-dir", str(tmp / "spool"), *args]


def _run_id(stdout: str) -> str:
    return re.findall(r"\] run ([0-9a-f]{32}) ", stdout)[-1]


def _train_here(tmp: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """One recorded PyTorch training run in this process (no interpreter start-up)."""
    from pipelines.charlm import train_torch

    assert train_torch.main(_args(tmp, *args)) == 0
    return _run_id(capsys.readouterr().out)


def _train(module: str, tmp: Path, *args: str, devices: int = 1) -> str:
    """One recorded training process (JAX's device count and PJRT's device are set before
    the framework loads); returns its run id."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src")]),
               REFRUN_DELIVERY="thread", JAX_PLATFORMS="cpu", PJRT_DEVICE="CPU",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    out = subprocess.run([sys.executable, "-m", module, *_args(tmp, *args)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return _run_id(out.stdout)


def _series(run_id: str, tmp: Path, metric: str) -> dict[int, float]:
    """Step -> value (the last one written for a step: a resumed run writes some twice)."""
    from mlflow.tracking import MlflowClient

    hist = MlflowClient(_store(tmp)).get_metric_history(run_id, metric)
    out: dict[int, float] = {}
    for m in sorted(hist, key=lambda m: (m.step, m.timestamp)):
        out[m.step] = m.value
    return out


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_defects_show_and_benign_ports_stay_in_the_seeds_spread(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pipelines.demo import init_store

    monkeypatch.setenv("REFRUN_DELIVERY", "thread")
    init_store(_store(tmp_path), "charlm")
    port = _train("pipelines.charlm.train_jax", tmp_path, "--seed", "3", "--devices", "4",
                  devices=4)
    refs = [_train_here(tmp_path, capsys, "--seed", str(s), "--role", "reference")
            for s in (0, 1, 2)]
    resumed = _train_here(tmp_path, capsys, "--seed", "0", "--resume", "60,75")
    leak = _train_here(tmp_path, capsys, "--seed", "3", "--defect", "causal_leak")

    ref = np.array([[s[k] for k in range(STEPS)]
                    for s in (_series(r, tmp_path, "loss") for r in refs)])
    last = slice(STEPS - 10, STEPS)
    lo, hi = ref[:, last].mean(1).min(), ref[:, last].mean(1).max()
    spread = hi - lo

    # a benign port (JAX, 4 devices, unseen seed): its final-window loss and its last
    # validation loss are inside the seeds' range widened by that range on each side
    cand = np.array([_series(port, tmp_path, "loss")[k] for k in range(STEPS)])
    assert lo - spread <= cand[last].mean() <= hi + spread, (cand[last].mean(), lo, hi)
    vals = [_series(r, tmp_path, "eval/val_loss")[STEPS - 1] for r in refs]
    v_lo, v_hi = min(vals), max(vals)
    got = _series(port, tmp_path, "eval/val_loss")[STEPS - 1]
    assert v_lo - (v_hi - v_lo) <= got <= v_hi + (v_hi - v_lo), (got, vals)

    # the resumed run replays exactly what seed 0 did (keep the last value of a step)
    rs = _series(resumed, tmp_path, "loss")
    assert sorted(rs) == list(range(STEPS))
    np.testing.assert_allclose([rs[k] for k in range(STEPS)], ref[0], rtol=1e-6)
    from mlflow.tracking import MlflowClient

    hist = MlflowClient(_store(tmp_path)).get_metric_history(resumed, "loss")
    assert len(hist) == STEPS + 15  # steps 61..75 logged twice

    # the leak lowers the training loss below every seed by more than the seeds' spread
    lk = np.array([_series(leak, tmp_path, "loss")[k] for k in range(STEPS)])
    assert lk[last].mean() < lo - max(spread, 0.02), (lk[last].mean(), lo, hi)
    assert lk[0] == pytest.approx(ref[:, 0].mean(), abs=0.05)  # same start: log(97)


@pytest.mark.timeout(600)
def test_host_sync_defect_shows_in_the_xla_counters(tmp_path: Path) -> None:
    """A .item() in the step: at least one host synchronisation per step in the probe's
    counters, on every step."""
    from pipelines.demo import init_store

    init_store(_store(tmp_path), "charlm")
    run = _train("pipelines.charlm.train_xla", tmp_path, "--seed", "0", "--steps", "12",
                 "--defect", "host_sync")
    syncs = _series(run, tmp_path, "xfer/host_syncs")
    assert sorted(syncs) == list(range(12))
    assert all(syncs[k] >= 1 for k in range(2, 12)), syncs
    assert json.dumps(syncs)  # finite numbers throughout

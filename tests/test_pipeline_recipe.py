"""The recipe knobs the pipelines share (pipelines/recipe.py): the learning-rate scaling
rule with the global batch, checked against an independent computation (exact rationals
for the linear rule, decimal square roots for Adam's), the ``--lr`` option of every
pipeline's command line, and the benchmark's 2x-batch candidates built from them."""

from __future__ import annotations

import importlib
from decimal import Decimal, getcontext
from fractions import Fraction

import pytest

from pipelines.recipe import batch_scaled, lr_option, scaled_lr

WORKLOADS = ("digits", "charlm", "markov")


@pytest.mark.parametrize(("lr", "batch", "new"), [("0.1", 64, 128), ("0.1", 64, 32),
                                                  ("0.05", 48, 512), ("0.003", 16, 40)])
def test_linear_rule_for_sgd_is_lr_times_the_batch_ratio(lr: str, batch: int,
                                                         new: int) -> None:
    expected = float(Fraction(lr) * Fraction(new, batch))  # exact, rounded once
    assert scaled_lr(float(lr), batch, new, "sgd") == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("opt", ["adam", "AdamW"])
@pytest.mark.parametrize(("lr", "batch", "new"), [("0.003", 16, 32), ("0.01", 32, 64),
                                                  ("0.001", 64, 16), ("0.0002", 10, 90)])
def test_square_root_rule_for_adam(opt: str, lr: str, batch: int, new: int) -> None:
    getcontext().prec = 40
    expected = float(Decimal(lr) * (Decimal(new) / Decimal(batch)).sqrt())
    assert scaled_lr(float(lr), batch, new, opt) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize(("lr", "batch", "new", "opt"),
                         [(0.0, 64, 128, "sgd"), (-0.1, 64, 128, "sgd"),
                          (float("nan"), 64, 128, "adam"), (0.1, 0, 128, "sgd"),
                          (0.1, 64, 0, "adam"), (0.1, 64, 128, "lamb")])
def test_scaled_lr_refuses_what_it_has_no_rule_for(lr: float, batch: int, new: int,
                                                   opt: str) -> None:
    with pytest.raises(ValueError):
        scaled_lr(lr, batch, new, opt)


def test_batch_scaled_keeps_the_samples_budget() -> None:
    r = batch_scaled(batch=16, lr=0.003, optimizer="adam", quick_steps=150, full_steps=301,
                     warmup_steps=31)
    assert r.args[:2] == ("--batch", "32") and r.args[4:] == ("--warmup-steps", "16")
    assert float(r.args[3]) == scaled_lr(0.003, 16, 32, "adam")
    assert r.quick_args == ("--steps", "75") and r.full_args == ("--steps", "151")


@pytest.mark.parametrize("text", ["0", "-0.1", "abc", "nan", "inf", ""])
def test_lr_option_refuses_a_non_positive_or_non_number(text: str) -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="--lr"):
        lr_option(text)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_pipeline_takes_lr_and_records_it_as_the_config_value(workload: str) -> None:
    cli = importlib.import_module(f"pipelines.{workload}.cli")
    default = cli.parse([], "torch", "x").config.lr
    args = cli.parse(["--lr", "0.0123", "--batch", "64"], "torch", "x")
    assert args.config.lr == 0.0123 != default and args.config.batch == 64
    for backend in ("jax", "torch_xla"):
        assert cli.parse(["--lr", "0.5"], backend, "x").config.lr == 0.5


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("bad", ["0", "-1", "fast"])
def test_a_bad_lr_is_a_one_line_usage_error(workload: str, bad: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    cli = importlib.import_module(f"pipelines.{workload}.cli")
    with pytest.raises(SystemExit) as exc:
        cli.parse(["--lr", bad], "torch", "x")
    assert exc.value.code == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and f"--lr {bad!r}" in errors[0], errors


def test_the_2x_batch_candidates_scale_the_recipe_and_the_same_lr_ones_are_recipe_changes(
        ) -> None:
    from pipelines.charlm import variants as charlm
    from pipelines.digits import variants as digits
    from pipelines.markov import variants as markov

    cands = {v.name: v for v in [*digits.DETECTION_BENIGN, *digits.DETECTION_DEFECTS,
                                 *charlm.plan(0).candidates, *markov.plan(0).candidates]}
    # (name, reference batch, reference lr, optimiser, quick steps)
    for name, batch, lr, opt, steps in (("torch-batch2x", 64, 0.1, "sgd", 400),
                                        ("charlm-torch-batch2x", 16, 0.003, "adam", 150),
                                        ("markov-torch-batch2x", 32, 0.01, "adam", 200)):
        v = cands[name]
        argv = v.command(quick=True, tracking_uri="sqlite:///x", spool_dir=None)
        assert v.kind == "benign"
        assert argv[argv.index("--batch") + 1] == str(2 * batch)
        assert float(argv[argv.index("--lr") + 1]) == scaled_lr(lr, batch, 2 * batch, opt)
        assert argv[argv.index("--steps") + 1] == str(steps // 2)
        same = cands[f"{name}-same-lr"]
        assert same.kind == "recipe" and same.seed == v.seed and same.expect
        assert "--lr" not in same.extra_args and "--batch" in same.extra_args
    charlm_argv = cands["charlm-torch-batch2x"].command(quick=False, tracking_uri="u",
                                                        spool_dir=None)
    assert charlm_argv[charlm_argv.index("--warmup-steps") + 1] == "15"
    assert charlm_argv[charlm_argv.index("--steps") + 1] == "150"

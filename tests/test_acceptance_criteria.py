"""Criteria files: the example loads, the shipped JSON Schema matches the typed model, and
bad files give one line naming file, line and key path (exit code 2 from the CLI)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import jsonschema
import pytest

from refrun.acceptance import load_criteria
from refrun.acceptance.criteria import CRITERION_KINDS, Closeness, Compilation
from refrun.acceptance.json_schema import criteria_schema, schema_text, shipped_schema_path
from refrun.cli import main
from refrun.errors import RefrunInputError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "pipelines" / "criteria" / "example.toml"

GOOD = """\
version = 1
workload = "w"

[settings]
keep = "last"

[[criteria]]
id = "loss"
level = "L1"
kind = "closeness"
metric = "loss"
abs_tol = 0.1
"""


def test_example_loads_and_validates_against_shipped_schema() -> None:
    crit = load_criteria(EXAMPLE)
    assert {c.KIND for c in crit.criteria} >= {"closeness", "hardware", "claim", "cost"}
    assert all(c.level in ("L1", "L2", "L3", "L4") for c in crit.criteria)
    shipped = json.loads(shipped_schema_path().read_text(encoding="utf-8"))
    jsonschema.validate(tomllib.loads(EXAMPLE.read_text(encoding="utf-8")), shipped)


def test_shipped_schema_is_in_sync_with_the_model() -> None:
    # Regenerate with: python -m refrun.acceptance.json_schema
    assert shipped_schema_path().read_text(encoding="utf-8") == schema_text()
    defs = criteria_schema()["$defs"]
    assert set(defs) >= {f"criterion.{k}" for k in CRITERION_KINDS}
    close = defs["criterion.closeness"]["properties"]
    assert close["abs_tol"]["minimum"] == 0 and close["over"]["enum"] == [
        "all", "final_window", "last", "eval_points"]


def test_good_file_is_typed(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text(GOOD)
    crit = load_criteria(p)
    c = crit.criteria[0]
    assert isinstance(c, Closeness) and c.abs_tol == 0.1 and c.rel_tol == 0.0
    assert c.min_fraction == 1.0 and c.over == "all"
    assert len(crit.sha256) == 64


BAD = [
    # (replace, with, expected line, expected text)
    ('abs_tol = 0.1', 'abs_tol = 0.1\nabs_tol = 0.2', 13, "TOML syntax error"),
    ('abs_tol = 0.1', 'abs_tol = -0.1', 12, "criteria[0].abs_tol (id 'loss'): must be >= 0"),
    ('abs_tol = 0.1', 'abs_tol = "tight"', 12,
     "criteria[0].abs_tol (id 'loss'): expected a number"),
    ('abs_tol = 0.1', 'abs_tol = 0.1\ntolerance = 3', 13,
     "criteria[0].tolerance (id 'loss'): unknown key"),
    ('keep = "last"', 'keep = "newest"', 5, "settings.keep: 'newest' is not one of: last, first"),
    ('keep = "last"', 'kep = "last"', 5, "settings.kep: unknown key"),
    ('level = "L1"', 'level = "L7"', 9, "criteria[0].level (id 'loss'): 'L7' is not one of"),
    ('abs_tol = 0.1', '', None, "criteria[0] (id 'loss'): needs at least one of: abs_tol, rel_tol"),
    ('metric = "loss"\n', '', None, "criteria[0].metric (id 'loss'): required key missing"),
    ('kind = "closeness"', 'kind = "vibes"', 10,
     "criteria[0].kind (id 'loss'): 'vibes' is not one of"),
    ('version = 1', 'version = 2', 1, "version: must be <= 1"),
    # [calibration] backend is an identity name like every other backend key.
    ('abs_tol = 0.1\n', 'abs_tol = 0.1\n\n[calibration]\nbackend = "torch,pytorch-xla-ish"\n',
     15, "calibration.backend: 'pytorch-xla-ish' is not a known backend"),
    # [calibration.power] holds sentences: a number there is a typo, never a silent default.
    ('abs_tol = 0.1\n', 'abs_tol = 0.1\n\n[calibration.power]\nloss = 0.5\n',
     15, "calibration.power.loss: expected a string, got a number 0.5"),
    ('metric = "loss"', 'metric = "loss"\nover = "eval_points"', 12,
     "criteria[0].over (id 'loss'): 'eval_points' needs an evaluation metric"),
]


@pytest.mark.parametrize(("old", "new", "line", "text"), BAD)
def test_bad_file_names_file_line_and_key(tmp_path: Path, old: str, new: str,
                                          line: int | None, text: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "bad.toml"
    assert old in GOOD
    p.write_text(GOOD.replace(old, new, 1))
    with pytest.raises(RefrunInputError) as exc:
        load_criteria(p)
    msg = str(exc.value)
    where = f"{p}:{line}:" if line else f"{p}:"
    assert msg.startswith(where), msg
    assert text in msg, msg
    assert "\n" not in msg
    # The CLI prints that one line and exits 2 before touching any store.
    rc = main(["accept", "--criteria", str(p), "--reference", "r", "--candidate", "c",
               "--tracking-uri", f"sqlite:///{tmp_path}/none.db"])
    assert rc == 2
    err = capsys.readouterr().err
    assert text in err and err.count("\n") == 1
    assert not (tmp_path / "none.db").exists()


def test_calibration_backend_is_normalised_and_checked_by_calibrate(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "c.toml"
    p.write_text(GOOD + '\n[calibration]\nbackend = "PyTorch, torch-xla"\n')
    assert load_criteria(p).calibration.backend == "torch,torch_xla"
    p.write_text(GOOD + '\n[calibration]\nbackend = "tpu magic"\n')
    rc = main(["calibrate", "--check", str(p), "--reference", "a", "b", "c",
               "--tracking-uri", f"sqlite:///{tmp_path}/none.db"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert f"{p}:15: calibration.backend: 'tpu magic' is not a known backend" in err
    assert not (tmp_path / "none.db").exists()


def test_cli_error_on_a_brand_new_store_is_the_only_stderr_line(tmp_path: Path) -> None:
    """The real ``refrun`` console script on a new (empty, 0-byte) sqlite file: stderr is
    one error line.  (Issue 22: a reader no longer lets MLflow turn the empty file into a
    new store, with its INFO lines; it refuses the file and leaves it as it was.)"""
    import os
    import shutil
    import subprocess
    import sys

    p = tmp_path / "c.toml"
    p.write_text(GOOD)
    db = tmp_path / "new.db"
    db.touch()
    exe = shutil.which("refrun", path=str(Path(sys.executable).parent)) or "refrun"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_LOGGING_LEVEL"}
    proc = subprocess.run([exe, "accept", "--criteria", str(p), "--reference", "r-missing",
                           "--candidate", "c", "--tracking-uri", f"sqlite:///{db}"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"refrun accept: error: tracking store sqlite:///{db}: empty file (0 bytes), not an "
        "MLflow store; remove it to let a writer create a new store there"], proc.stderr
    assert db.stat().st_size == 0  # not turned into a store


def test_duplicate_ids_and_claim_needs_one_direction(tmp_path: Path) -> None:
    p = tmp_path / "d.toml"
    p.write_text(GOOD + GOOD[GOOD.index("[[criteria]]"):])
    with pytest.raises(RefrunInputError, match=r"d.toml:14: criteria\[1\].id .*duplicate id"):
        load_criteria(p)
    p.write_text('[[criteria]]\nid = "acc"\nlevel = "L3"\nkind = "claim"\n'
                 'metric = "eval/acc"\nat_least = 0.8\nat_most = 0.9\n')
    with pytest.raises(RefrunInputError, match=r"criteria\[0\] \(id 'acc'\): needs exactly one "
                       "of: at_least, at_most"):
        load_criteria(p)


def test_default_lists_are_not_shared() -> None:
    a = Compilation(id="a", kind="compilation", level="L2", max=0)
    b = Compilation(id="b", kind="compilation", level="L2", max=0)
    assert a.metrics == ["compile/graphs"] and a.metrics is not b.metrics


def test_unreadable_and_not_utf8(tmp_path: Path) -> None:
    with pytest.raises(RefrunInputError, match="cannot read criteria file"):
        load_criteria(tmp_path / "missing.toml")
    p = tmp_path / "latin.toml"
    p.write_bytes(b'workload = "caf\xe9"\n')
    with pytest.raises(RefrunInputError, match="not UTF-8"):
        load_criteria(p)

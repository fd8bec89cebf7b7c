"""scripts/build_wheelhouse.py: refrun on a machine that reaches no registry (issue 51).

The slow test does what docs/offline-install.md tells a user to do for a TPU VM, offline:
the TPU machine is played by a fresh virtual environment (no package but pip) and a
package index of its own (a PEP 503 folder served by ``file://``) that lacks what the real
one lacks (mlflow-skinny, databricks-sdk, opentelemetry-semantic-conventions; an older
certifi).  The wheels come from this environment's installed distributions (repacked by
the script itself, so the versions are requirements/dev.lock's and no registry is asked):
the wheelhouse is built, installed there with its install.sh, and a run is recorded there
and read back here.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "build_wheelhouse.py"
# What the TPU machine's index lacks (docs/offline-install.md, /work/shared/tpu-machine.md).
TPU_LACKS = ("mlflow-skinny", "databricks-sdk", "opentelemetry-semantic-conventions")
OLD_CERTIFI = "2020.4.5.1"  # older than databricks-sdk's >= 2026.10.19
TARGET = ("--platform", "manylinux_2_36_x86_64", "--python", "3.11")


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_wheelhouse", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_wheelhouse"] = module
    spec.loader.exec_module(module)
    return module


bw = load_script()


def run_script(*args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def wheel_names(folder: Path) -> dict[str, Version]:
    return {str(parse_wheel_filename(p.name)[0]): parse_wheel_filename(p.name)[1]
            for p in folder.glob("*.whl")}


# -- the pure parts: what is carried -------------------------------------------------------
def dist(name: str, version: str, *requires: str):
    return bw.Dist(canonicalize_name(name), Version(version),
                   tuple(Requirement(r) for r in requires))


def closure_of(*dists):
    return {d.name: d for d in dists}


OTEL = closure_of(
    dist("mlflow-skinny", "3.17.2", "opentelemetry-sdk<3,>=1.9", "certifi"),
    dist("opentelemetry-sdk", "1.45.2", "opentelemetry-api==1.45.2",
         "opentelemetry-semantic-conventions==0.66b2"),
    dist("opentelemetry-api", "1.45.2"),
    dist("opentelemetry-semantic-conventions", "0.66b2", "opentelemetry-api==1.45.2"),
    dist("databricks-sdk", "0.162.0", "certifi>=2026.10.19"),
    dist("certifi", "2026.10.19"),
)
ROOT_REQS = [Requirement("mlflow-skinny>=3,<4"), Requirement("databricks-sdk")]
LINUX = bw.Target("manylinux_2_28_x86_64", "3.11")


def offer(**versions: str | None):
    return bw.Offer({canonicalize_name(k): None if v is None else frozenset([Version(v)])
                     for k, v in versions.items()})


def test_carried_is_what_the_target_cannot_satisfy() -> None:
    # The target has everything but mlflow-skinny, with an older certifi than one
    # requirer needs and the exact OpenTelemetry versions resolved here.
    has = offer(**{"databricks-sdk": "0.162.0", "certifi": "2026.7.22",
                   "opentelemetry-sdk": "1.45.2", "opentelemetry-api": "1.45.2",
                   "opentelemetry-semantic-conventions": "0.66b2"})
    assert bw.carried(OTEL, ROOT_REQS, LINUX, has, {}) == {"mlflow-skinny", "certifi"}
    assert bw.carried(OTEL, ROOT_REQS, LINUX, None, {}) == set(OTEL)


def test_exact_pins_carry_their_family() -> None:
    # The target's index lacks the semantic conventions and has another OpenTelemetry
    # release: its opentelemetry-sdk pins conventions nobody carries, so the SDK resolved
    # here travels, and with it the API the SDK pins; an exact match would stay.
    has = offer(**{"mlflow-skinny": None, "databricks-sdk": None, "certifi": None,
                   "opentelemetry-sdk": "1.44.0", "opentelemetry-api": "1.44.0"})
    assert bw.carried(OTEL, ROOT_REQS, LINUX, has, {}) == {
        "opentelemetry-semantic-conventions", "opentelemetry-sdk", "opentelemetry-api"}
    exact = offer(**{"mlflow-skinny": None, "databricks-sdk": None, "certifi": None,
                     "opentelemetry-sdk": "1.45.2", "opentelemetry-api": "1.45.2"})
    assert bw.carried(OTEL, ROOT_REQS, LINUX, exact, {}) == {
        "opentelemetry-semantic-conventions"}


def test_markers_are_the_targets() -> None:
    closure = closure_of(dist("pandas", "3.1.1", 'tzdata; sys_platform == "win32"',
                              'numpy>=2.3.3; python_version >= "3.14"', "numpy>=2.0.2"),
                         dist("numpy", "2.1.0"), dist("tzdata", "2026.1"))
    specs = bw.requirement_specs(closure, [Requirement("pandas")], LINUX, {})
    assert str(specs["numpy"]) == ">=2.0.2"  # the 3.14 marker does not apply to 3.11
    assert str(specs["tzdata"]) == ""  # only Windows requires it
    assert bw.carried(closure, [Requirement("pandas")], LINUX,
                      offer(pandas="3.1.1", numpy="2.1.0"), {}) == {"tzdata"}
    assert bw.carried(closure, [Requirement("pandas")], bw.Target(
        "manylinux_2_28_x86_64", "3.14"), offer(pandas="3.1.1", numpy="2.1.0"), {}) == {
        "numpy", "tzdata"}


def test_platform_tags_expand_as_pep_600_says() -> None:
    plats = bw.Target("manylinux_2_28_x86_64", "3.11").platforms()
    assert plats[0] == "manylinux_2_28_x86_64"
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(plats)
    assert not any(p.startswith("manylinux_2_29") or "aarch64" in p for p in plats)
    assert bw.Target("manylinux2014_aarch64", "3.11").platforms()[:2] == [
        "manylinux_2_17_aarch64", "manylinux2014_aarch64"]


def test_target_has_file_forms(tmp_path: Path) -> None:
    f = tmp_path / "has.txt"
    f.write_text("# the index\nNumPy==2.4.6\nnumpy==2.3.0\npandas\n"
                 "certifi-2026.7.22-py3-none-any.whl\n")
    has = bw.Offer.read(f)
    assert has.versions["numpy"] == frozenset({Version("2.4.6"), Version("2.3.0")})
    assert has.versions["pandas"] is None
    assert has.versions["certifi"] == frozenset({Version("2026.7.22")})


@pytest.mark.parametrize(("text", "says"), [
    ("numpy>=2\n", "has.txt:1: expected 'name==version' or 'name'"),
    ("pandas\nnumpy==not.a.version!\n", "has.txt:2: 'not.a.version!' is not a version"),
])
def test_bad_target_has_is_one_line_exit_2(tmp_path: Path, text: str, says: str) -> None:
    f = tmp_path / "has.txt"
    f.write_text(text)
    out = tmp_path / "wh"
    proc = run_script(out, "--from-environment", "--target-has", f, *TARGET)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr
    assert not out.exists()


# -- the whole way, offline -----------------------------------------------------------------
def simple_index(wheels: Path, root: Path) -> str:
    """A PEP 503 index of the wheels in ``wheels`` under ``root``; its file:// URL."""
    for whl in sorted(wheels.glob("*.whl")):
        project = root / canonicalize_name(parse_wheel_filename(whl.name)[0])
        project.mkdir(parents=True, exist_ok=True)
        with (project / "index.html").open("a") as f:
            f.write(f'<a href="{whl.resolve().as_uri()}">{whl.name}</a>\n')
    return root.resolve().as_uri() + "/"


@pytest.fixture(scope="module")
def tpu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | str]:
    """The wheelhouse built for a TPU-like machine, that machine's own index, the
    ``--target-has`` file describing it, and a fresh environment with refrun installed
    there from both by install.sh."""
    tmp = tmp_path_factory.mktemp("tpu")
    target = bw.Target("manylinux_2_36_x86_64", "3.11")
    core = [r for r in (Requirement(t) for t in _declared_core()) if r.marker is None]
    closure, _ = bw.closure_from_environment(core, target)
    lacks = {canonicalize_name(n) for n in TPU_LACKS}
    has = tmp / "tpu-index.txt"
    lines = [f"{n}=={d.version}" for n, d in closure.items() if n not in lacks]
    has.write_text("\n".join(ln if not ln.startswith("certifi==") else
                             f"certifi=={OLD_CERTIFI}" for ln in lines) + "\n")
    index_wheels = tmp / "index-wheels"
    for name in closure:  # the target's own index: what it has (certifi only an old one)
        if name not in lacks and name != "certifi":
            bw.repack(name, index_wheels, target, compress=False)
    index_url = simple_index(index_wheels, tmp / "simple")
    wh = tmp / "wheelhouse"
    proc = run_script(wh, "--from-environment", "--target-has", has, *TARGET)
    assert proc.returncode == 0, proc.stderr
    fresh = tmp / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(fresh)], check=True, timeout=300)
    site = tmp / "site"
    env = {**os.environ, "PYTHON": str(fresh / "bin" / "python"), "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)
    proc_install = subprocess.run(["sh", str(wh / "install.sh"), str(site), index_url],
                                  capture_output=True, text=True, env=env, timeout=600)
    assert proc_install.returncode == 0, proc_install.stderr[-3000:]
    return {"tmp": tmp, "wheelhouse": wh, "has": has, "index_wheels": index_wheels,
            "python": fresh / "bin" / "python", "site": site, "stdout": proc.stdout}


def _declared_core() -> list[str]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def fresh_env(tpu: dict[str, Path | str], tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHONPATH", "MLFLOW_TRACKING_URI"))}
    env.update(PYTHONPATH=str(tpu["site"]), PYTHONNOUSERSITE="1",
               REFRUN_SPOOL_DIR=str(tmp / "spool"))
    return env


@pytest.mark.slow
def test_wheelhouse_carries_what_the_tpu_lacks(tpu: dict[str, Path | str]) -> None:
    wh = Path(tpu["wheelhouse"])
    carried = wheel_names(wh)
    assert set(carried) == {"refrun", *TPU_LACKS, "certifi"}, carried
    for name, version in carried.items():  # the versions the suite runs with
        if name != "refrun":
            assert version == Version(importlib.metadata.version(name))
    size = sum(p.stat().st_size for p in wh.iterdir())
    assert size < bw.MAX_MIB * 2**20
    assert f"{size / 2**20:.2f} MiB" in str(tpu["stdout"])
    # Every carried wheel holds exactly the files its installed RECORD lists (less
    # compiled files and the installer's own), so the install there is this one.
    with zipfile.ZipFile(next(wh.glob("mlflow_skinny-*.whl"))) as zf:
        names = set(zf.namelist())
    def files(name: str) -> set[str]:
        return {str(f) for f in importlib.metadata.distribution(name).files or ()
                if not str(f).startswith("..") and "__pycache__" not in str(f)
                and Path(str(f)).name not in bw.INSTALLER_FILES}

    assert files("mlflow-skinny") <= names
    assert "mlflow/store/tracking/sqlalchemy_store.py" in names
    full_only = {f for f in files("mlflow") - files("mlflow-skinny") if f.startswith("mlflow/")}
    assert full_only and not full_only & names  # none of the full mlflow's own files


RECORD = textwrap.dedent("""
    import importlib.metadata as md, importlib.util, sys
    for absent in ("flask", "gunicorn", "docker", "matplotlib", "scipy", "plotly"):
        assert importlib.util.find_spec(absent) is None, absent
    try:
        md.distribution("mlflow")
    except md.PackageNotFoundError:
        pass
    else:
        raise AssertionError("the full mlflow is installed")
    import refrun
    assert refrun.__file__.startswith(sys.argv[2]), refrun.__file__
    with refrun.start_run(workload="wheelhouse", role="candidate", hardware="tpu-v5e",
                          backend="jax", seed=0, chips=1, global_batch=8,
                          tracking_uri=sys.argv[1], params={"lr": 0.5}) as run:
        for step in range(40):
            run.log(step, loss=1.0 / (step + 1))
            if step % 10 == 9:
                run.log_eval(step, accuracy=step / 40)
    print(run.run_id)
""")


@pytest.mark.slow
def test_recording_with_only_the_core(tpu: dict[str, Path | str], tmp_path: Path) -> None:
    """A run recorded where only the core is installed (no full mlflow, no scipy) lands
    FINISHED with every point, and is read back here like any other."""
    from refrun import schema
    from refrun.comparison import load_run

    uri = f"sqlite:///{tmp_path}/tpu.db"
    env = fresh_env(tpu, tmp_path)
    proc = subprocess.run([str(tpu["python"]), "-c", RECORD, uri, str(tpu["site"])],
                          capture_output=True, text=True, env=env, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = proc.stdout.split()[-1]
    data = load_run(run_id, tracking_uri=uri)
    assert data.status == "FINISHED" and data.source == "artifact"
    steps, values, _ = data.series("loss")
    assert steps.tolist() == list(range(40))
    assert values.tolist() == [1.0 / (s + 1) for s in range(40)]
    steps, values, _ = data.series("eval/accuracy")
    assert (steps.tolist(), values.tolist()) == ([9, 19, 29, 39], [s / 40 for s in (9, 19, 29, 39)])
    assert data.params["lr"] == "0.5" and data.hardware == "tpu-v5e"
    # The core's commands answer there; a command that needs an extra says which.
    cli = [str(tpu["python"]), "-m", "refrun"]
    runs = subprocess.run([*cli, "runs", "--workload", "wheelhouse", "--tracking-uri", uri],
                          capture_output=True, text=True, env=env, timeout=300)
    assert runs.returncode == 0 and run_id in runs.stdout, runs.stderr
    accept = subprocess.run([*cli, "calibrate", "--workload", "wheelhouse",
                             "--tracking-uri", uri, "-o", str(tmp_path / "c.toml")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert accept.returncode == 2, accept.stderr
    assert accept.stderr.count("\n") == 1, accept.stderr
    assert "scipy" in accept.stderr and "refrun[analysis]" in accept.stderr
    assert not (tmp_path / "c.toml").exists()
    # Merging the store into another works there too (the core's writer).
    team = f"sqlite:///{tmp_path}/team.db"
    merged = subprocess.run([*cli, "merge", uri, "--into", team], capture_output=True,
                            text=True, env=env, timeout=300)
    assert merged.returncode == 0, merged.stderr
    assert merged.stdout.splitlines()[-1] == "1 merged, 0 already there, 0 left out"
    copy_id = merged.stdout.split(" -> ")[1].split()[0]
    copy = load_run(copy_id, tracking_uri=team)
    assert copy.tags[schema.TAG_ORIGIN_RUN_ID] == run_id
    assert copy.curves.equals(data.curves)


@pytest.mark.slow
def test_pip_resolution_gives_the_same_wheelhouse(tpu: dict[str, Path | str],
                                                  tmp_path: Path) -> None:
    """The registry path (pip resolving for the target and downloading what is carried),
    run on local folders instead of the registry: the same wheels as the repacked ones."""
    out = tmp_path / "wh"
    proc = run_script(out, "--no-index", "--find-links", tpu["index_wheels"],
                      "--find-links", tpu["wheelhouse"], "--target-has", tpu["has"], *TARGET)
    assert proc.returncode == 0, proc.stderr
    assert wheel_names(out) == wheel_names(Path(tpu["wheelhouse"]))


def test_too_large_is_refused_whole(tmp_path: Path) -> None:
    out = tmp_path / "wh"
    proc = run_script(out, "--from-environment", "--max-mib", "1", *TARGET)
    assert proc.returncode == 2
    assert "over --max-mib 1" in proc.stderr and proc.stderr.count("\n") == 1
    assert not out.exists()


def test_wheels_that_do_not_install_there_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "wh"
    proc = run_script(out, "--from-environment", "--platform", "manylinux_2_28_aarch64")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "does not install on manylinux_2_28_aarch64" in proc.stderr
    assert not out.exists()

"""Built products that several tests read: made once, kept until the code that makes them
changes.

A *build* is a directory a builder function fills (a store of trained runs, say).  It is
kept under ``<cache root>/<name>-<key>/`` where the key is a SHA-256 over

* the bytes of every source file that decides its content (given as paths, or directories
  whose ``*.py``/``*.toml`` files are read), named relative to the repository;
* a JSON-able ``config`` (command lines, seeds, step counts: what the builder is asked);
* the lock file of the environment (requirements/dev.lock) and the Python version.

So a change to any of them gives another key, and the next test that asks builds anew;
otherwise every test of every worker (pytest-xdist) and of every later session reads the
same directory.  Workers agree through ``fcntl.flock`` on ``<name>.lock``: the first to
ask builds while the others wait, then they all see the finished directory (``BUILD.json``
is written into it only when the builder returned, so a failed or killed build leaves
nothing that looks finished).  Older keys of the same name are removed when a new one is
built.

The cache root is ``$REFRUN_TEST_CACHE`` if set, else ``.test-cache/`` in the repository
(git-ignored; a fresh clone -- CI -- starts empty and builds once per session).

Tests read a build; a test that writes (assesses into a store, say) works on a copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK_FILE = ROOT / "requirements" / "dev.lock"
SOURCE_SUFFIXES = (".py", ".toml")
DONE = "BUILD.json"  # written last inside a build: what it was built from


def cache_root() -> Path:
    env = os.environ.get("REFRUN_TEST_CACHE")
    return Path(env) if env else ROOT / ".test-cache"


def source_files(paths: Iterable[Path]) -> list[Path]:
    """Every file of ``paths`` (directories: their ``*.py`` and ``*.toml`` files, at any
    depth), sorted, each once."""
    out: set[Path] = set()
    for p in paths:
        if p.is_dir():
            out.update(f for f in p.rglob("*") if f.is_file() and f.suffix in SOURCE_SUFFIXES
                       and "__pycache__" not in f.parts)
        else:
            out.add(p)
    return sorted(out)


def build_key(sources: Iterable[Path], config: object, *, base: Path = ROOT,
              lock_file: Path | None = LOCK_FILE) -> str:
    """The key of a build: SHA-256 over the sources' names (relative to ``base`` where
    they lie under it) and bytes, the JSON of ``config``, the lock file and the Python
    version.  A missing source is an error: a key that ignored it would never change."""
    h = hashlib.sha256()
    for f in source_files(sources):
        name = f.relative_to(base) if f.is_relative_to(base) else f
        h.update(f"{name}\0".encode())
        h.update(f.read_bytes())
        h.update(b"\0")
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    if lock_file is not None:
        h.update(lock_file.read_bytes())
    h.update(sys.version.encode())
    return h.hexdigest()[:20]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # blocks while another process builds
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass(frozen=True)
class Build:
    """A finished build: its directory and the key it was made under."""

    name: str
    key: str
    path: Path
    built_now: bool  # made by this call (False: found in the cache)


def cached_build(name: str, sources: Iterable[Path], config: object,
                 builder: Callable[[Path], None], *, root: Path | None = None,
                 base: Path = ROOT, lock_file: Path | None = LOCK_FILE) -> Build:
    """The build ``name`` for these sources and config: found in the cache, or made now by
    ``builder(directory)`` (under an exclusive lock shared by every process on the
    machine) and then kept.  Exceptions of the builder propagate; nothing is kept then."""
    sources = list(sources)
    key = build_key(sources, config, base=base, lock_file=lock_file)
    root = root or cache_root()
    final = root / f"{name}-{key}"
    with _locked(root / f"{name}.lock"):
        if (final / DONE).is_file():
            return Build(name, key, final, built_now=False)
        # Built in place (a store's artifact locations are absolute paths), so a reader
        # goes by DONE, written last, never by the directory's existence.
        shutil.rmtree(final, ignore_errors=True)  # an older attempt that did not finish
        final.mkdir(parents=True)
        try:
            builder(final)
            (final / DONE).write_text(json.dumps(
                {"name": name, "key": key, "config": config,
                 "sources": [str(f) for f in source_files(sources)]},
                indent=1, default=str), encoding="utf-8")
        except BaseException:
            shutil.rmtree(final, ignore_errors=True)
            raise
        for old in root.glob(f"{name}-*"):  # older keys: the code that made them is gone
            if old != final and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        return Build(name, key, final, built_now=True)


# --- The digits pipeline's --quick runs ---------------------------------------------------

# What decides the runs' content: the pipeline's code and config, the demo's training
# driver, the recorder (src/refrun), and this file's builder.
DIGITS_SOURCES = (ROOT / "pipelines" / "digits", ROOT / "pipelines" / "demo.py",
                  ROOT / "pipelines" / "jax_cpu.py", ROOT / "pipelines" / "pairing.py",
                  ROOT / "pipelines" / "recipe.py", ROOT / "pipelines" / "__init__.py",
                  ROOT / "src" / "refrun",
                  Path(__file__).resolve())


def criteria_seeds() -> tuple[int, ...]:
    """The reference seeds scripts/make_criteria.py calibrates the criteria from (its
    SEEDS); the pipeline's plan trains the first three of them itself."""
    return tuple(script("make_criteria").SEEDS)


def script(name: str):  # -> the module scripts/<name>.py
    """A script of ``scripts/`` loaded as a module (they are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def digits_plan():  # -> pipelines.digits.variants.Plan
    """The pipeline's whole plan with reference seeds 0-7: what test_pipeline.py assesses
    (it uses the plan's seeds 0-2) and what test_criteria_fresh.py calibrates (0-7)."""
    from pipelines.digits.variants import REFERENCE_SEEDS, Plan, plan, reference_variants

    p = plan()
    extra = tuple(s for s in criteria_seeds() if s not in REFERENCE_SEEDS)
    return Plan([*p.references, *reference_variants(extra)], p.candidates)


@dataclass(frozen=True)
class TrainedStore:
    """A cached sqlite store of trained runs: ``ids`` maps a variant's name to its run."""

    path: Path  # the build's directory: mlflow.db, mlruns/ (artifacts)
    ids: dict[str, str]

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.path}/mlflow.db"

    def copy_to(self, dest: Path) -> str:
        """A writable copy of the store in ``dest`` (artifact locations rewritten to the
        copy); returns its tracking URI.  Tests that record into a store use this."""
        import sqlite3

        shutil.copytree(self.path, dest, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("spool", DONE))
        old, new = self.path.as_uri(), dest.resolve().as_uri()
        with contextlib.closing(sqlite3.connect(dest / "mlflow.db")) as con, con:
            con.execute("UPDATE experiments SET artifact_location = "
                        "replace(artifact_location, ?, ?)", (old, new))
            con.execute("UPDATE runs SET artifact_uri = replace(artifact_uri, ?, ?)",
                        (old, new))
        return f"sqlite:///{dest}/mlflow.db"


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _inside(d: Path) -> Iterator[None]:
    """The working directory is ``d`` while the block runs: the training processes inherit
    it, and nothing they leave lands in the repository's working tree."""
    cwd = Path.cwd()
    os.chdir(d)
    try:
        yield
    finally:
        os.chdir(cwd)


# --- The runs of mlruns.example: the reduced plan as its generator trains them ------------

# What decides them: the digits runs' sources and the generator, which says which variants
# and how they are recorded (MLFLOW_EVERY, its train_reduced).
EXAMPLE_SOURCES = (*DIGITS_SOURCES, ROOT / "scripts" / "make_example_store.py")
# As `make_example_store.py` trains them: one delivery process per run (refrun's default;
# the committed store was recorded so), whatever the session's environment says.
EXAMPLE_ENVIRONMENT = {"REFRUN_DELIVERY": "process"}


def _train_example(d: Path) -> None:
    gen = script("make_example_store")
    with _environ(**EXAMPLE_ENVIRONMENT), _inside(d):
        ids = gen.train_reduced(d, jobs=2)
    (d / "ids.json").write_text(json.dumps(ids, indent=1), encoding="utf-8")


def example_training_store() -> tuple[TrainedStore, str]:
    """The reduced plan of ``mlruns.example`` (the pipeline's reference seeds 0-2 and the
    generator's four candidates) trained by the generator's own ``train_reduced`` into a
    sqlite store, and the key of that build.  ``make_example_store.py --trained <path>``
    assesses a copy of it (tests/test_example_store_fresh.py), and the digits build below
    starts from a copy of it: those seven runs are trained once per session, not twice."""
    gen = script("make_example_store")
    config = {"variants": [v.command(quick=True, tracking_uri="<store>", spool_dir="<spool>",
                                     mlflow_every=gen.MLFLOW_EVERY)[1:]
                           for v in gen.reduced_plan().all],
              "environment": EXAMPLE_ENVIRONMENT}
    b = cached_build("example-training", EXAMPLE_SOURCES, config, _train_example)
    ids = json.loads((b.path / "ids.json").read_text(encoding="utf-8"))
    return TrainedStore(b.path, ids), b.key


def _train_digits_quick(d: Path, example: TrainedStore) -> None:
    from pipelines.demo import init_store, train_all
    from pipelines.digits.variants import Plan

    # The generator's seven runs (recorded as it records them: MLflow every 10th step, a
    # delivery process; the tests reading this store assess the curves artifact, which
    # keeps every point either way), then the rest of the plan trained into the copy.
    example.copy_to(d)
    uri = f"sqlite:///{d}/mlflow.db"
    init_store(uri)  # the experiment is there already: nothing to do
    full = digits_plan()
    rest = Plan([v for v in full.references if v.name not in example.ids],
                [v for v in full.candidates if v.name not in example.ids])
    # The training processes inherit the environment and the working directory: delivery
    # in-process (a delivery process per run adds an MLflow import each; the subject of
    # the tests reading this store is what was recorded, tests/test_durability.py tests
    # the delivery process).
    with _environ(REFRUN_DELIVERY="thread"), _inside(d):
        ids = train_all(rest, quick=True, uri=uri, spool_dir=str(d / "spool"), jobs=2)
    ids = {v.name: {**example.ids, **ids}[v.name] for v in full.all}
    (d / "ids.json").write_text(json.dumps(ids, indent=1), encoding="utf-8")


def digits_config(example_key: str) -> dict:
    """What the digits build is asked: every variant's command line, its environment, and
    the key of the example build it starts from (a change there rebuilds this too)."""
    return {"variants": [v.command(quick=True, tracking_uri="<store>", spool_dir="<spool>")[1:]
                         for v in digits_plan().all],
            "environment": {"REFRUN_DELIVERY": "thread"},
            "example_training": example_key}


def digits_quick_store() -> TrainedStore:
    """Every variant of the digits pipeline's plan and reference seeds 0-7, trained with
    ``--quick`` into one sqlite store: built once, then read by every test that needs
    them until the code that trains them changes.  The seven of them that
    ``mlruns.example`` holds come from :func:`example_training_store`, as recorded there."""
    example, example_key = example_training_store()
    b = cached_build("digits-quick", DIGITS_SOURCES, digits_config(example_key),
                     lambda d: _train_digits_quick(d, example))
    ids = json.loads((b.path / "ids.json").read_text(encoding="utf-8"))
    return TrainedStore(b.path, ids)

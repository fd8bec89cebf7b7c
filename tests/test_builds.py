"""The suite's cache of built products (tests/builds.py): a build is made once, read by
every later caller, and made again when the code or configuration that makes it changes.
Real files, a real builder function, real processes contending for the real lock."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builds import (
    DIGITS_SOURCES,
    EXAMPLE_SOURCES,
    ROOT,
    build_key,
    cached_build,
    digits_config,
    source_files,
)


def _counting_builder(log: Path):
    """A builder that records each call in ``log`` and writes a product from its input."""

    def build(d: Path) -> None:
        with log.open("a") as f:
            f.write(f"{d.name}\n")
        (d / "product.txt").write_text("built", encoding="utf-8")

    return build


def test_a_change_to_a_source_rebuilds_and_no_change_does_not(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT / "pipelines" / "digits", src, ignore=shutil.ignore_patterns(
        "__pycache__"))
    module = src / "train_torch.py"
    root, log = tmp_path / "cache", tmp_path / "calls.log"
    builder = _counting_builder(log)

    def build(config: object = None):
        return cached_build("t", [src], config or {"steps": 400}, builder, root=root,
                            base=tmp_path, lock_file=None)

    first = build()
    assert first.built_now and (first.path / "product.txt").read_text() == "built"
    again = build()  # nothing changed: read from the cache, the builder not called
    assert (again.built_now, again.key, again.path) == (False, first.key, first.path)
    assert log.read_text().splitlines() == [first.path.name]

    module.write_text(module.read_text() + "\n# a change to the training code\n")
    changed = build()
    assert changed.built_now and changed.key != first.key
    assert log.read_text().splitlines() == [first.path.name, changed.path.name]
    assert not first.path.exists()  # the old code's product is gone
    assert not build().built_now

    other = build({"steps": 600})  # another configuration is another product
    assert other.built_now and other.key not in (first.key, changed.key)
    assert len(log.read_text().splitlines()) == 3


def test_a_failed_build_leaves_nothing_that_looks_built(tmp_path: Path) -> None:
    src = tmp_path / "a.py"
    src.write_text("x = 1\n")
    root = tmp_path / "cache"

    def broken(d: Path) -> None:
        (d / "half.txt").write_text("half")
        raise RuntimeError("training failed")

    with pytest.raises(RuntimeError, match="training failed"):
        cached_build("t", [src], {}, broken, root=root, base=tmp_path, lock_file=None)
    assert not list(root.glob("t-*"))
    done = cached_build("t", [src], {}, _counting_builder(tmp_path / "log"), root=root,
                        base=tmp_path, lock_file=None)
    assert done.built_now and not (done.path / "half.txt").exists()


def test_the_digits_store_key_covers_its_training_and_recording_code(tmp_path: Path) -> None:
    """The cached digits runs are keyed by the pipeline's code, the demo's driver and the
    recorder: a change to any of them is a new key (copies, so the repository is not
    touched); an unrelated file is not part of it."""
    files = source_files(DIGITS_SOURCES)
    names = {str(f.relative_to(ROOT)) for f in files}
    for needed in ("pipelines/digits/train_torch.py", "pipelines/digits/train_jax.py",
                   "pipelines/digits/train_xla.py", "pipelines/digits/config.toml",
                   "pipelines/demo.py", "pipelines/recipe.py",
                   "src/refrun/recording/delivery.py",
                   "tests/builds.py"):
        assert needed in names, needed
    assert "pipelines/charlm/train_torch.py" not in names
    copy = tmp_path / "repo"
    for f in files:
        (copy / f.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, copy / f.relative_to(ROOT))
    sources = [copy / p.relative_to(ROOT) for p in DIGITS_SOURCES]
    key = build_key(sources, {"c": 1}, base=copy)
    assert build_key(sources, {"c": 1}, base=copy) == key
    assert build_key(sources, {"c": 2}, base=copy) != key
    for edited in ("pipelines/digits/config.toml", "src/refrun/recording/delivery.py"):
        f = copy / edited
        before = f.read_bytes()
        f.write_bytes(before + b"\n# edited\n")
        assert build_key(sources, {"c": 1}, base=copy) != key, edited
        f.write_bytes(before)
    assert build_key(sources, {"c": 1}, base=copy) == key


def test_the_example_runs_key_covers_the_generator_and_the_digits_key_covers_them(
        tmp_path: Path) -> None:
    """The runs of mlruns.example (the generator's training step, cached) are keyed by the
    digits runs' sources and the generator itself; the digits build starts from a copy of
    them, so their key is part of its configuration: an edit of the generator makes both
    anew."""
    names = {str(f.relative_to(ROOT)) for f in source_files(EXAMPLE_SOURCES)}
    assert "scripts/make_example_store.py" in names
    assert names >= {str(f.relative_to(ROOT)) for f in source_files(DIGITS_SOURCES)}
    copy = tmp_path / "repo"
    for f in source_files(EXAMPLE_SOURCES):
        (copy / f.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, copy / f.relative_to(ROOT))
    sources = [copy / p.relative_to(ROOT) for p in EXAMPLE_SOURCES]
    key = build_key(sources, {"c": 1}, base=copy)
    generator = copy / "scripts" / "make_example_store.py"
    generator.write_text(generator.read_text().replace("MLFLOW_EVERY = 10", "MLFLOW_EVERY = 5"))
    edited = build_key(sources, {"c": 1}, base=copy)
    assert edited != key
    digits = [copy / p.relative_to(ROOT) for p in DIGITS_SOURCES]
    assert build_key(digits, digits_config(key), base=copy) != \
        build_key(digits, digits_config(edited), base=copy)


_CONTENDER = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from builds import cached_build

root, log, go = Path({root!r}), Path({log!r}), Path({go!r})

def build(d):
    with log.open("a") as f:
        f.write("built\\n")
    (Path({started!r})).write_text("yes")
    deadline = time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:  # until the test says go
        time.sleep(0.05)

b = cached_build("t", [Path({src!r})], {{}}, build, root=root, base=root.parent,
                 lock_file=None)
print(json.dumps([str(b.path), b.built_now]))
"""


def _blocked_flock_waiters() -> int:
    """Processes now waiting for a flock (Linux: ``->`` lines of /proc/locks)."""
    return sum(1 for line in Path("/proc/locks").read_text().splitlines()
               if "->" in line and "FLOCK" in line)


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux's /proc/locks")
def test_two_processes_asking_at_once_build_once(tmp_path: Path) -> None:
    """xdist workers are processes: while one builds, another that asks waits on the lock
    and then reads the finished build, never building it a second time."""
    src = tmp_path / "a.py"
    src.write_text("x = 1\n")
    paths = {k: str(tmp_path / k) for k in ("root", "log", "go", "started")}
    code = _CONTENDER.format(tests=str(Path(__file__).parent), src=str(src), **paths)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    first = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env=env)
    started = Path(paths["started"])
    deadline = time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline:  # first is building
        time.sleep(0.05)
    assert started.exists()
    waiting_before = _blocked_flock_waiters()
    second = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              text=True, env=env)
    while _blocked_flock_waiters() <= waiting_before and time.monotonic() < deadline:
        time.sleep(0.05)  # until the second process waits on the lock
    assert second.poll() is None
    Path(paths["go"]).write_text("go")
    out1, _ = first.communicate(timeout=120)
    out2, _ = second.communicate(timeout=120)
    assert first.returncode == 0 and second.returncode == 0
    (p1, built1), (p2, built2) = json.loads(out1), json.loads(out2)
    assert p1 == p2 and (built1, built2) == (True, False)
    assert Path(paths["log"]).read_text().splitlines() == ["built"]

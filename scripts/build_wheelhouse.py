"""Build a wheelhouse: refrun's wheel and the dependencies a target machine lacks, for a
machine that reaches no package registry (a TPU VM): carry the folder, run its install.sh.

    # from the registry (pip resolves for the target platform and Python):
    .venv/bin/python scripts/build_wheelhouse.py wheelhouse/ \\
        --platform manylinux_2_28_x86_64 --python 3.11 --target-has tpu-index.txt
    # offline: the dependencies are this environment's installed distributions, repacked
    .venv/bin/python scripts/build_wheelhouse.py wheelhouse/ --from-environment ...
    # on the target (DIR is then appended to PYTHONPATH):
    sh wheelhouse/install.sh DIR [TARGET_INDEX_URL]

What is carried: the closure of refrun's requirements (core, plus each ``--extra``),
resolved for the target's platform and Python, less what ``--target-has`` says the target
offers.  That file lists ``name==version`` lines (several per name allowed: what the
target's own index or site-packages hold) or a bare ``name`` (any version it needs); a
distribution is left to the target when one of its versions satisfies every requirement
on it in the resolved closure, and carried otherwise (e.g. an older ``certifi`` than
databricks-sdk needs).  Packages that pin each other exactly travel together: a package
left to the target whose resolved version pins a carried one (``==``) is carried too,
unless the target offers exactly that version (the OpenTelemetry family pins itself
exactly).  Without ``--target-has`` everything is carried and install.sh needs no index.

The wheels of the dependencies come either from pip (the registry, or ``--find-links``
folders with ``--no-index``) or, with ``--from-environment``, from the distributions
installed in the interpreter running this script, repacked into wheels with their original
tags (their files as the installed RECORD lists them): no registry needed, the exact
versions of requirements/dev.lock.  refrun's own wheel is built from this checkout by its
build backend (offline when this environment has it: setuptools is pinned in the lock).

Exit codes: 0 built; 2 bad input or a wheelhouse that cannot be built (one line).
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.metadata as md
import io
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from packaging import tags as ptags
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PLATFORM = "manylinux_2_36_x86_64"  # the TPU v5e VM: glibc 2.36, x86_64
DEFAULT_PYTHON = "3.11"
MAX_MIB = 64  # what travels to the TPU machine with the working tree (docs/offline-install.md)
# The dist-info files an installer writes; a repacked wheel leaves them out.
INSTALLER_FILES = frozenset({"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"})
LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


class WheelhouseError(Exception):
    """A wheelhouse that cannot be built as asked: one line for the user."""


# -- the target ------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """The machine the wheelhouse is for: a Linux platform tag and a CPython version."""

    platform: str
    python: str

    def __post_init__(self) -> None:
        if not re.fullmatch(r"3\.\d+(\.\d+)?", self.python):
            raise WheelhouseError(f"--python {self.python!r}: expected 3.X or 3.X.Y")
        if not re.fullmatch(r"(many|musl)?linux(_\d+_\d+|1|2010|2014)?_[a-z0-9_]+",
                            self.platform):
            raise WheelhouseError(f"--platform {self.platform!r}: expected a Linux platform "
                                  "tag such as manylinux_2_28_x86_64")

    @property
    def version(self) -> tuple[int, int]:
        major, minor = self.python.split(".")[:2]
        return int(major), int(minor)

    @property
    def abi(self) -> str:
        return f"cp{self.version[0]}{self.version[1]}"

    @property
    def machine(self) -> str:
        m = re.fullmatch(r"(?:manylinux_\d+_\d+|musllinux_\d+_\d+|manylinux1|manylinux2010|"
                         r"manylinux2014|linux)_(.+)", self.platform)
        assert m is not None  # __post_init__ checked the form
        return m.group(1)

    def platforms(self) -> list[str]:
        """The platform tags a wheel may carry to install there, best first (as pip
        expands ``--platform``: a glibc 2.28 system takes every manylinux tag up to 2.28)."""
        arch = self.machine
        m = re.fullmatch(r"(many|musl)linux_(\d+)_(\d+)_.+", self.platform)
        legacy = self.platform.split("_")[0]
        if legacy in LEGACY_MANYLINUX:
            m = None
            glibc = LEGACY_MANYLINUX[legacy]
            kind = "many"
        elif m is not None:
            kind, glibc = m.group(1), (int(m.group(2)), int(m.group(3)))
        else:
            return [self.platform]
        out = []
        for minor in range(glibc[1], -1 if kind == "musl" else 4, -1):
            out.append(f"{kind}linux_{glibc[0]}_{minor}_{arch}")
            if kind == "many":
                out += [f"{name}_{arch}" for name, v in LEGACY_MANYLINUX.items()
                        if v == (glibc[0], minor)]
        return out

    def tags(self) -> list[ptags.Tag]:
        plats = self.platforms()
        return [*ptags.cpython_tags(self.version, abis=[self.abi], platforms=plats),
                *ptags.compatible_tags(self.version, self.abi, plats)]

    def marker_env(self, extra: str = "") -> dict[str, str]:
        """The values environment markers are evaluated with on the target."""
        env = dict(default_environment())
        full = self.python if self.python.count(".") == 2 else f"{self.python}.0"
        env.update(python_version=".".join(map(str, self.version)), python_full_version=full,
                   sys_platform="linux", platform_system="Linux", os_name="posix",
                   platform_machine=self.machine, implementation_name="cpython",
                   platform_python_implementation="CPython", implementation_version=full,
                   extra=extra)
        return env

    def pip_args(self) -> list[str]:
        """pip's options for the target; every platform tag it accepts is named (pip 23
        does not expand a ``manylinux_2_X`` tag to the older ones itself)."""
        plats = [a for p in self.platforms() for a in ("--platform", p)]
        return ["--only-binary=:all:", *plats, "--python-version", self.python,
                "--implementation", "cp", "--abi", self.abi]


# -- what the target offers --------------------------------------------------------------
@dataclass(frozen=True)
class Offer:
    """What the target machine holds: versions per distribution (``None``: any version)."""

    versions: Mapping[str, frozenset[Version] | None] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> Offer:
        """``name==version`` lines (``pip list --format=freeze``), wheel file names (a
        listing of the target's index folder) or bare ``name`` lines; ``#`` starts a
        comment."""
        out: dict[str, set[Version] | None] = {}
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise WheelhouseError(f"--target-has {path}: {exc.strerror or exc}") from exc
        for n, raw in enumerate(lines, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if line.endswith(".whl"):
                try:
                    wname, wversion, _, _ = parse_wheel_filename(Path(line).name)
                except ValueError as exc:
                    raise WheelhouseError(f"{path}:{n}: {exc}") from exc
                known = out.setdefault(wname, set())
                if known is not None:
                    known.add(wversion)
                continue
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*(\S+))?", line)
            if m is None:
                raise WheelhouseError(f"{path}:{n}: expected 'name==version' or 'name', "
                                      f"got {raw.strip()!r}")
            name = canonicalize_name(m.group(1))
            if m.group(2) is None:
                out[name] = None
                continue
            try:
                version = Version(m.group(2))
            except InvalidVersion as exc:
                raise WheelhouseError(f"{path}:{n}: {m.group(2)!r} is not a version") from exc
            known = out.setdefault(name, set())
            if known is not None:
                known.add(version)
        return cls({k: None if v is None else frozenset(v) for k, v in out.items()})

    def satisfies(self, name: str, spec: SpecifierSet) -> bool:
        if name not in self.versions:
            return False
        versions = self.versions[name]
        return versions is None or any(spec.contains(v, prereleases=True) for v in versions)

    def has_exactly(self, name: str, version: Version) -> bool:
        versions = self.versions.get(name, frozenset())
        return name in self.versions and (versions is None or version in versions)


# -- the resolved closure ----------------------------------------------------------------
@dataclass(frozen=True)
class Dist:
    """One distribution of the resolved closure, with the requirements it declares."""

    name: str  # canonical
    version: Version
    requires: tuple[Requirement, ...]


def active(req: Requirement, target: Target, extras: Iterable[str]) -> bool:
    """Whether ``req`` applies on the target with the requirer's ``extras`` chosen."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate(target.marker_env(e)) for e in ("", *extras))


def requirement_specs(closure: Mapping[str, Dist], root: Iterable[Requirement],
                      target: Target, extras: Mapping[str, frozenset[str]]
                      ) -> dict[str, SpecifierSet]:
    """Every requirement on each distribution of the closure, combined: what a version
    the target offers must satisfy to stand in for the resolved one."""
    specs: dict[str, SpecifierSet] = {n: SpecifierSet() for n in closure}
    reqs = [(r, frozenset()) for r in root]
    reqs += [(r, extras.get(d.name, frozenset())) for d in closure.values() for r in d.requires]
    for req, chosen in reqs:
        name = canonicalize_name(req.name)
        if name in specs and active(req, target, chosen):
            specs[name] &= req.specifier
    return specs


def carried(closure: Mapping[str, Dist], root: Iterable[Requirement], target: Target,
            offer: Offer | None, extras: Mapping[str, frozenset[str]]) -> set[str]:
    """The distributions of ``closure`` the wheelhouse must carry (module docstring)."""
    if offer is None:
        return set(closure)
    specs = requirement_specs(closure, root, target, extras)
    carry = {n for n in closure if not offer.satisfies(n, specs[n])}
    grew = True
    while grew:  # exact pins tie packages together
        grew = False
        for d in closure.values():
            if d.name in carry or offer.has_exactly(d.name, d.version):
                continue
            pins = {canonicalize_name(r.name) for r in d.requires
                    if any(s.operator in ("==", "===") for s in r.specifier)
                    and active(r, target, extras.get(d.name, frozenset()))}
            if pins & carry:
                carry.add(d.name)
                grew = True
    return carry


def closure_from_environment(root: Iterable[Requirement], target: Target
                             ) -> tuple[dict[str, Dist], dict[str, frozenset[str]]]:
    """The closure of ``root`` among the distributions installed here (they were
    installed together, so their versions are one consistent resolution)."""
    closure: dict[str, Dist] = {}
    extras: dict[str, set[str]] = {}
    todo = [(r, frozenset[str]()) for r in root]
    while todo:
        req, chosen = todo.pop()
        if not active(req, target, chosen):
            continue
        name = canonicalize_name(req.name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError as exc:
            raise WheelhouseError(f"--from-environment: {req} is needed but {name} is not "
                                  f"installed in {sys.prefix}") from exc
        version = Version(dist.version)
        if not req.specifier.contains(version, prereleases=True):
            raise WheelhouseError(f"--from-environment: {req} is needed but {sys.prefix} "
                                  f"has {name} {version}")
        new_extras = set(req.extras) - extras.setdefault(name, set())
        if name in closure and not new_extras:
            continue
        extras[name] |= set(req.extras)
        requires = tuple(Requirement(r) for r in dist.requires or ())
        closure[name] = Dist(name, version, requires)
        todo += [(r, frozenset(extras[name])) for r in requires]
    return closure, {k: frozenset(v) for k, v in extras.items()}


def closure_from_pip(wheel: Path, extras: list[str], target: Target, index_args: list[str]
                     ) -> tuple[dict[str, Dist], dict[str, frozenset[str]]]:
    """The closure pip resolves for the target (``pip install --dry-run --report``)."""
    with tempfile.TemporaryDirectory(prefix="wheelhouse-report-") as tmp:
        report = Path(tmp) / "report.json"
        spec = f"refrun[{','.join(extras)}] @ {wheel.resolve().as_uri()}" if extras \
            else str(wheel.resolve())
        # --target: pip takes platform options only for a target folder (nothing is
        # written there with --dry-run).
        pip(["install", "--dry-run", "--ignore-installed", "--quiet", "--report",
             str(report), "--target", str(Path(tmp) / "target"), *target.pip_args(),
             *index_args, spec], "resolving for the target")
        items = json.loads(report.read_text(encoding="utf-8"))["install"]
    closure: dict[str, Dist] = {}
    for item in items:
        meta = item["metadata"]
        name = canonicalize_name(meta["name"])
        if name == "refrun":
            continue
        closure[name] = Dist(name, Version(meta["version"]),
                             tuple(Requirement(r) for r in meta.get("requires_dist", [])))
    # pip resolved every extra it was asked for; the report does not say which, so each
    # distribution's requirements are taken with the extras some requirer named.
    chosen: dict[str, set[str]] = {}
    for d in closure.values():
        for r in d.requires:
            if r.extras and active(r, target, ()):
                chosen.setdefault(canonicalize_name(r.name), set()).update(r.extras)
    return closure, {k: frozenset(v) for k, v in chosen.items()}


# -- wheels --------------------------------------------------------------------------------
def pip(args: list[str], what: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-1:]
        raise WheelhouseError(f"pip failed {what}: {' | '.join(errors) or proc.returncode}")


def backend_installed(pyproject: Mapping[str, object]) -> bool:
    """Whether this interpreter has refrun's build backend (its ``requires``), so the
    wheel can be built without a registry (``--no-build-isolation``)."""
    requires = pyproject.get("build-system", {}).get("requires", [])  # type: ignore[union-attr]
    for text in requires:
        req = Requirement(text)
        try:
            if not req.specifier.contains(Version(md.version(req.name)), prereleases=True):
                return False
        except md.PackageNotFoundError:
            return False
    return True


def build_refrun(out: Path, index_args: list[str]) -> Path:
    """refrun's wheel, built from a copy of this checkout's package sources (a build in
    the checkout would leave ``build/`` and ``*.egg-info`` there)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    with tempfile.TemporaryDirectory(prefix="wheelhouse-src-") as tmp:
        src = Path(tmp) / "refrun"
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, src / name)
        shutil.copytree(ROOT / "src", src / "src", ignore=ignore)
        isolation = [] if backend_installed(pyproject) else index_args
        flags = ["--no-build-isolation"] if backend_installed(pyproject) else []
        pip(["wheel", "--no-deps", "--quiet", *flags, *isolation, "-w", str(out), str(src)],
            "building refrun's wheel")
    found = sorted(out.glob("refrun-*.whl"))
    if not found:
        raise WheelhouseError(f"building refrun's wheel left no refrun-*.whl in {out}")
    return found[-1]


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def wheel_tags(dist: md.Distribution) -> tuple[str, list[ptags.Tag]]:
    """(build tag or '', the tags) an installed distribution's ``WHEEL`` file records."""
    text = dist.read_text("WHEEL")
    if text is None:
        raise WheelhouseError(f"{dist.metadata['Name']} {dist.version}: installed without "
                              "a WHEEL file (not from a wheel); cannot repack it")
    found: list[ptags.Tag] = []
    build = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Tag":
            found += list(ptags.parse_tag(value.strip()))
        elif key.strip() == "Build":
            build = value.strip()
    return build, found


def _tag_string(found: list[ptags.Tag]) -> str:
    """The file name's tag triple; a set that is not a product of its parts keeps only its
    first tag (a file name can only express products)."""
    parts = [sorted({getattr(t, a) for t in found}) for a in ("interpreter", "abi", "platform")]
    product = {ptags.Tag(i, a, p) for i in parts[0] for a in parts[1] for p in parts[2]}
    if product != set(found):
        first = found[0]
        return f"{first.interpreter}-{first.abi}-{first.platform}"
    return "-".join(".".join(p) for p in parts)


def repack(name: str, out: Path, target: Target | None = None, compress: bool = True) -> Path:
    """A wheel of the installed distribution ``name``: the files its RECORD lists (byte
    for byte; compiled ``__pycache__`` files and the installer's own files left out;
    scripts that are not entry points under ``.data/scripts``, other files outside
    site-packages under ``.data/data``), its original tags.  Refuses a distribution whose
    tags do not install on ``target``."""
    dist = md.distribution(name)
    meta_name = dist.metadata["Name"]
    build, found = wheel_tags(dist)
    if target is not None and not set(found) & set(target.tags()):
        raise WheelhouseError(f"{meta_name} {dist.version} is installed here as "
                              f"{_tag_string(found)}, which does not install on "
                              f"{target.platform} / Python {target.python}")
    base = Path(str(dist.locate_file(""))).resolve()
    prefix = Path(sys.prefix).resolve()
    entry_scripts = {ep.name for ep in dist.entry_points
                     if ep.group in ("console_scripts", "gui_scripts")}
    stem = f"{canonicalize_name(meta_name).replace('-', '_')}-{dist.version}"
    data_dir = f"{stem}.data"
    info_dir = None
    members: list[tuple[str, Path]] = []
    for rel in dist.files or ():
        path = Path(str(dist.locate_file(rel))).resolve()
        parts = rel.parts
        if parts and parts[0].endswith(".dist-info"):
            info_dir = parts[0]
            if rel.name in INSTALLER_FILES and len(parts) == 2:
                continue
            members.append((rel.as_posix(), path))
        elif "__pycache__" in parts or rel.suffix == ".pyc":
            continue
        elif path.is_relative_to(base) and not rel.as_posix().startswith(".."):
            members.append((rel.as_posix(), path))
        elif path.is_relative_to(prefix / "bin"):
            if path.name not in entry_scripts:
                members.append((f"{data_dir}/scripts/{path.name}", path))
        elif path.is_relative_to(prefix):
            members.append((f"{data_dir}/data/{path.relative_to(prefix).as_posix()}", path))
    if info_dir is None:
        raise WheelhouseError(f"{meta_name} {dist.version}: its RECORD lists no .dist-info")
    tag_text = _tag_string(found)
    filename = f"{stem}{'-' + build if build else ''}-{tag_text}.whl"
    out.mkdir(parents=True, exist_ok=True)
    dest = out / filename
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    mode = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(dest, "w", mode) as zf:
        for arc, path in members:
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise WheelhouseError(f"{meta_name} {dist.version}: {path} is listed in its "
                                      f"RECORD but cannot be read ({exc.strerror})") from exc
            if arc.startswith(f"{data_dir}/scripts/") and data.startswith(b"#!") \
                    and b"python" in data.split(b"\n", 1)[0]:
                data = b"#!python\n" + data.split(b"\n", 1)[1]  # the installer's placeholder
            info = zipfile.ZipInfo(arc, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (path.stat().st_mode & 0o777 | 0o100000) << 16
            info.compress_type = mode
            zf.writestr(info, data)
            writer.writerow([arc, _record_hash(data), len(data)])
        writer.writerow([f"{info_dir}/RECORD", "", ""])
        zf.writestr(zipfile.ZipInfo(f"{info_dir}/RECORD", date_time=(1980, 1, 1, 0, 0, 0)),
                    record.getvalue())
    parse_wheel_filename(filename)  # the name pip will read back
    return dest


# -- the wheelhouse ------------------------------------------------------------------------
def refrun_requirements(wheel: Path, extras: list[str], target: Target) -> list[Requirement]:
    """refrun's requirements with ``extras`` as its wheel declares them (the installed
    refrun may be an older checkout's)."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode("utf-8")
    declared = {m.group(1) for m in re.finditer(r"^Provides-Extra: (\S+)$", text, re.M)}
    unknown = sorted(set(extras) - declared)
    if unknown:
        raise WheelhouseError(f"--extra {unknown[0]}: refrun declares no such extra "
                              f"(it has: {', '.join(sorted(declared))})")
    reqs = [Requirement(m.group(1)) for m in re.finditer(r"^Requires-Dist: (.+)$", text, re.M)]
    out: list[Requirement] = []
    todo = [r for r in reqs if active(r, target, extras)]
    while todo:  # an extra may name refrun's other extras (all = refrun[analysis,ui])
        r = todo.pop()
        if canonicalize_name(r.name) == "refrun":
            todo += [q for q in reqs if active(q, target, r.extras) and q.marker is not None
                     and not active(q, target, ())]
            continue
        out.append(r)
    return out


def install_script(wheel: Path, extras: list[str], target: Target, partial: bool) -> str:
    """install.sh: the one command to run on the target (``sh install.sh DIR [INDEX]``)."""
    version = parse_wheel_filename(wheel.name)[1]
    spec = f"refrun[{','.join(extras)}]=={version}" if extras else f"refrun=={version}"
    need_index = ("# This wheelhouse carries only what the target lacks: give the target's "
                  "own package index.\n[ -n \"${2:-}\" ] || { echo \"usage: sh $0 DIR "
                  "INDEX_URL\" >&2; exit 2; }\n") if partial else ""
    return f"""#!/bin/sh
# Install {spec} from this wheelhouse (built for {target.platform}, Python {target.python})
# into DIR, then append DIR to PYTHONPATH (the machine's own packages stay first):
#   sh install.sh DIR [INDEX_URL]      export PYTHONPATH="$PYTHONPATH:DIR"
set -eu
here=$(cd "$(dirname "$0")" && pwd)
dir=${{1:?usage: sh install.sh DIR [INDEX_URL]}}
{need_index}if [ -n "${{2:-}}" ]; then index="--index-url $2"; else index=--no-index; fi
# shellcheck disable=SC2086
exec "${{PYTHON:-python3}}" -m pip install --target "$dir" --only-binary :all: $index \\
    --find-links "$here" {shlex.quote(spec)}
"""


def build(out: Path, target: Target, extras: list[str], offer: Offer | None,
          from_environment: bool, index_args: list[str], max_mib: float,
          constraint: list[str]) -> list[Path]:
    if out.exists() and any(out.iterdir()):
        raise WheelhouseError(f"{out}: exists and is not empty (a wheelhouse is built anew)")
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        stage = Path(tmp) / "wheelhouse"
        stage.mkdir()
        wheel = build_refrun(stage, index_args)
        root = refrun_requirements(wheel, extras, target)
        if from_environment:
            closure, chosen = closure_from_environment(root, target)
        else:
            closure, chosen = closure_from_pip(wheel, extras, target,
                                               [*index_args, *constraint])
        carry = sorted(carried(closure, root, target, offer, chosen))
        if from_environment:
            for name in carry:
                repack(name, stage, target)
                _within(stage, max_mib)  # refused as soon as it is too large
        elif carry:
            pins = [f"{n}=={closure[n].version}" for n in carry]
            pip(["download", "--no-deps", "--quiet", *target.pip_args(), *index_args,
                 "-d", str(stage), *pins], "downloading the wheels to carry")
        (stage / "install.sh").write_text(install_script(wheel, extras, target,
                                                         offer is not None), encoding="utf-8")
        (stage / "install.sh").chmod(0o755)
        _within(stage, max_mib)
        out.mkdir(parents=True, exist_ok=True)
        for p in sorted(stage.iterdir()):
            shutil.move(str(p), out / p.name)
    return sorted(out.iterdir())


def _within(stage: Path, max_mib: float) -> None:
    size = sum(p.stat().st_size for p in stage.iterdir())
    if size > max_mib * 2**20:
        raise WheelhouseError(f"the wheelhouse would hold over {size / 2**20:.1f} MiB, over "
                              f"--max-mib {max_mib:g}: name what the target has "
                              "(--target-has) so less is carried")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the wheelhouse folder to create (new or empty)")
    p.add_argument("--platform", default=DEFAULT_PLATFORM,
                   help=f"the target's platform tag (default {DEFAULT_PLATFORM})")
    p.add_argument("--python", default=DEFAULT_PYTHON,
                   help=f"the target's Python, 3.X (default {DEFAULT_PYTHON})")
    p.add_argument("--extra", action="append", default=[],
                   help="one of refrun's extras to include (repeatable; default: the core)")
    p.add_argument("--target-has", type=Path, metavar="FILE",
                   help="what the target offers: 'name==version' or 'name' lines")
    p.add_argument("--from-environment", action="store_true",
                   help="repack the dependencies from this interpreter's installed "
                        "distributions (no registry)")
    p.add_argument("--find-links", action="append", default=[], metavar="DIR",
                   help="pip: also look for wheels in DIR (repeatable)")
    p.add_argument("--no-index", action="store_true", help="pip: use no package index")
    p.add_argument("--index-url", help="pip: the package index to resolve and download from")
    p.add_argument("--constraint", default=str(ROOT / "requirements" / "dev.lock"),
                   metavar="FILE",
                   help="pip: resolve within these pins (default requirements/dev.lock: the "
                        "versions the suite tests, so a store written on the target has "
                        "the schema the team's MLflow reads); '' for none")
    p.add_argument("--max-mib", type=float, default=MAX_MIB,
                   help=f"refuse a wheelhouse larger than this (default {MAX_MIB})")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    index_args = [a for d in args.find_links for a in ("--find-links", str(Path(d).resolve()))]
    index_args += ["--no-index"] if args.no_index else []
    index_args += ["--index-url", args.index_url] if args.index_url else []
    constraint = ["--constraint", args.constraint] if args.constraint else []
    try:
        target = Target(args.platform, args.python)
        offer = Offer.read(args.target_has) if args.target_has else None
        files = build(args.out, target, sorted(set(args.extra)), offer,
                      args.from_environment, index_args, args.max_mib, constraint)
    except WheelhouseError as exc:
        print(f"build_wheelhouse: error: {exc}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in files)
    for p in files:
        print(f"{p.stat().st_size / 2**20:8.2f} MiB  {p.name}")
    print(f"{size / 2**20:8.2f} MiB  in {args.out} ({len(files) - 1} wheels)")
    index = " INDEX_URL" if offer is not None else ""
    print(f"on the target: sh {args.out.name}/install.sh DIR{index}; "
          "export PYTHONPATH=\"$PYTHONPATH:DIR\"")
    return 0


if __name__ == "__main__":
    sys.exit(main())

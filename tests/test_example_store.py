"""mlruns.example opens with the command the README documents: a real `mlflow ui` started
in a copy of the clone's root answers its REST API with the store's runs, lists their
artifacts and serves them (the expected bytes), without touching the database file.

The expected values are read from the store's sqlite file and artifact directory directly.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
import sqlite3
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import MlflowServer, free_port

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "mlruns.example"
MAX_BYTES = 12 * 2**20  # what scripts/make_example_store.py refuses to exceed


def documented_command(doc: Path) -> list[str]:
    """The command that browses the example store, as written in ``doc``."""
    lines = [ln.strip() for ln in doc.read_text(encoding="utf-8").splitlines()
             if "mlflow ui" in ln and "mlruns.example/mlflow.db" in ln]
    assert lines, f"{doc.name} documents no command for mlruns.example"
    return shlex.split(lines[0].strip("`"))


def runnable(cmd: list[str], port: int) -> list[str]:
    """The documented command with this interpreter's mlflow and a free local port."""
    assert cmd[0].endswith("mlflow") and cmd[1] == "ui"
    args = cmd[2:]
    i = args.index("--port")
    args[i + 1] = str(port)
    return [sys.executable, "-m", "mlflow", "ui", *args, "--host", "127.0.0.1",
            "--workers", "1"]


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200
        return r.read()


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def store_runs(db: Path) -> dict[str, dict[str, str]]:
    """run id -> its tags, straight from the sqlite file."""
    con = sqlite3.connect(db)
    try:
        out: dict[str, dict[str, str]] = {}
        for run, key, value in con.execute("SELECT run_uuid, key, value FROM tags"):
            out.setdefault(run, {})[key] = value
        locations = con.execute("SELECT artifact_uri FROM runs UNION ALL "
                                "SELECT artifact_location FROM experiments").fetchall()
    finally:
        con.close()
    absolute = [loc for (loc,) in locations if loc.startswith(("/", "file:"))
                or re.match(r"^[A-Za-z]:\\", loc)]
    assert not absolute, f"absolute artifact locations: {absolute[:2]}"
    return out


def test_example_store_is_small_and_relative() -> None:
    size = sum(f.stat().st_size for f in STORE.rglob("*") if f.is_file())
    assert 0 < size < MAX_BYTES
    runs = store_runs(STORE / "mlflow.db")
    roles = [t.get("refrun.role") for t in runs.values()]
    assert roles.count("reference") >= 3 and roles.count("comparison") >= 2
    # the same command in the README and in docs/pipelines.md
    assert documented_command(ROOT / "README.md") == \
        documented_command(ROOT / "docs" / "pipelines.md")


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_documented_command_serves_the_example_store(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    clone.mkdir()
    shutil.copytree(STORE, clone / "mlruns.example")
    db = clone / "mlruns.example" / "mlflow.db"
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    expected = store_runs(db)

    port = free_port()
    server = MlflowServer(tmp_path, port, command=runnable(
        documented_command(ROOT / "README.md"), port), cwd=clone)
    server.start(timeout=150)
    try:
        api = server.url + "/api/2.0/mlflow"
        exp = json.loads(get(api + "/experiments/get-by-name?experiment_name=digits-mlp"))
        found = post(api + "/runs/search", {"experiment_ids": [exp["experiment"]
                                                               ["experiment_id"]],
                                            "max_results": 1000})["runs"]
        by_id = {r["info"]["run_id"]: {t["key"]: t["value"] for t in r["data"]["tags"]}
                 for r in found}
        assert set(by_id) == set(expected)
        for run_id, tags in expected.items():
            for key in ("refrun.role", "pipeline.variant", "refrun.acceptance.verdict"):
                assert by_id[run_id].get(key) == tags.get(key)

        # a training run's curves and a comparison run's report and assessment, through
        # the server, byte for byte what the store holds
        ref = next(i for i, t in expected.items() if t.get("refrun.role") == "reference")
        cmp_run = next(i for i, t in expected.items()
                       if t.get("refrun.role") == "comparison"
                       and t.get("refrun.acceptance.verdict") == "fail")
        for run_id, paths in ((ref, ["refrun/curves.parquet"]),
                              (cmp_run, ["refrun/report.html", "refrun/assessment.json"])):
            listed = json.loads(get(f"{api}/artifacts/list?run_id={run_id}&path=refrun"))
            assert set(paths) <= {f["path"] for f in listed["files"]}
            exp_dir = clone / listed["root_uri"]
            for path in paths:
                q = urllib.parse.urlencode({"path": path, "run_uuid": run_id})
                body = get(f"{server.url}/get-artifact?{q}")
                assert body == (exp_dir / path).read_bytes()
        report = get(f"{server.url}/get-artifact?" + urllib.parse.urlencode(
            {"path": "refrun/report.html", "run_uuid": cmp_run})).decode()
        assert expected[cmp_run]["refrun.compared.candidate"] in report
        assessment = json.loads(get(f"{server.url}/get-artifact?" + urllib.parse.urlencode(
            {"path": "refrun/assessment.json", "run_uuid": cmp_run})))
        assert assessment["verdict"] == "fail"
        assert assessment["candidate"] == expected[cmp_run]["refrun.compared.candidate"]
        assert b"<html" in get(server.url + "/").lower()  # the UI itself
    finally:
        server.kill()
    # browsing from the clone leaves the committed database as it was
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before


# Where a machine's paths live: temp dirs, home directories, this project's checkouts.
MACHINE_PATH = re.compile(rb"(/tmp/|/var/folders/|/home/|/root/|/Users/|/work/|"
                          rb"[A-Za-z]:\\\\(Users|Windows)\\\\)")


def test_example_store_names_no_path_of_the_machine_that_made_it() -> None:
    """No path of the generating machine in any file: database, environment.json,
    assessment.json, reports (scripts/make_example_store.py scrubs them)."""
    import tempfile

    needles = [p.encode() for p in {tempfile.gettempdir() + "/", str(Path.home()) + "/",
                                    sys.prefix, sys.base_prefix, str(ROOT)}]
    # a file of the clone copied byte for byte (the criteria file, signed by its digest)
    # is project content: its comments may show example commands with /tmp paths
    project = {p.read_bytes() for p in (ROOT / "pipelines" / "criteria").glob("*.toml")}
    found = []
    for f in sorted(STORE.rglob("*")):
        if not f.is_file() or f.read_bytes() in project:
            continue
        data = f.read_bytes()
        found += [f"{f.relative_to(STORE)}: {m.group(0)!r}" for m in
                  MACHINE_PATH.finditer(data)][:1]
        found += [f"{f.relative_to(STORE)}: {n!r}" for n in needles if n in data]
    assert not found, found[:10]
    # what is there instead: the interpreter and the criteria file, relative
    env = next(STORE.rglob("refrun/environment.json"))
    assert json.loads(env.read_text())["executable"].startswith("<python>")
    a = json.loads(next(STORE.rglob("refrun/assessment.json")).read_text())
    criteria = Path(a["criteria"]["path"])
    assert not criteria.is_absolute() and (ROOT / criteria).is_file()


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_example_store_reports_render_offline_from_the_store(tmp_path: Path) -> None:
    """Every logged report, opened as a file from a copy of the store with the network
    blocked, draws all its plots with the store's one copy of plotly.js."""
    from playwright.sync_api import sync_playwright

    store = tmp_path / "mlruns.example"
    shutil.copytree(STORE, store)
    reports = sorted(store.rglob("refrun/report.html"))
    assert len(reports) >= 2
    assert (store / "plotly.min.js").stat().st_size > 1_000_000
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path="/usr/bin/chromium",
                              args=["--headless", "--no-sandbox", "--disable-gpu",
                                    "--disable-background-networking"])
        try:
            for report in reports:
                page = b.new_page()
                requests: list[str] = []
                page.on("request", lambda r, seen=requests: seen.append(r.url))
                page.route("http*://**", lambda route: route.abort())
                page.goto(report.as_uri())
                page.wait_for_selector("body[data-rendered]", state="attached",
                                       timeout=120_000)
                assert page.get_attribute("body", "data-rendered") == "true", report
                n_plots = page.locator("div.plot").count()
                assert n_plots > 0
                assert page.locator("div.plot .main-svg").count() >= n_plots
                assert all(u.startswith("file://") for u in requests), requests
                assert (store / "plotly.min.js").as_uri() in requests
                page.close()
        finally:
            b.close()

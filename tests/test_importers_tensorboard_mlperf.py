"""`refrun import tensorboard` and `refrun import mlperf` on files written by the real
writers (torch.utils.tensorboard.SummaryWriter; mlperf-logging's mllog) and on hostile
files (truncated records, corrupted bytes, unknown tags, mixed runs in one directory).
Expected values are the ones the test handed to the writer."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest

from refrun import schema
from refrun.cli import main
from refrun.comparison import CompareOptions, compare, load_run
from refrun.errors import RefrunInputError
from refrun.importers import parse_mlperf, parse_tensorboard


def _count_runs(uri: str) -> int:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    return sum(len(client.search_runs([e.experiment_id]))
               for e in client.search_experiments())


def _import(store, fmt: str, path: Path, capsys, *extra: str) -> tuple[int, list[str], str]:
    capsys.readouterr()
    rc = main(["import", fmt, str(path), "--workload", "w", "--role", "reference",
               "--hardware", "a100", "--tracking-uri", store.tracking_uri, *extra])
    out = capsys.readouterr()
    return rc, out.out.split(), out.err


# --- TensorBoard ---------------------------------------------------------------------------

def _write_tb(logdir: Path, steps: range, scale: float, extras: bool = False) -> None:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(logdir))
    for s in steps:
        w.add_scalar("train/loss", scale / (s + 1), s)
        w.add_scalar("lr", 0.1 * scale, s)
        if extras:  # TF2-style tensor scalar, and summaries that are not scalars
            w.add_scalar("eval/acc", 0.5 + s / 100, s, new_style=True)
    if extras:
        w.add_histogram("weights", np.arange(10.0), 0)
        w.add_text("note", "not a scalar", 0)
    w.close()


@pytest.fixture(scope="module")
def tb_logdir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float, float]:
    """runs a/ (extras) and b/ (two writer sessions: a restart repeating steps 3-4)."""
    root = tmp_path_factory.mktemp("tb")
    t0 = time.time()
    _write_tb(root / "a", range(6), 1.0, extras=True)
    _write_tb(root / "b", range(5), 2.0)
    time.sleep(1.1)  # event file names carry the writer's start second: a later name
    _write_tb(root / "b", range(3, 8), 3.0)
    return root, t0, time.time()


def test_tensorboard_log_dir_every_run_every_scalar_wall_time_kept(
        store, tb_logdir, capsys) -> None:
    root, t0, t1 = tb_logdir
    rc, ids, err = _import(store, "tensorboard", root, capsys, "--rename", "train/loss=loss")
    assert rc == 0 and len(ids) == 2, err
    a = load_run(ids[0], tracking_uri=store.tracking_uri)
    b = load_run(ids[1], tracking_uri=store.tracking_uri)
    assert a.metric_names == ["eval/acc", "loss", "lr"]  # histogram and text skipped
    s, v, _ = a.series("loss")
    np.testing.assert_allclose(v, [1.0 / (k + 1) for k in range(6)], rtol=1e-6)
    s, v, _ = a.series("eval/acc")  # the new_style (tensor) scalars
    assert s.tolist() == list(range(6))
    np.testing.assert_allclose(v, [0.5 + k / 100 for k in range(6)], rtol=1e-6)
    # b: both writer sessions in file order; the restart's steps 3, 4 are repeated steps
    s, v, _ = b.series("loss")
    assert s.tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 6, 7]
    np.testing.assert_allclose(v, [2 / 1, 2 / 2, 2 / 3, 2 / 4, 2 / 5,
                                   3 / 4, 3 / 5, 3 / 6, 3 / 7, 3 / 8], rtol=1e-6)
    for run in (a, b):
        stamps = run.curves["timestamp_ms"].to_numpy() / 1000.0
        assert (stamps >= t0 - 1).all() and (stamps <= t1 + 1).all()
        assert run.tags[schema.TAG_IMPORT_FORMAT] == "tensorboard"
    assert a.params["import.tensorboard.skipped_values"] == "2"
    assert b.params["import.tensorboard.files"] == "2"
    # the wall times are those of the writer: the restart's points are >= 1 s later
    ts = b.curves[b.curves["metric"] == "loss"]["timestamp_ms"].to_numpy()
    assert ts[5] - ts[4] >= 1000
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store.tracking_uri)
    assert client.get_run(ids[0]).info.status == "FINISHED"
    assert client.get_run(ids[0]).info.run_name == "a"
    hist = client.get_metric_history(ids[0], "loss")  # MLflow's view keeps the wall time
    assert {m.timestamp for m in hist} <= set(a.curves["timestamp_ms"].tolist())
    # an event file on its own is one run
    one = sorted((root / "a").iterdir())[0]
    rc, ids1, _ = _import(store, "tensorboard", one, capsys, "--metric", "lr")
    assert rc == 0 and len(ids1) == 1
    assert load_run(ids1[0], tracking_uri=store.tracking_uri).metric_names == ["lr"]


def test_tensorboard_hostile_files(store, tb_logdir, tmp_path: Path, capsys) -> None:
    root, _, _ = tb_logdir
    src = sorted((root / "a").iterdir())[0].read_bytes()
    # a writer killed mid-record: the complete records are imported, the cut is recorded
    cut = tmp_path / "cut" / "events.out.tfevents.1.host"
    cut.parent.mkdir()
    cut.write_bytes(src[:-7])
    (_name, curves), = parse_tensorboard(cut)
    assert curves.params["import.tensorboard.truncated_files"] == "1"
    full = parse_tensorboard(sorted((root / "a").iterdir())[0])[0][1]
    def values(c):  # scalars + skipped summaries: the last event's one value is lost
        return len(c) + int(c.params["import.tensorboard.skipped_values"])
    assert values(full) - values(curves) == 1
    rc, _ids, err = _import(store, "tensorboard", cut, capsys)
    assert rc == 0 and "truncated record" in err
    before = _count_runs(store.tracking_uri)
    # a flipped byte in the middle: one-line error with the byte offset, nothing written
    bad = tmp_path / "bad" / "events.out.tfevents.2.host"
    bad.parent.mkdir()
    flipped = bytearray(src)
    flipped[len(src) // 2] ^= 0xFF
    bad.write_bytes(bytes(flipped))
    (tmp_path / "bad" / "sub").mkdir()  # a mixed directory: the good run is not written
    (tmp_path / "bad" / "sub" / "events.out.tfevents.3.host").write_bytes(src)
    rc, _, err = _import(store, "tensorboard", tmp_path / "bad", capsys)
    assert rc == 2 and str(bad) in err and "byte" in err and "CRC" in err
    assert len(err.strip().splitlines()) == 1
    # not an event file at all, and a directory without any
    junk = tmp_path / "junk" / "events.out.tfevents.4.host"
    junk.parent.mkdir()
    junk.write_text("hello, this is not a TFRecord file at all\n")
    rc, _, err = _import(store, "tensorboard", junk, capsys)
    assert rc == 2 and str(junk) in err
    (tmp_path / "empty").mkdir()
    rc, _, err = _import(store, "tensorboard", tmp_path / "empty", capsys)
    assert rc == 2 and "no TensorBoard event file" in err
    # a tag MLflow refuses as a metric name: named, with the way out
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tmp_path / "badtag"))
    w.add_scalar("acc@1", 0.5, 0)
    w.close()
    rc, _, err = _import(store, "tensorboard", tmp_path / "badtag", capsys)
    assert rc == 2 and "acc@1" in err and "--rename" in err
    rc, _, err = _import(store, "tensorboard", tmp_path / "badtag", capsys,
                         "--rename", "acc@1=eval/top1")
    assert rc == 0, err
    assert _count_runs(store.tracking_uri) == before + 1


# --- MLPerf ----------------------------------------------------------------------------------

def _write_mlperf(path: Path, gbs: int, evals: list[tuple[int, float]], *,
                  use_samples: bool = True, stop: bool = True) -> None:
    """An MLPerf Training result log written by mlperf-logging's own MLLogger."""
    from mlperf_logging.mllog import constants as c
    from mlperf_logging.mllog import mllog

    logger = logging.getLogger(f"refrun-test-mllog-{path}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.FileHandler(path)
    logger.addHandler(handler)
    ml = mllog.MLLogger(logger=logger)
    ml.event(key=c.SUBMISSION_BENCHMARK, value=c.BERT)
    ml.event(key=c.SUBMISSION_ORG, value="refrun-tests")
    ml.event(key=c.SUBMISSION_DIVISION, value=c.CLOSED)
    ml.event(key=c.GLOBAL_BATCH_SIZE, value=gbs)
    ml.event(key=c.OPT_BASE_LR, value=4e-4)
    ml.start(key=c.INIT_START)
    ml.end(key=c.INIT_STOP)
    ml.start(key=c.RUN_START)
    for samples, acc in evals:
        ml.start(key=c.BLOCK_START, metadata={c.SAMPLES_COUNT: samples})
        ml.end(key=c.BLOCK_STOP, metadata={c.SAMPLES_COUNT: samples})
        meta = {c.SAMPLES_COUNT: samples} if use_samples else {c.EPOCH_NUM: samples}
        ml.event(key=c.EVAL_ACCURACY, value=acc, metadata=meta)
    if stop:
        ml.end(key=c.RUN_STOP, metadata={c.STATUS: c.SUCCESS})
    handler.close()
    logger.removeHandler(handler)


def test_mlperf_log_from_mllog(store, tmp_path: Path, capsys) -> None:
    evals = [(3200, 0.61), (6400, 0.68), (9600, 0.72)]
    log = tmp_path / "result_0.txt"
    _write_mlperf(log, 64, evals)
    rc, ids, err = _import(store, "mlperf", log, capsys)
    assert rc == 0 and len(ids) == 1, err
    run = load_run(ids[0], tracking_uri=store.tracking_uri)
    s, v, _ = run.series("eval/accuracy")
    assert s.tolist() == [3200 // 64, 6400 // 64, 9600 // 64]
    np.testing.assert_allclose(v, [a for _, a in evals])
    s, v, _ = run.series(schema.M_PROGRESS_SAMPLES)
    assert s.tolist() == [50, 100, 150] and v.tolist() == [3200, 6400, 9600]
    assert run.tags[schema.TAG_GLOBAL_BATCH] == "64"
    p = run.params
    assert p["mlperf.submission_benchmark"] == "bert"
    assert p["mlperf.submission_org"] == "refrun-tests"
    assert p["mlperf.run_status"] == "success"
    assert float(p["mlperf.time_to_train_s"]) == pytest.approx(
        (int(p["mlperf.run_stop_ms"]) - int(p["mlperf.run_start_ms"])) / 1000, abs=1e-3)
    assert float(p["mlperf.opt_base_learning_rate"]) == 4e-4
    # each point keeps its line's time_ms
    lines = [ln for ln in log.read_text().splitlines() if '"eval_accuracy"' in ln]
    import json

    want = [json.loads(ln.split(":::MLLOG ", 1)[1])["time_ms"] for ln in lines]
    acc = run.curves[run.curves["metric"] == "eval/accuracy"]
    assert acc["timestamp_ms"].tolist() == want


def test_mlperf_aligns_with_axis_samples_across_global_batches(store, tmp_path: Path) -> None:
    """Two logs with the same evaluation schedule in samples and global batches 64 and 128:
    on the step axis their evaluations land on different steps; on the samples axis every
    evaluation aligns."""
    from refrun.importers import import_mlperf

    samples = [3200, 6400, 9600, 12800]
    ref_log, cand_log = tmp_path / "ref.txt", tmp_path / "cand.txt"
    _write_mlperf(ref_log, 64, [(s, 0.5 + s / 1e5) for s in samples])
    _write_mlperf(cand_log, 128, [(s, 0.5 + s / 1e5 + 0.001) for s in samples])
    kw = dict(workload="w", hardware="a100", tracking_uri=store.tracking_uri)
    ref = import_mlperf(ref_log, role="reference", **kw)
    cand = import_mlperf(cand_log, role="candidate", **kw)
    by_samples = compare(ref, cand, options=CompareOptions(axis="samples"),
                         tracking_uri=store.tracking_uri, progress=False)
    m = by_samples.metrics["eval/accuracy"]
    assert m.alignment.aligned_steps == len(samples)
    # every evaluation aligned, shown at the candidate's own steps (samples / 128)
    assert m.frame["step"].tolist() == [s // 128 for s in samples]
    np.testing.assert_allclose(m.frame["diff"], 0.001, atol=1e-9)
    by_step = compare(ref, cand, tracking_uri=store.tracking_uri, progress=False)
    got = by_step.metrics.get("eval/accuracy")
    assert got is None or got.alignment.aligned_steps < len(samples)


def test_mlperf_epoch_num_and_hostile_logs(store, tmp_path: Path, capsys) -> None:
    # epoch_num only: the step is the epoch; no progress/samples without train_samples
    log = tmp_path / "epochs.txt"
    _write_mlperf(log, 256, [(1, 0.3), (2, 0.5), (4, 0.7)], use_samples=False, stop=False)
    c = parse_mlperf(log)
    assert c.series("eval/accuracy") == ([1, 2, 4], [0.3, 0.5, 0.7])
    assert schema.M_PROGRESS_SAMPLES not in c.metric_names
    assert c.params["mlperf.run_status"] == "missing"
    # rank prefixes and unrelated lines around the :::MLLOG lines are ignored
    text = log.read_text()
    noisy = tmp_path / "noisy.txt"
    noisy.write_text("starting job\n" + "\n".join(f"0: {ln}" for ln in text.splitlines())
                     + "\ndone\n")
    assert parse_mlperf(noisy).series("eval/accuracy") == c.series("eval/accuracy")
    # a log cut off mid-line (killed job): complete lines kept, the cut counted
    cut = tmp_path / "cut.txt"
    cut.write_text(text + ':::MLLOG {"namespace": "", "time_ms": 17')
    assert parse_mlperf(cut).params["import.mlperf.truncated_lines"] == "1"
    before = _count_runs(store.tracking_uri)
    # a broken line in the middle: file and line named, nothing written
    lines = text.splitlines()
    lines[3] = lines[3][:-5]
    broken = tmp_path / "broken.txt"
    broken.write_text("\n".join(lines) + "\n")
    rc, _, err = _import(store, "mlperf", broken, capsys)
    assert rc == 2 and f"{broken}:4" in err and len(err.strip().splitlines()) == 1
    # not an MLPerf log; an accuracy that is not a number
    plain = tmp_path / "plain.txt"
    plain.write_text("step,loss\n1,2\n")
    rc, _, err = _import(store, "mlperf", plain, capsys)
    assert rc == 2 and "no :::MLLOG line" in err
    nan_acc = tmp_path / "str.txt"
    nan_acc.write_text(text.replace('"value": 0.5', '"value": "high"'))
    with pytest.raises(RefrunInputError, match=r"str\.txt:\d+: eval_accuracy 'high'"):
        parse_mlperf(nan_acc)
    assert _count_runs(store.tracking_uri) == before


def test_mlperf_importer_uses_only_mlperf_loggings_public_logger_package() -> None:
    """The compliance checker's parsers are versioned modules (``ruleset_610`` is absent
    from 4.1.1, the oldest release pyproject allows: ``scripts/check_mlperf_logging.py``
    imports a log written by it); refrun imports only the logger package ``mllog``."""
    import ast

    src = Path(__file__).resolve().parents[1] / "src" / "refrun"
    used = set()
    for p in src.rglob("*.py"):
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("mlperf_logging"):
                used.add(n.module)
            elif isinstance(n, ast.Import):
                used |= {a.name for a in n.names if a.name.startswith("mlperf_logging")}
    assert used == {"mlperf_logging.mllog", "mlperf_logging.mllog.mllog"}


def test_mlperf_lines_read_as_the_compliance_checker_reads_them(tmp_path: Path) -> None:
    """Every ``:::MLLOG`` line of a log with rank prefixes and noise between the lines is
    read as mlperf-logging's compliance checker reads it (its public ``parse_file``)."""
    from mlperf_logging.compliance_checker.mlp_parser import parse_file

    from refrun.importers.mlperf import _lines

    log = tmp_path / "result_0.txt"
    _write_mlperf(log, 32, [(320, 0.5), (640, 0.6)])
    prefixed = "".join(f"{k % 2}: {line}\nnot a log line\n" for k, line in
                       enumerate(log.read_text().splitlines()))
    log.write_text(prefixed)
    ours = [(d["key"], d["value"], d["metadata"], float(d["time_ms"]))
            for _, d in _lines(log, prefixed)[0]]
    loglines, errors = parse_file(str(log), ruleset="4.1.0")
    assert errors == []
    theirs = [(ll.key, ll.value["value"], ll.value["metadata"], ll.timestamp)
              for ll in loglines]
    assert ours == theirs and len(ours) >= 10

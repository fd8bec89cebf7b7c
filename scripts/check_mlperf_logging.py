"""Import an MLPerf result log written by given releases of mlperf-logging (default: the
oldest pyproject allows and the lock's), each in its own process with that release first
on the path: refrun's importer must read what each writes (docs/import-mlperf.md).

Needs a package registry (``pip download``, wheels only, no dependencies: mlperf-logging's
own dependencies are the environment's); CI has none, so the suite tests the installed
release (tests/test_importers_tensorboard_mlperf.py) and this script the others.

    .venv/bin/python scripts/check_mlperf_logging.py [VERSION ...]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ("4.1.1", "4.1.68")  # the oldest release on the index that pyproject allows; the lock's

CHECK = r"""
import json, logging, sys
import mlperf_logging
from mlperf_logging.mllog import constants as c, mllog
from refrun.importers.mlperf import parse_mlperf

path = sys.argv[1]
logger = logging.getLogger("check"); logger.propagate = False; logger.setLevel(logging.INFO)
handler = logging.FileHandler(path); logger.addHandler(handler)
ml = mllog.MLLogger(logger=logger)
ml.event(key=c.SUBMISSION_BENCHMARK, value=c.BERT)
ml.event(key=c.GLOBAL_BATCH_SIZE, value=64)
ml.start(key=c.RUN_START)
for samples, acc in ((3200, 0.61), (6400, 0.68), (9600, 0.72)):
    ml.event(key=c.EVAL_ACCURACY, value=acc, metadata={c.SAMPLES_COUNT: samples})
ml.end(key=c.RUN_STOP, metadata={c.STATUS: c.SUCCESS})
handler.close()
curves = parse_mlperf(path)
t = curves.frame
acc = t[t["metric"] == "eval/accuracy"]
print(json.dumps({"from": mlperf_logging.__file__, "steps": acc["step"].tolist(),
                  "values": acc["value"].tolist(),
                  "status": curves.params.get("mlperf.run_status")}))
"""


def check(version: str, tmp: Path) -> dict:
    where = tmp / version
    subprocess.run([sys.executable, "-m", "pip", "download", f"mlperf-logging=={version}",
                    "--no-deps", "--only-binary", ":all:", "-q", "-d", str(where)],
                   check=True)
    (wheel,) = where.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(where / "site")
    out = subprocess.run([sys.executable, "-c", CHECK, str(where / "result.txt")],
                         capture_output=True, text=True, check=False,
                         env={"PYTHONPATH": f"{where / 'site'}:{ROOT / 'src'}",
                              "PATH": "/usr/bin:/bin"})
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    bad = 0
    with tempfile.TemporaryDirectory(prefix="mlperf-logging-") as d:
        for version in argv or DEFAULT:
            got = check(version, Path(d))
            ok = got.get("steps") == [50, 100, 150] and got.get("status") == "success" \
                and str(Path(d) / version) in got.get("from", "")
            bad += not ok
            print(f"mlperf-logging {version}: {'ok' if ok else 'FAILED'} {got}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

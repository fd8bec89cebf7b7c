"""The digits pipeline's criteria files cannot go stale: each is what the current
`refrun calibrate` writes from the pipeline's reference seeds (scripts/make_criteria.py).
The --quick file is made anew in a scratch directory and compared with the committed one;
a change of calibrate that the committed criteria do not have fails here, naming the
entries.  The 600-step file (``make demo``) is made by the same script from the same
calibrate; making it too would add ~2 minutes of training to the suite, so the failure
names both commands.  The seeds' training is the session's cached store's
(tests/builds.py), the same runs tests/test_pipeline.py assesses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from builds import TrainedStore, script

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1200)  # its setup may train the cached digits runs (tests/builds.py)
def test_committed_criteria_are_what_calibrate_writes_now(
        tmp_path: Path, digits_quick: TrainedStore) -> None:
    gen = script("make_criteria")
    out = tmp_path / "criteria.toml"
    # The reference seeds come trained from the session's cached store (tests/builds.py:
    # the pipeline's reference runs of seeds 0-7, --quick); the subject here is calibrate.
    # A copy: calibrate only reads, but the cache is shared by every test.
    uri = digits_quick.copy_to(tmp_path / "refs")
    ids = [digits_quick.ids[f"reference-seed{s}"] for s in gen.SEEDS]
    made = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_criteria.py"),
                           "--out", str(out), "--quick", "--trained", uri, *ids],
                          cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    committed = gen.target(True).read_text(encoding="utf-8")
    now = out.read_text(encoding="utf-8")
    diff = gen.differences(committed, now)
    assert not diff, (f"{gen.target(True).relative_to(ROOT)} is stale: regenerate both "
                      "criteria files with `.venv/bin/python scripts/make_criteria.py --quick` "
                      "and `.venv/bin/python scripts/make_criteria.py`:\n  "
                      + "\n  ".join(diff[:20]))
    # What a stale file looks like: a criterion calibrate no longer writes, a threshold
    # from older arithmetic, another hand-made choice.  Each is named.
    crit = re.search(r'id = "host-copies-per-step"', now)
    assert crit is not None
    stale = now.replace('id = "host-copies-per-step"', 'id = "host-copies"')
    stale = re.sub(r'(id = "loss-envelope"\n(?:.*\n)*?k = )([0-9.]+)',
                   lambda m: m.group(1) + str(float(m.group(2)) * 1.1), stale, count=1)
    stale = stale.replace("--group-size 3 ", "--group-size 4 ", 1)
    found = gen.differences(stale, now)
    assert any("hand-made block" in d for d in found), found
    assert any("host-copies" in d and "host-copies-per-step" in d for d in found), found
    assert any(d.startswith("criteria[loss-envelope].k: ") for d in found), found
    # ... and numbers another CPU's kernels could move in the last digits are not.
    jitter = re.sub(r"(abs_tol = )([0-9.e-]+)",
                    lambda m: m.group(1) + repr(float(m.group(2)) * 1.001), now)
    assert jitter != now and gen.differences(jitter, now) == []

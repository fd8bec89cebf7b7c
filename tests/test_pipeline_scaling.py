"""The scaling demo (``python -m pipelines.scaling``), small: a Lightning reference and a
2-rank torchrun candidate with twice the global batch line up by samples.

It is also the suite's 2-rank torchrun job (the 4-rank one: tests/test_multiprocess_torchrun.py):
one run for the job, rank 0's own losses as its curve, rank 1's full curves as an artifact,
the straggler measure against numpy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from refrun import schema

ROOT = Path(__file__).resolve().parents[1]
STEPS, BATCH = 8, 16  # reference: 8 steps of 16; candidate: 2 ranks x 16, 4 steps


@pytest.mark.e2e
@pytest.mark.slow
def test_scaling_demo_aligns_callback_reference_and_torchrun_candidate_by_samples(
        store) -> None:
    pytest.importorskip("pytorch_lightning")
    from refrun.comparison import CompareOptions, compare, load_run
    from refrun.comparison.loading import find_run_ids

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "pipelines.scaling", "--steps", str(STEPS),
                          "--batch", str(BATCH), "--out", str(store.tmp / "cmp.json"),
                          "--candidate-losses", str(store.tmp / "losses.json")],
                         cwd=store.tmp, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "reference  recorded: 16 samples/step, samples 16..128" in out.stdout
    assert "candidate  recorded: 32 samples/step, samples 32..128" in out.stdout
    assert "2 of 2 ranks reported" in out.stdout
    doc = json.loads((store.tmp / "cmp.json").read_text())
    assert doc["options"]["axis"] == "samples"
    assert doc["candidate"]["job"]["world_size"] == 2
    (ref_id,) = find_run_ids("digits-mlp-scaling", "reference", tracking_uri=store.tracking_uri)
    (cand_id,) = find_run_ids("digits-mlp-scaling", "candidate",
                              tracking_uri=store.tracking_uri)
    assert doc["reference"][0]["run_id"] == ref_id and doc["candidate"]["run_id"] == cand_id
    client = store.client()

    def loss(run_id: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, schema.M_LOSS)}

    ref_loss, cand_loss = loss(ref_id), loss(cand_id)
    assert sorted(ref_loss) == list(range(STEPS)) and sorted(cand_loss) == list(range(STEPS // 2))
    # By hand: after candidate step s, (s + 1) * 32 samples were seen; the reference saw as
    # many after step r with (r + 1) * 16 = (s + 1) * 32, i.e. r = 2 s + 1.
    frame = compare(load_run(ref_id, progress=False), load_run(cand_id, progress=False),
                    metrics=["loss"], options=CompareOptions(axis="samples"),
                    progress=False).metrics["loss"].frame
    assert frame["samples"].tolist() == [32 * (s + 1) for s in range(STEPS // 2)]
    assert frame["step"].tolist() == list(range(STEPS // 2))
    np.testing.assert_array_equal(frame["candidate"], [cand_loss[s] for s in range(STEPS // 2)])
    np.testing.assert_array_equal(frame["reference"],
                                  [ref_loss[2 * s + 1] for s in range(STEPS // 2)])
    # The reference came through the Lightning callback: one probe step per optimizer step.
    tags = client.get_run(ref_id).data.tags
    assert tags[schema.TAG_GLOBAL_BATCH] == "16" and schema.TAG_JOB_ID not in tags
    # The candidate is a 2-rank torchrun job recorded as ONE run.
    ctags = client.get_run(cand_id).data.tags
    assert (ctags[schema.TAG_JOB_RANK], ctags[schema.TAG_JOB_WORLD_SIZE]) == ("0", "2")
    assert ctags[f"{schema.TAG_JOB_REPORTED_PREFIX}rank-1"] == "FINISHED"
    own = [json.loads((store.tmp / f"losses.json.rank{k}").read_text()) for k in range(2)]
    np.testing.assert_allclose([cand_loss[s] for s in range(STEPS // 2)], own[0], rtol=0,
                               atol=1e-7)
    from refrun.store.curves import read_curves

    root = Path(client.get_run(cand_id).info.artifact_uri.removeprefix("file://"))
    per_rank = [read_curves(root / schema.ARTIFACT_CURVES),
                read_curves(root / schema.rank_curves_artifact(1))]
    r1 = per_rank[1]
    np.testing.assert_allclose(r1[r1["metric"] == schema.M_LOSS].sort_values("step")["value"],
                               own[1], rtol=0, atol=1e-7)
    assert not np.allclose(own[0], own[1])  # each rank its own shard: it matters which
    assert r1["metric"].str.startswith("sys/").any()
    warm = int(ctags[schema.TAG_WARMUP_STEPS])
    meds = [float(np.median(c[c["metric"] == schema.M_STEP_TIME].sort_values("step")["value"]
                            .to_numpy()[warm:])) for c in per_rank]
    assert (r1["metric"] == schema.M_STEP_TIME).sum() == STEPS // 2
    assert doc["candidate"]["job"]["straggler"]["ratio"] == pytest.approx(
        max(meds) / float(np.median(meds)), rel=1e-12)

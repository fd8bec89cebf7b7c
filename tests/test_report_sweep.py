"""A sweep on one page: distinct labels from run name + differing params/tags, and the
shared pool of figure arrays that keeps the page small (lossless)."""

from __future__ import annotations

import gc
import json
import weakref

import numpy as np
import pandas as pd

from refrun.comparison import RunData, compare
from refrun.report import Candidate, PageBuilder, _figure_blocks, build_multi_report
from refrun.report import labels as L
from refrun.report.html import json_default
from refrun.util.jsonsafe import json_safe


def _text(o: object) -> str:
    """JSON text as the page holds it."""
    return json.dumps(json_safe(o), default=json_default)


def test_labels_name_plus_what_differs() -> None:
    runs = [L.Labelled("aaaa0001", "jax seed 0",
                       L.properties({"lr": "0.001", "batch": "256"},
                                    {"refrun.backend": "jax", "refrun.steps.count": "100",
                                     "team": "x"})),
            L.Labelled("aaaa0002", "jax seed 0",
                       L.properties({"lr": "0.002", "batch": "256"},
                                    {"refrun.backend": "jax", "refrun.steps.count": "99",
                                     "team": "x"})),
            L.Labelled("bbbb0003", "jax seed 0",
                       L.properties({"lr": "0.002", "batch": "256"},
                                    {"refrun.backend": "jax", "refrun.steps.count": "98"}))]
    labels = L.distinct_labels(runs)
    # lr and the user tag 'team' (missing in the third) differ; batch, backend do not; a
    # step count (bookkeeping) is never a label.
    assert labels == ["jax seed 0 · lr=0.001, team=x", "jax seed 0 · lr=0.002, team=x",
                      "jax seed 0 · lr=0.002, team=—"]
    same = [L.Labelled("cccc0001", "run", {}), L.Labelled("dddd0002", "run", {})]
    assert L.distinct_labels(same) == ["run (cccc0001)", "run (dddd0002)"]
    # The user's own params and tags come first, refrun's infrastructure tags last (issue
    # 54: the tag that told candidates apart was hidden behind "+5 more").
    two = [L.Labelled("e1", "r", L.properties({"a": "1"}, {"refrun.chips": "4"})),
           L.Labelled("e2", "r", L.properties({"a": "2"}, {"refrun.chips": "8"}))]
    assert L.distinct_labels(two) == ["r · a=1, chips=4", "r · a=2, chips=8"]
    many = [L.Labelled(f"f{i}", "candidate torch cpu seed 5", L.properties({}, {
        "refrun.backend": "torch", "refrun.chips": str(i), "refrun.exec.devices": str(i),
        "refrun.exec.world_size": str(i), "refrun.hardware": f"cpu-{i}",
        "refrun.seed": str(i), "refrun.fw.torch": f"2.{i}", "variant": f"v{i}"}))
        for i in range(2)]
    assert [lab.split(" · ")[1].split(", ")[0] for lab in L.distinct_labels(many)] == [
        "variant=v0", "variant=v1"]


def _run(rid: str, seed: int, params: dict[str, str]) -> RunData:
    rng = np.random.default_rng(seed)
    s = np.arange(3000)
    df = pd.DataFrame({"metric": "loss", "step": s,
                       "value": np.exp(-s / 500) + rng.normal(0, 0.01, len(s))})
    role = "reference" if rid.startswith("ref") else "candidate"
    return RunData.from_curves(df, rid, tags={"refrun.role": role,
                                              "mlflow.runName": "jax seed 0"},
                               params=params)


def test_pool_is_lossless_and_shares_the_references() -> None:
    refs = [_run(f"ref{i}", i, {}) for i in range(3)]
    cmps = [compare(refs, _run(f"cand{i}", 10 + i, {"lr": str(i)}), progress=False)
            for i in range(3)]
    rep = build_multi_report([Candidate(c) for c in cmps], plotlyjs="cdn")
    # Figures come candidate by candidate, the same number each (same metrics).
    assert len(rep.figures) % 3 == 0
    n = len(rep.figures) // 3
    groups = [rep.figures[i * n:(i + 1) * n] for i in range(3)]
    pool, blocks = _figure_blocks(groups)
    assert pool, "the references' curves are shared by the candidates' figures"
    # So is the departure heatmap's hover text (every bin's step range: the same for
    # every candidate of the same steps), a plain array rather than a typed one.
    assert any(not isinstance(p, dict) and str(np.ravel(json.loads(_text(p)))[0]) == "0–12"
               for p in pool)

    pooled_json = json.loads(_text(pool))  # as the page holds it

    def resolve(o):  # the page script's rule, in Python
        if isinstance(o, dict):
            if set(o) == {"pool"}:
                return pooled_json[o["pool"]]
            return {k: resolve(v) for k, v in o.items()}
        if isinstance(o, list):
            return [resolve(v) for v in o]
        return o

    for group, block in zip(groups, blocks, strict=True):
        want = json.loads(_text(group))
        assert resolve(json.loads(_text(block["figures"]))) == want
    pooled = len(_text(blocks)) + len(_text(pool))
    assert pooled < 0.8 * len(_text(groups))
    # The page holds one block per candidate and no figure in the first one.
    assert rep.html.count('id="refrun-figures-cand-') == 3
    assert '"figures":[],' in rep.html
    # `refrun report` builds the page one candidate at a time: once added, nothing of a
    # comparison (its aligned series) is kept, and the page is the same.
    builder = PageBuilder(multi=True)
    gone = [weakref.ref(c) for c in cmps]
    while cmps:
        builder.add(Candidate(cmps.pop(0)))
    gc.collect()
    assert [w() for w in gone] == [None, None, None]
    again = builder.build(plotlyjs="cdn")
    assert _text(again.matrix) == _text(rep.matrix)
    assert _text(again.figures) == _text(rep.figures)

"""Detection benchmark: does a criteria file written by ``refrun calibrate`` alone accept
every benign migration, reject every silent defect for its intended reason, and keep the
false-alarm rate low?  For the three workloads of ``pipelines/`` (digits MLP, charlm
transformer LM, markov GRU classifier; markov was added after the mechanisms were built,
and its numbers were never tuned against).

    .venv/bin/python benchmarks/bench_detection.py            # all workloads, full runs
    .venv/bin/python benchmarks/bench_detection.py --quick    # [quick] steps of each config
    .venv/bin/python benchmarks/bench_detection.py --workload charlm --held-out 20 \\
        --store /tmp/det --markdown /tmp/det/table.md
    .venv/bin/python benchmarks/bench_detection.py --quick --more-references 10 \\
        --references-from 440 --held-out-from 450     # 15 reference seeds per workload

Per workload:

1. trains the reference seeds (PyTorch), the benign candidates (another seed, JAX on 1 and
   4 devices, PyTorch/XLA, another logging cadence, another evaluation cadence, a resume
   with replayed steps, a port of a reference seed, the reference recipe at twice the
   global batch with its learning rate scaled by the optimiser's rule), the silent
   defects, the recipe changes (twice the global batch at the same learning rate: correct
   code, expected rejected, reported but not counted in the targets), and ``--held-out``
   further reference seeds recorded as candidates, one
   subprocess each, into one sqlite store (``--store``; a temporary one by default);
2. runs ``refrun calibrate --reference <the reference seeds> -o <workload>.toml``
   untouched (``--goal`` only where given, at most one per workload: ``--goal
   digits=eval/val_accuracy>=0.9``): the criteria come from the reference seeds alone,
   before any candidate is looked at;
3. assesses every candidate and every held-out seed with that file against the first
   ``group size`` reference seeds (``refrun calibrate``'s default group size, N - 1); a
   candidate whose assessment warns that it processes another amount of data per step
   (another global batch, aligned by step) is assessed again on the axis the warning
   names (``--axis samples``), as a user following it would;
4. prints a table: each benign candidate accepted or not, each defect rejected and by which
   criterion (and whether that criterion watches the metric or counter the defect was built
   to disturb: its intended reason), and the false-alarm rate over the held-out seeds with
   its exact (Clopper-Pearson) 95 % upper bound; then one summary line per workload and
   the false-alarm rate over all workloads' held-out seeds together.  A false alarm is a
   held-out seed *rejected* (a criterion failed); one left ``incomplete`` (a criterion not
   evaluable: step time on a machine that took CPU from the run, which asks for a re-run)
   is counted beside it as "not judged", and both together as "not accepted".

A defect's intended reason is written as the metric, counter or criterion kind it must
disturb (prefixes, e.g. ``loss``, ``xfer/d2h``, ``paired``), never as a criterion id:
calibration names its criteria.  For the demo's digits defects it is read from the
metrics of the criteria the digits pipeline expects them to trip
(``pipelines/digits/variants.py`` ``expect``).

Exit code 0 when every benign candidate was accepted, every defect rejected for its
intended reason and the false-alarm rate over all workloads' held-out seeds together was
at most 5 %; 1 otherwise.  Training dominates the time (about 60 training processes plus
the held-out seeds, trained ten to a process; ``--jobs`` at a time: 19 min with the
default 1 on a 2-core machine, 14-15 min with 2, at the price of an uneven load).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `pipelines` is a directory of the clone, not a package
    sys.path.insert(0, str(REPO))

from pipelines.charlm import variants as charlm  # noqa: E402
from pipelines.digits import variants as digits  # noqa: E402
from pipelines.markov import variants as markov  # noqa: E402

TARGET_FALSE_ALARM = 0.05
MIN_HELD_OUT = 60
"""Held-out seeds over all workloads the false-alarm target needs (issue 52)."""
# Kinds of candidate expected to be rejected, each for its intended reason (``expect``).
EXPECTED_REJECTED = ("defect", "recipe")


@dataclass(frozen=True)
class Workload:
    """One workload's runs and each defect's intended reason."""

    name: str                 # the experiment = config's workload name
    references: list[digits.Variant]
    candidates: list[digits.Variant]
    held_out: list[digits.Variant]
    intent: dict[str, tuple[str, ...]]  # defect variant -> metric/counter/kind prefixes
    # The pipeline records a parity gradient check for every candidate (``gradcheck``
    # module of the workload) and the file requires it (calibrate --require-gradcheck).
    gradcheck: str | None = None
    # Known-good same-seed pair evidence (refrun.pairing): trained before calibration, read
    # by ``refrun calibrate`` for the ``paired`` tolerance, never assessed.
    evidence: list[digits.Variant] = field(default_factory=list)

    @property
    def all(self) -> list[digits.Variant]:  # what pipelines.demo.train_all trains
        return [*self.references, *self.evidence, *self.candidates, *self.held_out]


@dataclass
class Outcome:
    """One candidate's assessment as the table shows it."""

    variant: digits.Variant
    verdict: str
    highest_level: str
    failing: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list)
    # (criterion id, reason, what it watches: its metrics or its kind)
    not_evaluable: list[str] = field(default_factory=list)

    @property
    def accepted(self) -> bool:
        return not self.failing and self.verdict == "pass"

    def caught_by(self, intent: Sequence[str]) -> list[str]:
        """Failing criteria that watch one of the ``intent`` prefixes (a metric, counter or
        the criterion's kind)."""
        return [cid for cid, _, watched in self.failing
                if any(w.startswith(p) for w in watched for p in intent)]


@dataclass
class Result:
    workload: Workload
    criteria: Path
    candidates: list[Outcome]
    held_out: list[Outcome]
    seconds: float
    load: tuple[float, float] = (0.0, 0.0)  # 1-min load average at the start and the end
    calibration_error: str | None = None    # refrun calibrate's message when it wrote none

    def tally(self, kind: str | None = None) -> tuple[int, int, int, int]:
        """(benign accepted, benign, defects rejected for their intended reason, defects);
        ``kind="recipe"``: the recipe changes in place of the defects."""
        benign = [o for o in self.candidates if o.variant.kind == "benign"]
        defects = [o for o in self.candidates if o.variant.kind == (kind or "defect")]
        return (sum(self.as_intended(o) for o in benign), len(benign),
                sum(self.as_intended(o) for o in defects), len(defects))

    def as_intended(self, o: Outcome) -> bool:
        if o.variant.kind in EXPECTED_REJECTED:
            return bool(o.caught_by(self.workload.intent[o.variant.name]))
        return o.accepted

    @property
    def targeted(self) -> list[Outcome]:
        """The candidates the targets count: benign ones and defects.  A recipe change
        (correct code, another recipe: twice the batch at the same learning rate) is
        reported, not targeted: whether it shows beyond the seeds' spread is a property of
        the workload, not of the tool (issue 52)."""
        return [o for o in self.candidates if o.variant.kind != "recipe"]

    @property
    def false_alarms(self) -> int:
        """Held-out seeds (identical code) rejected: a criterion failed."""
        return sum(bool(o.failing) for o in self.held_out)

    @property
    def not_judged(self) -> int:
        """Held-out seeds neither accepted nor rejected (verdict ``incomplete``: a criterion
        not evaluable, e.g. step time on a machine that took CPU from the run)."""
        return sum(not o.accepted and not o.failing for o in self.held_out)

    @property
    def ok(self) -> bool:
        n = len(self.held_out)
        return all(self.as_intended(o) for o in self.targeted) and n > 0 and \
            self.false_alarms / n <= TARGET_FALSE_ALARM


# --- the workloads -------------------------------------------------------------------------
def digits_workload(held_out: int, first: int | None = None) -> Workload:
    """The digits MLP: 5 reference seeds (0-2 and 10-11, so the benign ``torch-seed3`` stays
    unseen), its benign and defect variants, held-out seeds 100 (or ``first``) and up."""
    from refrun.acceptance.criteria import load_criteria

    refs = digits.reference_variants((0, 1, 2, 10, 11))
    # What each hand-file criterion watches: its metrics (its kind only when it has none,
    # e.g. ``fallback``), so that "intended" never means "any criterion of that kind".
    hand = {c.id: tuple(c.used_metrics()) or (c.KIND,)
            for c in load_criteria(REPO / "pipelines/criteria/digits.toml").criteria}
    defects = [*digits.DEFECTS, *digits.DETECTION_DEFECTS]
    # The demo's defects name hand-file criterion ids (their metrics are the intent); the
    # benchmark's own name metric/counter/kind prefixes directly.
    intent = {v.name: tuple(w for cid in v.expect for w in hand.get(cid, (cid,)))
              for v in defects}
    held = [digits.Variant(f"digits-heldout-seed{s}", "torch", s,
                           mirrors="a held-out seed of the reference code")
            for s in range(first or 100, (first or 100) + held_out)]
    return Workload("digits-mlp", refs,
                    [*digits.BENIGN, *digits.DETECTION_BENIGN, *defects], held, intent,
                    evidence=list(digits.DETECTION_EVIDENCE))


def charlm_workload(held_out: int, first: int | None = None) -> Workload:
    p = charlm.plan(held_out, first)
    return Workload("charlm", p.references, p.candidates, p.held_out,
                    {v.name: v.expect for v in charlm.DEFECTS},
                    gradcheck="pipelines.charlm.gradcheck", evidence=list(charlm.EVIDENCE))


def markov_workload(held_out: int, first: int | None = None) -> Workload:
    """The GRU classifier added for issue 21: nothing in refrun was tuned on it."""
    p = markov.plan(held_out, first)
    return Workload("markov-gru", p.references, p.candidates, p.held_out,
                    {v.name: v.expect for v in markov.DEFECTS},
                    gradcheck="pipelines.markov.gradcheck", evidence=list(markov.EVIDENCE))


WORKLOADS = {"digits": digits_workload, "charlm": charlm_workload, "markov": markov_workload}
REFERENCES = {"digits": digits.reference_variants, "charlm": charlm.reference_variants,
              "markov": markov.reference_variants}


def with_more_references(w: Workload, name: str, seeds: Sequence[int]) -> Workload:
    """``w`` calibrated from further reference seeds (``--more-references``): a team with
    more seeds than the plan's five (run-level quantile criteria need ten)."""
    taken = {v.seed for v in [*w.references, *w.candidates, *w.held_out]}
    clash = sorted(taken & set(seeds))
    if clash:
        raise SystemExit(f"--references-from: seed(s) {clash} are already {name}'s runs")
    return replace(w, references=[*w.references, *REFERENCES[name](tuple(seeds))])


def _watched(criterion: object) -> tuple[str, ...]:
    """What a criterion watches: its metrics, then its kind (``fallback``, ``paired``)."""
    used = criterion.used_metrics()  # type: ignore[attr-defined]
    return (*used, criterion.KIND)  # type: ignore[attr-defined]


# --- steps -------------------------------------------------------------------------------
def calibrate(ref_ids: list[str], uri: str, out: Path, gradcheck: bool = False,
              goal: str | None = None) -> str | None:
    """``refrun calibrate --reference ... -o out`` (``--require-gradcheck`` for a workload
    whose pipeline records gradient checks; ``--goal`` when one is given): the one source
    of the criteria.  Returns None, or the one-line reason it wrote no file."""
    cmd = [sys.executable, "-m", "refrun", "calibrate", "--reference", *ref_ids,
           "--tracking-uri", uri, "-o", str(out)] + (["--require-gradcheck"] if gradcheck
                                                       else []) + \
        (["--goal", goal] if goal else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        return f"exit {proc.returncode}: " + (lines[-1] if lines else "no message")
    return None


def assess_one(crit_path: Path, ref_ids: list[str], v: digits.Variant, run_id: str,
               uri: str) -> Outcome:
    from refrun.acceptance.assess import assess_ids
    from refrun.acceptance.criteria import load_criteria

    crit = load_criteria(crit_path)
    watched = {c.id: _watched(c) for c in crit.criteria}
    a, _ = assess_ids(crit, ref_ids, run_id, uri)
    # A candidate processing another amount of data per step is compared as the user
    # would after accept's one-line hint: again, on the axis it names (issue 52).
    axis = next((ax for w in a.warnings for ax in ("samples", "tokens")
                 if f"--axis {ax} compares" in w), None)
    if axis is not None:
        from refrun.acceptance.alignment import with_axis

        a, _ = assess_ids(with_axis(crit, axis), ref_ids, run_id, uri)
    failing = [(r.id, r.reason, watched.get(r.id, (r.kind,)))
               for r in a.results if r.outcome == "fail"]
    return Outcome(v, a.verdict, a.highest_level or "none", failing,
                   [r.id for r in a.results if r.outcome == "not_evaluable"])


def group_size(crit_path: Path, n_refs: int) -> int:
    """The group size the file was calibrated for (``[calibration] group_size``), else N-1."""
    import tomllib

    table = tomllib.loads(crit_path.read_text(encoding="utf-8")).get("calibration", {})
    return int(table.get("group_size", n_refs - 1))


def run_workload(w: Workload, *, quick: bool, store: Path, jobs: int,
                 assess_only: bool, reuse: bool = False, partial: bool = False,
                 goal: str | None = None, retrain: frozenset[str] = frozenset()) -> Result:
    from pipelines.demo import init_store, train_all

    t0 = time.perf_counter()
    uri = f"sqlite:///{store / (w.name + '.db')}"
    init_store(uri, w.name)
    # Without --reuse / --assess-only every variant is trained anew (a store's earlier runs
    # are not looked at); --assess-only needs every run unless --partial.
    ids = ids_from_store(w, uri, missing_ok=reuse or partial) if (reuse or assess_only) \
        else {}
    load0 = os.getloadavg()[0]
    if partial:  # judge what was trained; the table says what is missing
        w = replace(w, candidates=[v for v in w.candidates if v.name in ids],
                    held_out=[v for v in w.held_out if v.name in ids])
    if not assess_only:
        todo = replace(w, **{k: [v for v in getattr(w, k) if v.name not in ids
                                 or v.backend in retrain]
                             for k in ("references", "evidence", "candidates", "held_out")})
        # Held-out seeds are plain reference-code runs: trained a batch per process (one
        # interpreter start-up and one framework import for many runs).
        held = todo.held_out
        todo = replace(todo, held_out=[])
        ids |= train_all(todo, quick=quick, uri=uri,  # type: ignore[arg-type]
                         spool_dir=str(store / "spool"), jobs=jobs)
        ids |= train_batches(held, quick=quick, uri=uri, spool_dir=str(store / "spool"),
                             jobs=jobs)
    if w.gradcheck:
        record_gradchecks(w, ids, uri, quick=quick, spool_dir=str(store / "spool"))
    ref_ids = [ids[v.name] for v in w.references]
    crit_path = store / f"{w.name}.toml"
    crit_path.unlink(missing_ok=True)  # never judge with an earlier run's file
    error = calibrate(ref_ids, uri, crit_path, gradcheck=bool(w.gradcheck), goal=goal)
    if error is not None:  # no criteria file: nothing can be accepted; the table says why
        print(f"[{w.name}] refrun calibrate wrote no criteria: {error}", flush=True)
        none = [Outcome(v, "no criteria", "none", [("calibrate", error, ())])
                for v in [*w.candidates, *w.held_out]]
        return Result(w, crit_path, none[: len(w.candidates)], none[len(w.candidates):],
                      time.perf_counter() - t0, (load0, os.getloadavg()[0]), error)
    group = ref_ids[: group_size(crit_path, len(ref_ids))]
    print(f"[{w.name}] calibrated {crit_path} from {len(ref_ids)} reference seeds; "
          f"assessing against {len(group)} of them", flush=True)
    cands = [assess_one(crit_path, group, v, ids[v.name], uri) for v in w.candidates]
    held = [assess_one(crit_path, group, v, ids[v.name], uri) for v in w.held_out]
    return Result(w, crit_path, cands, held, time.perf_counter() - t0,
                  (load0, os.getloadavg()[0]))


_GRADCHECK = ("import json, sys\nfrom importlib import import_module\n"
              "main = import_module(sys.argv[1]).main\n"
              "for argv in json.loads(sys.argv[2]):\n    assert main(argv) == 0\n")


def record_gradchecks(w: Workload, ids: dict[str, str], uri: str, *, quick: bool,
                      spool_dir: str) -> None:
    """The pipeline's gradient check for every candidate and held-out seed that has a run
    but no gradcheck run recorded for it yet (one process per backend: the checks are one
    batch each, so a store trained before the checks existed is completed, not re-trained)."""
    from mlflow.tracking import MlflowClient

    from refrun import schema

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(w.name)
    done = {r.data.tags.get(schema.TAG_GRADCHECK_CANDIDATE) for r in client.search_runs(
        [exp.experiment_id], f"tags.`{schema.TAG_ROLE}` = 'gradcheck'", max_results=5000)}
    todo = [v for v in [*w.candidates, *w.held_out] if v.name in ids and ids[v.name] not in done]
    # One process per backend and device count: JAX's host device count is fixed when
    # JAX starts, and a check that runs the port's own step needs the candidate's.
    for backend, devices in sorted({(v.backend, max(v.devices, 1)) for v in todo}):
        group = [v for v in todo if (v.backend, max(v.devices, 1)) == (backend, devices)]
        argvs = [["--backend", v.backend, "--seed", str(v.seed), "--candidate", ids[v.name],
                  "--devices", str(devices), "--tracking-uri", uri, "--spool-dir", spool_dir,
                  *[a for d in v.defects for a in ("--defect", d)],
                  *(["--quick"] if quick else [])] for v in group]
        env = group[0].environment()
        env["REFRUN_DELIVERY"] = "thread"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _GRADCHECK, w.gradcheck, json.dumps(argvs)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"gradient checks ({backend} x{devices}) failed "
                               f"(exit {proc.returncode}):\n"
                               f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        print(f"< {len(group)} {backend} x{devices} gradient checks: "
              f"{time.perf_counter() - t0:.0f} s",
              flush=True)


_BATCH = ("import json, sys\nfrom importlib import import_module\n"
          "main = import_module(sys.argv[1]).main\n"
          "for argv in json.loads(sys.argv[2]):\n    assert main(argv) == 0\n")


def train_batches(variants: list[digits.Variant], *, quick: bool, uri: str,
                  spool_dir: str, jobs: int) -> dict[str, str]:
    """Train same-port, same-environment variants ``jobs`` processes at a time, each
    process running its share one after the other in-process (``main(argv)`` of the port;
    recording delivered by a thread of that process).  Returns variant name -> run id."""
    from concurrent.futures import ThreadPoolExecutor

    if not variants:
        return {}
    chunks = [variants[i::jobs] for i in range(jobs) if variants[i::jobs]]

    def run(chunk: list[digits.Variant]) -> dict[str, str]:
        argvs = [v.command(quick=quick, tracking_uri=uri, spool_dir=spool_dir)[3:]
                 for v in chunk]
        env = chunk[0].environment()
        env["REFRUN_DELIVERY"] = "thread"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _BATCH, chunk[0].module(),
                               json.dumps(argvs)], env=env, capture_output=True, text=True)
        found = dict(re.findall(r"^\[(\S+)\] run ([0-9a-f]{32}) ", proc.stdout, re.M))
        missing = [v.name for v in chunk if v.name not in found]
        if proc.returncode != 0 or missing:
            raise RuntimeError(f"batch {missing} failed (exit {proc.returncode}):\n"
                               f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        print(f"< {len(chunk)} held-out runs in one process: "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        return found

    out: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for got in pool.map(run, chunks):
            out |= got
    return out


def ids_from_store(w: Workload, uri: str, missing_ok: bool = False) -> dict[str, str]:
    """The newest finished run of each variant (tag ``pipeline.variant``); with
    ``missing_ok`` the variants found (none when the store is new)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(w.name)
    if exp is None:
        if missing_ok:
            return {}
        raise SystemExit(f"{uri}: no experiment {w.name}; run without --assess-only")
    ids = {}
    for v in w.all:
        runs = client.search_runs([exp.experiment_id],
                                  f"tags.`pipeline.variant` = '{v.name}' and "
                                  "attributes.status = 'FINISHED'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
        if runs:
            ids[v.name] = runs[0].info.run_id
        elif not missing_ok:
            raise SystemExit(f"{uri}: no finished run of variant {v.name}")
    return ids


# --- output ------------------------------------------------------------------------------
def upper_bound(k: int, n: int, confidence: float = 0.95) -> float:
    """Exact one-sided Clopper-Pearson upper bound of a rate seen k times in n trials:
    the ``confidence`` quantile of Beta(k + 1, n - k) (1 when k = n)."""
    from scipy.stats import beta

    return 1.0 if k >= n else float(beta.ppf(confidence, k + 1, n - k))


def _by(o: Outcome, intended: list[str]) -> str:
    """A defect's catching criteria: the intended ones first, then ``also:`` the others."""
    others = [cid for cid, _, _ in o.failing if cid not in intended]
    parts = [", ".join(intended)] if intended else []
    if others:
        parts.append(("also: " if intended else "") + ", ".join(others))
    return "; ".join(parts) or "-"


def table(r: Result, markdown: bool = False) -> str:
    """Candidates (benign: accepted?; defect: caught by which criterion, intended?) and the
    false-alarm line."""
    rows = []
    for o in r.candidates:
        v = o.variant
        if v.kind in EXPECTED_REJECTED:
            intended = o.caught_by(r.workload.intent[v.name])
            outcome = "rejected" if o.failing else "ACCEPTED"
            by = _by(o, intended) + f" [intended: {', '.join(r.workload.intent[v.name])}]"
            why = "yes" if intended else "NO"
        else:
            outcome = "accepted" if o.accepted else "REJECTED"
            by = ", ".join(f"{cid} ({reason})" for cid, reason, _ in o.failing) or \
                (f"verdict {o.verdict}; not evaluable: {', '.join(o.not_evaluable)}"
                 if o.not_evaluable else "-" if o.accepted else f"verdict {o.verdict}")
            why = "yes" if o.accepted else "NO"
        rows.append((v.name, v.kind, v.backend + (f" x{v.devices}" if v.devices > 1 else ""),
                     outcome, why, by))
    n, k = len(r.held_out), r.false_alarms
    fa = (f"false alarms: {k}/{n} held-out seeds rejected ({k / max(n, 1):.1%}; exact 95 % "
          f"upper bound {upper_bound(k, n):.1%}); target <= {TARGET_FALSE_ALARM:.0%}; "
          f"not judged (incomplete): {r.not_judged}/{n}")
    alarms = [f"{o.variant.name}: " + ("; ".join(f"{cid} ({reason})" for cid, reason, _ in
                                                 o.failing) or
                                       f"verdict {o.verdict} (not judged: "
                                       f"{', '.join(o.not_evaluable) or '-'})")
              for o in r.held_out if not o.accepted]
    if r.calibration_error:
        alarms = [f"every held-out seed: refrun calibrate wrote no criteria "
                  f"({r.calibration_error})"]
    head = ("candidate", "kind", "port", "outcome", "as intended", "criterion (caught by / why)")
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]
        lines += ["", f"{fa}."] + [f"- {a}" for a in alarms]
        return "\n".join(lines)
    lines = [f"{head[0]:<34} {head[1]:<7} {head[2]:<12} {head[3]:<9} {head[4]:<11} {head[5]}",
             "-" * 120]
    lines += [f"{a:<34} {b:<7} {c:<12} {d:<9} {e:<11} {f}" for a, b, c, d, e, f in rows]
    lines += ["", fa] + [f"  {a}" for a in alarms]
    return "\n".join(lines)


def summary(results: list[Result], markdown: bool = False) -> str:
    """One line per workload (benign accepted, defects caught for their intended reason,
    false alarms with the 95 % upper bound, wall time, load) and the false-alarm rate over
    every workload's held-out seeds together."""
    head = ("workload", "benign accepted", "defects rejected for the intended reason",
            "recipe changes rejected (not targeted)", "false alarms (held-out seeds)",
            "95 % upper bound", "not judged", "wall", "load 1 min")
    rows = []
    for r in results:
        ba, b, da, d = r.tally()
        _, _, ra, rn = r.tally("recipe")
        n, k = len(r.held_out), r.false_alarms
        rows.append((r.workload.name, f"{ba}/{b}", f"{da}/{d}", f"{ra}/{rn}", f"{k}/{n}",
                     f"{upper_bound(k, n):.1%}", f"{r.not_judged}/{n}", f"{r.seconds:.0f} s",
                     f"{r.load[0]:.1f} -> {r.load[1]:.1f}"))
    n = sum(len(r.held_out) for r in results)
    k = sum(r.false_alarms for r in results)
    u = sum(r.not_judged for r in results)
    total = (f"all workloads: {k}/{n} held-out seeds rejected ({k / max(n, 1):.1%}; exact 95 % "
             f"upper bound {upper_bound(k, n):.1%}); target <= {TARGET_FALSE_ALARM:.0%}; "
             f"{u}/{n} not judged (incomplete), {k + u}/{n} not accepted")
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join([*lines, "", total + "."])
    lines = [" | ".join(head)] + [" | ".join(row) for row in rows]
    return "\n".join([*lines, total])


def parse_goals(goals: list[str], names: list[str]) -> dict[str, str]:
    """``WORKLOAD=METRIC>=VALUE`` flags -> {workload key: goal}; at most one per workload."""
    out: dict[str, str] = {}
    for g in goals:
        key, sep, goal = g.partition("=")
        if not sep or key not in WORKLOADS or not goal:
            raise SystemExit(f"--goal {g!r}: expected WORKLOAD=METRIC>=VALUE with WORKLOAD "
                             f"one of {', '.join(WORKLOADS)}")
        if key in out:
            raise SystemExit(f"--goal: a second goal for {key} (at most one per workload)")
        if key in names:
            out[key] = goal
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all")
    ap.add_argument("--quick", action="store_true", help="the [quick] steps of each config")
    ap.add_argument("--held-out", type=int, default=20,
                    help="further reference seeds per workload assessed as candidates "
                         "(false-alarm trials)")
    ap.add_argument("--held-out-from", type=int, default=None, metavar="SEED",
                    help="first held-out seed (default: each workload's own, 100): seeds "
                         "nobody has looked at, to re-measure after a change of calibration")
    ap.add_argument("--more-references", type=int, default=0, metavar="K",
                    help="K further reference seeds per workload (from --references-from), "
                         "calibrated with the plan's own")
    ap.add_argument("--references-from", type=int, default=None, metavar="SEED",
                    help="first of the --more-references seeds (never a held-out seed)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="training processes at a time (default 1: references and candidates "
                    "each recorded alone, on the same idle machine; more on a machine of few "
                    "cores make the load a recording meets depend on how the jobs fall, and "
                    "the references' contention rule then leaves some passes not judged)")
    ap.add_argument("--goal", action="append", default=[], metavar="WORKLOAD=GOAL",
                    help="refrun calibrate --goal GOAL for that workload (at most one each; "
                         "e.g. markov=eval/val_accuracy>=0.4)")
    ap.add_argument("--store", default=None,
                    help="directory of the sqlite stores and criteria files (default: temporary)")
    ap.add_argument("--assess-only", action="store_true",
                    help="train nothing: calibrate and assess the runs already in --store")
    ap.add_argument("--reuse", action="store_true",
                    help="train only the variants --store has no finished run of")
    ap.add_argument("--retrain", action="append", default=[], metavar="BACKEND",
                    choices=("torch", "jax", "torch_xla"),
                    help="with --reuse: train this backend's variants anew (their recording "
                         "changed), reuse the others' runs")
    ap.add_argument("--partial", action="store_true",
                    help="with --assess-only: judge the candidates and held-out seeds that "
                         "have a run, leave out the others (the counts say how many)")
    ap.add_argument("--markdown", default=None, help="also write the tables as Markdown here")
    args = ap.parse_args(argv)
    if args.more_references and args.references_from is None:
        ap.error("--more-references needs --references-from")
    if (args.assess_only or args.reuse) and not args.store:
        ap.error("--assess-only and --reuse need --store")
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    goals = parse_goals(args.goal, names)
    tmp = None if args.store else tempfile.TemporaryDirectory(prefix="refrun-detect-")
    store = Path(args.store or tmp.name).absolute()  # type: ignore[union-attr]
    store.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        w = WORKLOADS[name](args.held_out, args.held_out_from)
        if args.more_references:
            first = args.references_from
            w = with_more_references(w, name, range(first, first + args.more_references))
        print(f"== {w.name}: {len(w.references)} reference seeds, {len(w.candidates)} "
              f"candidates, {len(w.held_out)} held-out seeds ({'quick' if args.quick else 'full'})"
              f"; load {os.getloadavg()[0]:.1f}", flush=True)
        results.append(run_workload(w, quick=args.quick, store=store, jobs=args.jobs,
                                    assess_only=args.assess_only, reuse=args.reuse,
                                    partial=args.partial, goal=goals.get(name),
                                    retrain=frozenset(args.retrain)))
    md = []
    for r in results:
        print(f"\n== {r.workload.name} ({r.seconds:.0f} s; criteria: {r.criteria})")
        print(table(r))
        md += [f"#### {r.workload.name}", "", table(r, markdown=True), ""]
    print("\n== summary")
    print(summary(results))
    md += ["#### summary", "", summary(results, markdown=True), ""]
    if args.markdown:
        Path(args.markdown).write_text("\n".join(md), encoding="utf-8")
    n = sum(len(r.held_out) for r in results)
    # Over all workloads the target is issue 52's: at least 60 held-out seeds and the
    # exact one-sided 95 % upper bound of the false-alarm rate <= 5 % (a point rate under
    # 5 % on a few seeds shows nothing; decided 2026-12-06 before the run it applies to).
    # Per workload (20-32 seeds each) the tables keep the point rate.
    k = sum(r.false_alarms for r in results)
    rate_ok = n >= MIN_HELD_OUT and upper_bound(k, n) <= TARGET_FALSE_ALARM
    missed = [r.workload.name for r in results
              if not all(r.as_intended(o) for o in r.targeted)]
    ok = not missed and rate_ok
    print(f"\ntarget met for {', '.join(r.workload.name for r in results)}" if ok
          else f"\nTARGET NOT MET: {', '.join(missed) or 'no workload'} missed a candidate; "
               f"false-alarm bound {'met' if rate_ok else 'NOT met'} ({k}/{n}, upper "
               f"bound {upper_bound(k, n) if n else float('nan'):.1%}, at least "
               f"{MIN_HELD_OUT} seeds)")
    if tmp is not None:
        tmp.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

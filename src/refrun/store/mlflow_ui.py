"""How refrun's experiments and runs present themselves in the MLflow UI.

MLflow 3.17 chooses an experiment page's mode from the experiment tag
``mlflow.experimentKind``: ``genai_development`` opens a traces/evaluations overview (where
refrun's runs look like "evaluations" and no runs table is shown), the model-training
kinds (``custom_model_development``, ``finetuning``, ``regression`` ...) open the runs
table with its charts.  Without the tag, the UI guesses, and guesses GenAI for an
experiment with no model-training signal it recognises.  refrun therefore marks the
experiments it creates or records into as ``custom_model_development`` -- only when the
tag is missing or empty, so a kind someone chose is never overridden.

Runs get names and descriptions (MLflow's ``mlflow.note.content`` tag, shown as Markdown on
the run page) that say what they are without opening the tags:

* a training run without a user-given name: ``<role> <backend> <hardware>[ xN] seed S``
  (e.g. ``reference torch cpu seed 0``, ``candidate jax cpu x4 seed 0``);
* a comparison run: ``<kind> <candidate run name> vs N refs[: <outcome>]`` (e.g.
  ``accept jax-sum-loss vs 3 refs: fail``), its description the verdict with the failing
  criteria and links to the candidate, the references, a chart of the candidate against
  its references (the experiment's chart view filtered to those runs) and the report.

MLflow 3.17.2 itself has a sidebar switch "GenAI | Model training" that, while it is
shown, decides the page mode for every experiment (remembered per browser; the URL
parameter ``workflowType=machine_learning`` selects it too); the experiment kind is what
the UI reads where that switch is absent.  Both are documented in docs/report.md.

Saved views (MLflow 3.17's "Views" menu, stored as experiment tags
``mlflow.sharedViewState.<id>``) make identity visible without hunting for columns:

* ``refrun: runs by role`` on every experiment refrun records into: the runs grouped by
  role, with role, backend, hardware, chips, seed, verdict and highest level as columns;
* one per comparison (id from its runs): only the candidate and its references, grouped by
  role, so the chart view draws the references as one band against the candidate.  At
  most :data:`MAX_REFRUN_VIEWS` are written per experiment (the UI refuses new views at 40
  and people need room for theirs); beyond that the description links to the same runs
  through a URL filter instead.

The pure functions build names, texts and view states; :func:`prepare_experiment`,
:func:`comparison_ui_tags` and :func:`describe_comparison` talk to a tracking store.
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # annotations only: the recording path imports this module, MLflow-free
    from refrun.store.surface import StoreClient

from refrun import limits, schema

ComparisonKind = Literal["accept", "compare"]

# The identity columns a saved view shows (tags), in this order.
VIEW_COLUMNS = (schema.TAG_ROLE, schema.TAG_BACKEND, schema.TAG_HARDWARE, schema.TAG_CHIPS,
                schema.TAG_SEED, schema.TAG_ACCEPTANCE_VERDICT, schema.TAG_ACCEPTANCE_HIGHEST)
OVERVIEW_VIEW_ID = "refrun-runs"
OVERVIEW_VIEW_NAME = "refrun: runs by role"
_RUN_NAME_COLUMN = "attributes.`Run Name`"  # the runs table's column ids (ag-grid colId)
MAX_REFRUN_VIEWS = 30  # of the 40 saved views MLflow's UI allows per experiment


@dataclass(frozen=True)
class Verdict:
    """What an assessment concluded, as a comparison run's name and description show it."""

    verdict: str  # pass | fail | incomplete
    highest_level: str | None
    failing: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # (criterion id, reason)
    not_evaluable: tuple[str, ...] = field(default_factory=tuple)


def needs_kind(experiment_tags: Mapping[str, str]) -> bool:
    """True when the experiment has no kind yet (tag missing or empty); a kind somebody
    set -- any non-empty value, GenAI included -- is left alone."""
    return not (experiment_tags.get(schema.TAG_EXPERIMENT_KIND) or "").strip()


def view_state(search_filter: str = "") -> dict[str, object]:
    """A runs-page state for a saved view: ``search_filter`` applied, runs grouped by
    ``refrun.role`` (in charts: one line per group, the references aggregated), the
    identity columns shown, every run drawn in charts.  Keys are MLflow 3.17's
    (``searchFilter`` ... facets and ``selectedColumns`` ... UI state)."""
    columns = [f"tags.`{t}`" for t in VIEW_COLUMNS]
    return {
        "searchFilter": search_filter, "orderByKey": "attributes.start_time",
        "orderByAsc": False, "startTime": "ALL", "lifecycleFilter": "Active",
        "modelVersionFilter": "All Runs", "datasetsFilter": [],
        "selectedColumns": columns,
        # the run name first and wide enough for "accept <candidate> vs N refs: fail"
        "columnOrder": [_RUN_NAME_COLUMN, "runDateAndNestInfo", "duration", *columns],
        "columnWidths": {_RUN_NAME_COLUMN: 340, **{c: 110 for c in columns}},
        "runsHiddenMode": "SHOW_ALL", "useGroupedValuesInCharts": True,
        "groupBy": {"aggregateFunction": "average",
                    "groupByKeys": [{"mode": "tag", "groupByData": schema.TAG_ROLE}]},
    }


def saved_view_value(name: str, state: Mapping[str, object], now_ms: int) -> str:
    """The experiment tag value of a saved view (MLflow's envelope: name, createdAt,
    updatedAt in ms since the epoch, and the state as JSON text)."""
    return json.dumps({"name": name, "createdAt": now_ms, "updatedAt": now_ms,
                       "state": json.dumps(state, separators=(",", ":"))},
                      separators=(",", ":"))


def view_link(experiment_id: str, view_id: str, chart: bool = False) -> str:
    """The runs page of ``experiment_id`` opened on saved view ``view_id`` (in the chart
    view when ``chart``)."""
    return (f"#/experiments/{experiment_id}/runs?viewStateShareKey={view_id}"
            + ("&compareRunsMode=CHART" if chart else ""))


def runs_filter(run_ids: Sequence[str]) -> str:
    """MLflow search filter for exactly ``run_ids``."""
    return "attributes.run_id IN (" + ", ".join(f"'{r}'" for r in run_ids) + ")"


def comparison_view_id(reference_ids: Sequence[str], candidate_id: str) -> str:
    """A saved view's id for a candidate and its references (the same runs, the same view,
    however often they are compared)."""
    key = ",".join(sorted(reference_ids)) + "|" + candidate_id
    return "refrun-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _refrun_views(tags: Mapping[str, str]) -> list[str]:
    return [k for k in tags if k.startswith(schema.TAG_SAVED_VIEW_PREFIX + "refrun-")]


def _ensure_view(client: StoreClient, experiment_id: str, tags: Mapping[str, str],
                 view_id: str, name: str, state: Mapping[str, object]) -> bool:
    """Write saved view ``view_id`` unless present; False when it cannot be (too many
    refrun views already, or too long for a tag)."""
    key = schema.TAG_SAVED_VIEW_PREFIX + view_id
    if key in tags:
        return True
    value = saved_view_value(name, state, int(time.time() * 1000))
    if (len(_refrun_views(tags)) >= MAX_REFRUN_VIEWS
            or len(value) > limits.EXPERIMENT_TAG_VALUE_LENGTH):
        return False
    client.set_experiment_tag(experiment_id, key, value)
    return True


def prepare_experiment(client: StoreClient, experiment_id: str) -> None:
    """Make experiment ``experiment_id`` open as a model-training experiment
    (``mlflow.experimentKind = custom_model_development``, unless it has a kind) with the
    saved view ``refrun: runs by role`` (unless present).

    A store error is left to the caller (the delivery step retries; a comparison's
    recording reports it).
    """
    tags = client.get_experiment(experiment_id).tags or {}
    if needs_kind(tags):
        client.set_experiment_tag(experiment_id, schema.TAG_EXPERIMENT_KIND,
                                  schema.EXPERIMENT_KIND_TRAINING)
    _ensure_view(client, experiment_id, tags, OVERVIEW_VIEW_ID, OVERVIEW_VIEW_NAME,
                 view_state())


def default_run_name(tags: Mapping[str, str]) -> str:
    """A readable run name from a run's identity tags:
    ``<role> <backend> <hardware>[ xCHIPS][ seed S][ (import FILE)]``.

    e.g. ``reference torch cpu seed 0``; chips are shown when more than one.
    """
    parts = [tags.get(schema.TAG_ROLE, "run")]
    parts += [tags[k] for k in (schema.TAG_BACKEND, schema.TAG_HARDWARE) if tags.get(k)]
    chips = tags.get(schema.TAG_CHIPS)
    if chips and chips != "1":
        parts.append(f"x{chips}")
    if tags.get(schema.TAG_SEED):
        parts.append(f"seed {tags[schema.TAG_SEED]}")
    if tags.get(schema.TAG_IMPORT_SOURCE):
        parts.append(f"(import {tags[schema.TAG_IMPORT_SOURCE]})")
    return " ".join(parts)


def run_description(tags: Mapping[str, str]) -> str:
    """The Markdown description (``mlflow.note.content``) of a recorded run: its role,
    workload and identity in one sentence, then where the numbers are."""
    role = tags.get(schema.TAG_ROLE, "run")
    ident = [f"{label} `{tags[k]}`" for label, k in (
        ("backend", schema.TAG_BACKEND), ("hardware", schema.TAG_HARDWARE),
        ("chips", schema.TAG_CHIPS), ("seed", schema.TAG_SEED),
        ("global batch", schema.TAG_GLOBAL_BATCH)) if tags.get(k)]
    text = f"**{role}** run of workload `{tags.get(schema.TAG_WORKLOAD, '?')}`"
    if ident:
        text += ": " + ", ".join(ident)
    text += "."
    if tags.get(schema.TAG_DEVICE):
        text += f" Device: {tags[schema.TAG_DEVICE]}."
    if role in ("reference", "candidate"):
        text += (f"\n\nEvery point at full resolution: artifact `{schema.ARTIFACT_CURVES}`"
                 "; identity: the `refrun.*` tags.")
    return text


def comparison_run_name(kind: ComparisonKind, candidate_name: str, n_references: int,
                        outcome: str | None = None) -> str:
    """``<kind> <candidate> vs N refs[: outcome]``, e.g. ``accept jax-sum-loss vs 3 refs:
    fail`` (``ref`` when there is one reference)."""
    name = f"{kind} {candidate_name} vs {n_references} ref{'s' if n_references != 1 else ''}"
    return f"{name}: {outcome}" if outcome else name


def run_link(experiment_id: str, run_id: str, tab: str = "") -> str:
    """The MLflow UI's (hash-routed) address of a run page, relative to the UI root."""
    return f"#/experiments/{experiment_id}/runs/{run_id}" + (f"/{tab}" if tab else "")


def chart_link(experiment_id: str, run_ids: Sequence[str]) -> str:
    """The experiment's chart view filtered to ``run_ids``: the runs' metrics charted
    together (MLflow's ``searchFilter`` and ``compareRunsMode=CHART`` URL parameters)."""
    query = urllib.parse.urlencode({"searchFilter": runs_filter(run_ids),
                                    "compareRunsMode": "CHART"},
                                   quote_via=urllib.parse.quote)
    return f"#/experiments/{experiment_id}?{query}"


def _md(text: str) -> str:
    """``text`` as literal Markdown (names and reasons come from users' runs)."""
    return "".join("\\" + c if c in "\\`*_{}[]()#+-.!|<>" else c for c in text)


def comparison_description(*, kind: ComparisonKind, experiment_id: str, run_id: str,
                           candidate: tuple[str, str],
                           references: Sequence[tuple[str, str]],
                           verdict: Verdict | None, view_id: str | None = None) -> str:
    """The Markdown description of a comparison run: the verdict and failing criteria
    (when assessed), then links to the candidate, the references, their chart (saved
    view ``view_id`` when given, else a URL filter) and the report.
    ``candidate`` / ``references``: (run id, run name)."""
    lines = []
    if verdict is not None:
        lines.append(f"**Verdict: {verdict.verdict.upper()}** -- highest level reached: "
                     f"{verdict.highest_level or 'none'}.")
        if verdict.failing:
            lines += ["", "Failing criteria:", ""]
            lines += [f"- `{cid}`: {_md(reason)}" for cid, reason in verdict.failing]
        if verdict.not_evaluable:
            lines += ["", "Not evaluable (evidence missing): "
                      + ", ".join(f"`{c}`" for c in verdict.not_evaluable)]
        lines.append("")
    else:
        lines += [f"**{kind}**: differences of the candidate from its references "
                  "(metrics `diff/<metric>`, `reldiff/<metric>`).", ""]
    cid, cname = candidate
    lines += ["Runs, chart and report:", ""]  # a paragraph: not one list with the criteria
    lines.append(f"- Candidate: [{_md(cname)}]({run_link(experiment_id, cid)})")
    lines.append("- References: " + ", ".join(
        f"[{_md(n)}]({run_link(experiment_id, r)})" for r, n in references))
    all_ids = [r for r, _ in references] + [cid]
    chart = (view_link(experiment_id, view_id, chart=True) if view_id
             else chart_link(experiment_id, all_ids))
    lines.append(f"- [Chart the candidate against its references]({chart})")
    if view_id:
        lines.append(f"- [The same runs as a table]({view_link(experiment_id, view_id)})")
    lines.append(f"- Report: [Artifacts -> {schema.ARTIFACT_REPORT}]"
                 f"({run_link(experiment_id, run_id, 'artifacts')})")
    return "\n".join(lines)


def comparison_ui_tags(client: StoreClient, run_id: str, kind: ComparisonKind,
                       verdict: Verdict | None = None,
                       names: Mapping[str, str] | None = None) -> dict[str, str]:
    """Name and description tags for comparison run ``run_id`` (already created, with its
    ``refrun.compared.*`` tags), with the candidate's and references' run names looked up
    in the store (unless given in ``names``, run id -> run name: a sweep knows them and
    saves a request per run); marks the run's experiment as a training experiment on the
    way.

    The caller sets the returned tags through its run session, so a later re-delivery of
    the session's tags cannot put the defaults back.
    """
    run = client.get_run(run_id)
    exp_id = run.info.experiment_id
    prepare_experiment(client, exp_id)
    tags = run.data.tags
    ref_ids = [r for r in tags.get(schema.TAG_COMPARED_REFERENCE, "").split(",") if r]
    cand_id = tags.get(schema.TAG_COMPARED_CANDIDATE, "")

    def name_of(rid: str) -> str:
        if names and names.get(rid):
            return names[rid]
        try:
            return client.get_run(rid).info.run_name or rid[:8]
        except Exception:  # a run of another store: its id is all we know
            return rid[:8]

    candidate = (cand_id, name_of(cand_id))
    references = [(r, name_of(r)) for r in ref_ids]
    outcome = verdict.verdict if verdict is not None else None
    name = comparison_run_name(kind, candidate[1], len(ref_ids), outcome)
    view_id: str | None = comparison_view_id(ref_ids, cand_id)
    exp_tags = client.get_experiment(exp_id).tags or {}
    view_name = f"refrun: {candidate[1]} vs {len(ref_ids)} refs"
    if not _ensure_view(client, exp_id, exp_tags, view_id, view_name,
                        view_state(runs_filter([*ref_ids, cand_id]))):
        view_id = None
    return {
        schema.TAG_RUN_NAME: name,
        schema.TAG_NOTE: comparison_description(
            kind=kind, experiment_id=exp_id, run_id=run_id, candidate=candidate,
            references=references, verdict=verdict, view_id=view_id),
    }


def describe_comparison(client: StoreClient, run_id: str, kind: ComparisonKind,
                        verdict: Verdict | None = None, keep_name: bool = False) -> None:
    """Set the name and description of comparison run ``run_id`` (a run written in one
    pass, :mod:`refrun.store.complete`) as :func:`comparison_ui_tags` makes them; the run
    keeps its name when ``keep_name`` (one its caller chose)."""
    tags = comparison_ui_tags(client, run_id, kind, verdict)
    if keep_name:
        tags.pop(schema.TAG_RUN_NAME)
    for key, value in tags.items():
        client.set_tag(run_id, key, value)

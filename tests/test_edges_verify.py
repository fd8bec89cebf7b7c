"""Issue 55, round two at ``refrun verify``: a deleted (`mlflow runs delete`) or missing run
of a signed-off assessment, a missing artifact, and a deleted signoff.json whose
``refrun.signoff.*`` tags still name the signer are reported as changes (exit 1), never
"verified" nor "not signed off"; signer names are NFKC-normalised and refused when they
mix scripts.  Real sqlite store, real runs, real CLI."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import pytest
from mlflow.tracking import MlflowClient
from test_acceptance_signoff import signed  # noqa: F401  (the fixture: a signed-off accept)

from refrun import schema
from refrun.acceptance.signer import check_by, mixed_scripts
from refrun.cli import main
from refrun.errors import RefrunInputError


def _artifact_file(client: MlflowClient, run_id: str, name: str) -> Path:
    return Path(urlparse(client.get_run(run_id).info.artifact_uri).path) / name


def test_verify_names_a_deleted_reference_run(store, signed, capsys) -> None:  # noqa: F811
    comp, _, ref, _ = signed
    client = MlflowClient(store.tracking_uri)
    client.delete_run(ref.run_id)  # what `mlflow runs delete --run-id` does
    assert main(["verify", comp]) == 1
    out = capsys.readouterr().out
    assert "verified" not in out
    assert f"[runs] reference {ref.run_id}: deleted (`mlflow runs delete`)" in out, out
    client.restore_run(ref.run_id)
    assert main(["verify", comp]) == 0  # restored: verified again
    assert "verified: runs, criteria and evidence unchanged" in capsys.readouterr().out


def test_verify_names_a_deleted_comparison_run_and_a_missing_artifact(
        store, signed, capsys) -> None:  # noqa: F811
    comp, _, _, _ = signed
    client = MlflowClient(store.tracking_uri)
    _artifact_file(client, comp, schema.ARTIFACT_EVIDENCE).unlink()
    client.delete_run(comp)
    assert main(["verify", comp]) == 1
    out = capsys.readouterr().out
    assert f"[runs] comparison run {comp}: deleted" in out, out
    assert f"[artifacts] {schema.ARTIFACT_EVIDENCE}: missing from the comparison run" in out


def test_a_deleted_signoff_record_with_its_tags_left_is_a_disagreement(
        store, signed, capsys) -> None:  # noqa: F811
    comp, _, _, _ = signed
    client = MlflowClient(store.tracking_uri)
    _artifact_file(client, comp, schema.ARTIFACT_SIGNOFF).unlink()
    assert main(["verify", comp]) == 1
    out = capsys.readouterr().out
    assert "not signed off" not in out and "verified" not in out
    assert "accept by Ada (unauthenticated)" in out.splitlines()[0], out
    assert f"[signoff] {schema.ARTIFACT_SIGNOFF}: missing from the run, while its " \
           f"{schema.TAG_SIGNOFF_PREFIX}* tags still name the sign-off" in out, out
    # Nor can a new sign-off quietly replace the one whose record was deleted.
    assert main(["signoff", "--comparison", comp, "--decision", "accept", "--by", "Eve"]) == 2
    err = capsys.readouterr().err
    assert "tags name a sign-off (accept by Ada" in err and len(err.strip().splitlines()) == 1
    assert client.get_run(comp).data.tags[schema.TAG_SIGNOFF_PREFIX + "by"] == "Ada"


@pytest.mark.parametrize(("given", "recorded"), [
    ("ａｄｍｉｎ", "admin"),  # fullwidth: folded by NFKC into what it reads as
    ("ａdmin", "admin"),
    ("Ada Lovelace", "Ada Lovelace"),
    ("José Müller-Øst", "José Müller-Øst"),
    ("Дмитрий", "Дмитрий"),  # one script, not Latin: fine
    ("山田 はなこ カタカナ", "山田 はなこ カタカナ"),  # Japanese: Han with kana
    ("김 金", "김 金"),  # Korean: Hangul with Han
    ("ﬁona", "fiona"),  # a ligature
])
def test_signer_names_are_nfkc_normalised(given: str, recorded: str) -> None:
    assert check_by(given) == recorded


@pytest.mark.parametrize("name", [
    "\u0430dmin",  # Cyrillic а + Latin dmin
    "adm\u0456n",  # Cyrillic і
    "\u03b1dmin",  # Greek α
    "Ada \u0410da",  # a Latin and a Cyrillic word
])
def test_signer_names_that_mix_scripts_are_refused(name: str) -> None:
    assert mixed_scripts(name) is not None
    with pytest.raises(RefrunInputError, match="mixes letters of the scripts"):
        check_by(name)


def test_cli_refuses_a_look_alike_signer_in_one_line(store, signed, capsys) -> None:  # noqa: F811
    comp, _, _, _ = signed
    assert main(["signoff", "--comparison", comp, "--decision", "reject",
                 "--by", "\u0430dmin"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "CYRILLIC, LATIN" in err, err

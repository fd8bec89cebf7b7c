"""Who signs off: the user the tracking server authenticated, or a name typed by hand.

A sign-off's name is worth what its source is worth.  When the tracking server runs
MLflow's authentication app (``mlflow server --app-name basic-auth``), the server knows who
is calling: :func:`resolve_signer` asks it (``GET /api/2.0/mlflow/users/current`` with the
client's own credentials, ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``) and
records that user, and asks the server's own permission check
(``GET /api/3.0/mlflow/users/permissions/get``) whether the user may write to the
comparison run's experiment (EDIT or MANAGE; an admin always may).  ``--by`` is then only
a display name kept beside the authenticated user (``by_declared``), never the identity.

Without authentication (a local sqlite/file store, or a server without the auth app) the
name is what ``--by`` says and the record says ``"unauthenticated"``.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlparse

from refrun.errors import RefrunInputError
from refrun.util.printable import escape, name_problem

Authentication = Literal["mlflow-basic-auth", "unauthenticated"]
UNAUTHENTICATED: Authentication = "unauthenticated"
BASIC_AUTH: Authentication = "mlflow-basic-auth"
CURRENT_USER = "/api/2.0/mlflow/users/current"
USER_PERMISSION = "/api/3.0/mlflow/users/permissions/get"
# MLflow's permission names that allow writing to an experiment (mlflow.server.auth).
WRITE_PERMISSIONS = ("EDIT", "MANAGE")


@dataclass(frozen=True)
class Signer:
    """Who signs: ``name`` is recorded as the sign-off's ``by``."""

    name: str
    authentication: Authentication
    declared: str  # what --by said ("" when not given)


def _http(uri: str) -> bool:
    return urlparse(uri).scheme in ("http", "https")


def _get(uri: str, endpoint: str, params: dict[str, str] | None = None):
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        return http_request(get_default_host_creds(uri), endpoint, "GET", max_retries=0,
                            timeout=30, raise_on_status=False, params=params)
    except Exception as exc:  # the store was read a moment ago; say what failed
        raise RefrunInputError(f"tracking server {uri}: {endpoint} failed "
                               f"({type(exc).__name__}: {exc})") from exc


def current_user(uri: str) -> tuple[str, bool] | None:
    """``(username, is_admin)`` of the caller as the server authenticated it; None when the
    store is not an HTTP server or the server has no authentication app.  Raises when it
    has one and refuses the caller's credentials."""
    if not _http(uri):
        return None
    resp = _get(uri, CURRENT_USER)
    if resp.status_code in (401, 403):
        raise RefrunInputError(f"tracking server {uri} requires authentication and refused "
                               f"the credentials (HTTP {resp.status_code}); set "
                               "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD")
    if resp.status_code == 404:
        return None  # no such endpoint: the server runs without the authentication app
    if resp.status_code != 200:
        # A server error (5xx), a redirect or a throttle says nothing about who is
        # calling: recording the sign-off as "unauthenticated" would hide the failure.
        raise RefrunInputError(f"tracking server {uri}: {CURRENT_USER} answered HTTP "
                               f"{resp.status_code}; cannot tell who signs off, nothing "
                               "recorded (try again)")
    try:
        user = resp.json()["user"]
        return str(user["username"]), bool(user.get("is_admin"))
    except (ValueError, KeyError, TypeError):
        return None  # some other page answered: no authentication app


def experiment_permission(uri: str, username: str, experiment_id: str) -> str:
    """The user's effective permission on the experiment, as the server resolves it."""
    resp = _get(uri, USER_PERMISSION, {"username": username, "resource_type": "experiment",
                                       "resource_id": experiment_id})
    try:
        return str(resp.json()["permission"]) if resp.status_code == 200 else \
            f"unknown (HTTP {resp.status_code})"
    except (ValueError, KeyError, TypeError):
        return f"unknown (HTTP {resp.status_code})"


def check_by(by: str | None) -> str:
    """``--by`` in Unicode normal form NFKC, stripped; refused (one line) when it is not
    printable text (a newline or a terminal escape in a name would forge or hide lines
    wherever the name is printed) or when its letters mix scripts (:func:`mixed_scripts`).

    NFKC folds compatibility look-alikes into the letters they stand for (fullwidth
    "ａdmin" is recorded as "admin", so no name can look like another yet differ from it);
    a name that mixes scripts (Cyrillic "а" among Latin letters: "аdmin") has no such
    folding and is refused."""
    declared = unicodedata.normalize("NFKC", by or "").strip()
    if by is not None and by.strip():
        problem = name_problem(declared) or mixed_scripts(declared)
        if problem is not None:
            raise RefrunInputError(f"--by {escape(by.strip())[:80]!r}: {problem}")
    return declared


# Scripts one name may combine: Japanese writes Han with kana, Korean Han with Hangul.
_SCRIPTS_TOGETHER = (frozenset({"CJK", "HIRAGANA", "KATAKANA"}), frozenset({"CJK", "HANGUL"}))


def _script(ch: str) -> str | None:
    """The script of a letter, from its Unicode name ("CYRILLIC SMALL LETTER A" ->
    CYRILLIC); None for what is not a letter (digits, spaces, punctuation: shared)."""
    if not unicodedata.category(ch).startswith("L"):
        return None
    name = unicodedata.name(ch, "")
    return name.split(" ", 1)[0] if name else "UNKNOWN"


def mixed_scripts(name: str) -> str | None:
    """Why ``name`` mixes scripts so that it could pass for another name (None when it
    does not): letters of more than one script, other than the combinations one language
    writes (Japanese, Korean).  A look-alike such as Cyrillic "аdmin" for "admin"."""
    scripts = {s for s in map(_script, name) if s is not None}
    if len(scripts) <= 1 or any(scripts <= ok for ok in _SCRIPTS_TOGETHER):
        return None
    return (f"mixes letters of the scripts {', '.join(sorted(scripts))} (a look-alike of "
            "another name); write it in one script")


def resolve_signer(tracking_uri: str, user: tuple[str, bool] | None, by: str | None,
                   experiment_id: str, what: str) -> Signer:
    """The signer of a sign-off on ``what`` (a run in ``experiment_id``), from the
    authenticated ``user`` (:func:`current_user`) or ``by``; see the module docstring.
    Raises :class:`RefrunInputError` when the server authenticates and the user may not
    write to the experiment, or when no name is known at all."""
    declared = check_by(by)
    if user is None:
        if not declared:
            raise RefrunInputError("--by: a name is required (the tracking store does not "
                                   "authenticate users)")
        return Signer(declared, UNAUTHENTICATED, declared)
    name, is_admin = user
    if not is_admin:
        perm = experiment_permission(tracking_uri, name, experiment_id)
        if perm not in WRITE_PERMISSIONS:
            raise RefrunInputError(
                f"user {name!r} may not sign off {what}: permission {perm} on experiment "
                f"{experiment_id} (needs {' or '.join(WRITE_PERMISSIONS)})")
    return Signer(name, BASIC_AUTH, declared)

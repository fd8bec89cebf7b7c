#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv) from the pinned lock file,
# install refrun into it (editable), and, for the test suite, Debian's chromium and
# PostgreSQL server binaries.
# Idempotent: a stamp holding the hash of the lock file and pyproject.toml skips the
# install when nothing changed.  Usage: scripts/bootstrap.sh [--with-test-deps]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${REFRUN_VENV:-.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

# Debian packages the test suite needs: chromium (report tests in a real browser) and
# postgresql (server binaries; each test runs its own throw-away cluster).  Installed in the
# background while pip fills the venv (both wait mostly on downloads and unpacking).
apt_pid=""
apt_log="$(mktemp)"
if [ "${1:-}" = "--with-test-deps" ]; then
  missing=()
  [ -x /usr/bin/chromium ] || missing+=(chromium)
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "[bootstrap] installing Debian packages for the tests: ${missing[*]}" >&2
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    ( $SUDO apt-get update -qq \
      && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" \
    ) >"$apt_log" 2>&1 &
    apt_pid=$!
  fi
fi

# Install requirements/dev.lock into $VENV with the uv release the lock pins; fails (for
# the pip fallback) when uv cannot be installed or cannot install the lock.
install_with_uv() {
  local uv_pin
  uv_pin="$(grep -E '^uv==' requirements/dev.lock)" || return 1
  "$VENV/bin/python" -m pip install -q "$uv_pin" >&2 || return 1
  # --native-tls: the system's certificates, as pip uses (a proxy's CA is installed there).
  # --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set (CI machines
  # here), nothing is cached later, and every test subprocess would compile torch, jax and
  # MLflow from source (measured: the suite 1404 s against 1000 s).
  "$VENV/bin/uv" pip install --python "$VENV/bin/python" --native-tls --compile-bytecode -q \
    -r requirements/dev.lock >&2
}

stamp_want="$(cat requirements/dev.lock pyproject.toml | sha256sum | cut -c1-16)"
stamp_file="$VENV/.refrun-stamp"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp_file" 2>/dev/null)" != "$stamp_want" ]; then
  echo "[bootstrap] creating $VENV from requirements/dev.lock (first time: about a minute with uv, several with pip)" >&2
  "$PY" -m venv "$VENV"
  # torch_xla 2.9.0 requires torch==2.9.0 exactly; the lock pins the set known to work.
  # uv (pinned in the lock) installs it: it downloads and unpacks in parallel, about a
  # minute for the lock's 8 GB where pip takes several (docs/dependencies.md).  Where uv
  # cannot be installed or cannot reach the index, pip installs the same pinned set.
  if ! install_with_uv; then
    echo "[bootstrap] uv did not install the lock (above); installing it with pip (several minutes)" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
    "$VENV/bin/python" -m pip install -q -r requirements/dev.lock >&2
  fi
  "$VENV/bin/python" -m pip install -q --no-deps -e . >&2
  echo "$stamp_want" > "$stamp_file"
else
  # Reusing: make sure this checkout is the one installed (cheap, no dependencies).
  if ! "$VENV/bin/python" -c "import refrun, pathlib, sys; sys.exit(0 if pathlib.Path(refrun.__file__).resolve().is_relative_to(pathlib.Path('src').resolve()) else 1)" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q --no-deps -e . >&2
  fi
fi

if [ -n "$apt_pid" ]; then
  if ! wait "$apt_pid"; then
    cat "$apt_log" >&2
    echo "[bootstrap] apt-get failed installing the test packages (log above)" >&2
    rm -f "$apt_log"
    exit 1
  fi
fi
rm -f "$apt_log"

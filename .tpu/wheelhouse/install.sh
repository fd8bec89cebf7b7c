#!/bin/sh
# Install refrun==0.1.0 from this wheelhouse (built for manylinux_2_36_x86_64, Python 3.11)
# into DIR, then append DIR to PYTHONPATH (the machine's own packages stay first):
#   sh install.sh DIR [INDEX_URL]      export PYTHONPATH="$PYTHONPATH:DIR"
set -eu
here=$(cd "$(dirname "$0")" && pwd)
dir=${1:?usage: sh install.sh DIR [INDEX_URL]}
# This wheelhouse carries only what the target lacks: give the target's own package index.
[ -n "${2:-}" ] || { echo "usage: sh $0 DIR INDEX_URL" >&2; exit 2; }
if [ -n "${2:-}" ]; then index="--index-url $2"; else index=--no-index; fi
# shellcheck disable=SC2086
exec "${PYTHON:-python3}" -m pip install --target "$dir" --only-binary :all: $index \
    --find-links "$here" refrun==0.1.0

#!/usr/bin/env bash
# What the TPU machine runs (docs/tpu.md), from the clone's root, in one command of at most
# ten minutes each:
#   benchmarks/tpu/run.sh record WHEELHOUSE      # install, record every pipeline's JAX port
#   benchmarks/tpu/run.sh cost WHEELHOUSE [ARGS] # install, the probe's paired cost on the chip
# WHEELHOUSE: built here by scripts/build_wheelhouse.py and carried there.  Results go to
# $OUT (the device tool's folder; default ./tpu-out): tpu-store.tgz (record), probe_cost.json
# (cost), env.txt (what the machine is).  The install lands in .tpu-site of the clone and is
# reused by a later command on the same machine while the wheelhouse is the same.
set -uo pipefail
mode=${1:?usage: run.sh record|cost WHEELHOUSE [ARGS]}
wheelhouse=${2:?usage: run.sh record|cost WHEELHOUSE [ARGS]}
shift 2
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/tpu-out}
mkdir -p "$OUT"
site=$PWD/.tpu-site
index=${TPU_INDEX:-file:///opt/pypi/simple}
t0=$(date +%s)
# a warm machine keeps .tpu-site between commands: reinstall when the wheelhouse changed
stamp=$(cat "$wheelhouse"/*.whl | sha256sum | cut -c1-16)
if [ "$(cat "$site/.installed" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$site"
  # the wheelhouse carries what the machine's own index lacks (docs/offline-install.md);
  # scikit-learn ships the digits data set (the digits port reads its csv file).
  PIP_CONFIG_FILE=/dev/null sh "$wheelhouse/install.sh" "$site" "$index" 2>&1 | tail -5 \
    && PIP_CONFIG_FILE=/dev/null python3 -m pip install -q --target "$site" --only-binary :all: \
       --index-url "$index" --find-links "$wheelhouse" scikit-learn 2>&1 | tail -3 \
    && echo "$stamp" > "$site/.installed"
fi
echo "install: $(( $(date +%s) - t0 )) s"
# The wheelhouse carries refrun's own wheel, built from the code at the time it was built:
# a record made with a stale wheel would be labelled with this clone's code but run the
# wheel's (it happened: 2026-12-07, the eighth record).  Refuse, before the chip is used.
tree_sum() { (cd "$1" && find . -name '*.py' -not -path '*/__pycache__/*' | LC_ALL=C sort \
              | xargs cat | sha256sum | cut -c1-16); }
if [ "$(tree_sum "$site/refrun")" != "$(tree_sum src/refrun)" ]; then
  echo "run.sh: $wheelhouse's refrun wheel is not this clone's src/refrun: rebuild it" \
       "(scripts/build_wheelhouse.py, docs/tpu.md)" >&2
  exit 2
fi
echo "refrun: the wheel is this clone's src/refrun ($(tree_sum src/refrun))"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site:$PWD"
{ date -u; python3 -c 'import platform, sys; print(platform.libc_ver(), sys.version)'
  python3 -c 'import jax, refrun; print("jax", jax.__version__, jax.devices(), "refrun", refrun.__file__)'
  ls "${index#file://}" 2>/dev/null | tr '\n' ' '; echo; } > "$OUT/env-$mode.txt" 2>&1
case "$mode" in
  record)
    store=/tmp/tpu-store
    rm -rf "$store"
    python3 benchmarks/tpu/record.py --store "$store" "$@" 2>&1 \
      | grep --line-buffered -v -e "transparent hugepages" -e "^WARNING:root"
    rc=${PIPESTATUS[0]}
    tar czf "$OUT/tpu-store.tgz" -C /tmp tpu-store
    ;;
  cost)
    python3 benchmarks/tpu/probe_cost.py --json "$OUT/probe_cost.json" "$@" 2>&1 | tee "$OUT/cost.log" \
      | grep --line-buffered -v -e "transparent hugepages" -e "^WARNING:root"
    rc=${PIPESTATUS[0]}
    ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
echo "$mode: $(( $(date +%s) - t0 )) s, exit $rc"
exit "$rc"

#!/usr/bin/env bash
# The GPU day in one command, run from the checkout root on a lent GPU machine (docs/offline_install.md has the
# exact device call):
#   bash scripts/gpu_day.sh "$OUT"                      # install the carried bundle, then the first call's phases
#   bash scripts/gpu_day.sh "$OUT" --phases flux_rollout,launcher --deadline-s 270   # the second call (.whl/ray)
# Installs the bundle(s) the call carried (scripts/gpu_env.sh: .whl/gpu, .whl/ray into .site/), then runs
# `python -m benchmarks gpu_day --out OUT_DIR [args...]`, which writes OUT_DIR/gpu_day.json after every phase and
# appends OUT_DIR/gpu_day.log. A failed install is logged and the run goes on: phases whose packages are missing
# are recorded as skipped, the env phase still reports the machine.
set -uo pipefail
[ $# -ge 1 ] || { echo "gpu_day.sh: usage: bash scripts/gpu_day.sh OUT_DIR [gpu_day args...]" >&2; exit 2; }
OUT_DIR="$1"
shift
mkdir -p "$OUT_DIR" || { echo "gpu_day.sh: cannot create $OUT_DIR" >&2; exit 2; }
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
cd "$(dirname "$0")/.."
t0=$(date +%s.%N)
if . scripts/gpu_env.sh >>"$OUT_DIR/gpu_day.log" 2>&1; then install=ok; else install=failed; fi
GERL_INSTALL_S="$(python3 -c "import time; print(round(time.time() - $t0, 1))")"
export GERL_INSTALL_S
echo "gpu_day.sh: bundle install $install in ${GERL_INSTALL_S} s: $(grep '^gpu_env' "$OUT_DIR/gpu_day.log" | tail -n 1)"
exec python3 -m benchmarks gpu_day --out "$OUT_DIR" "$@"

#!/usr/bin/env bash
# Set up, then run the whole test suite (CPU, tiny offline models); the 20 slowest are listed.
#   bash scripts/test.sh [pytest args]        e.g. -k stream for a subset
# GERL_TEST_PROCS=2 runs it in 2 processes (pytest-xdist): not yet the default, since a Ray test started in one
# process can join the Ray cluster that a test in the other one started with `ray start`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q -n "${GERL_TEST_PROCS:-0}" --dist loadgroup --durations=20 "$@"

#!/usr/bin/env bash
# Set up, then run the whole test suite (CPU, tiny offline models) in 2 processes; the 20 slowest are listed.
#   bash scripts/test.sh [pytest args]        e.g. -n 0 for one process, -k stream for a subset
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q -n "${GERL_TEST_PROCS:-2}" --dist loadgroup --durations=20 "$@"

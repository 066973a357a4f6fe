#!/usr/bin/env bash
# Set up, then run the whole test suite (CPU, tiny offline models) in 2 processes; the 20 slowest are listed.
#   bash scripts/test.sh [pytest args]        e.g. -k stream for a subset, -m "not slow" for the quick tier
# GERL_TEST_PROCS=N sets the processes (pytest-xdist; 0 = one, no xdist). The Ray tests run one after another in
# one of them (tests/conftest.py); every Ray a test starts is its own (ray.init(address="local")).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q -n "${GERL_TEST_PROCS:-2}" --dist loadgroup --durations=20 "$@"

#!/usr/bin/env bash
# Set up, then run the whole test suite (CPU, tiny offline models) in 2 processes; the 20 slowest are listed.
#   bash scripts/test.sh [pytest args]        e.g. -k stream for a subset, -m "not slow" for the quick tier
# GERL_TEST_PROCS=N sets the processes (pytest-xdist; 0 = one, no xdist). Each runs a module at a time, the longest
# first (tests/conftest.py); every Ray a test starts is its own (ray.init(address="local")). (Not --dist loadgroup:
# with pytest 9.2 and pytest-xdist 3.8 its xdist_group marks no longer group anything.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q -n "${GERL_TEST_PROCS:-2}" --dist loadfile --no-loadscope-reorder --durations=20 "$@"

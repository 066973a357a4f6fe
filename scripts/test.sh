#!/usr/bin/env bash
# Set up, then run the whole test suite (CPU, tiny offline models) in 3 processes; the 20 slowest are listed.
#   bash scripts/test.sh [pytest args]        e.g. -k stream for a subset, -m "not slow" for the quick tier
# GERL_TEST_PROCS=N sets the processes (pytest-xdist; 0 = one, no xdist): 3 on this project's 2-core machine, so that
# a core left idle while one process waits (a Ray host starting, a server, a timeout) has work — the machine's CPU
# was 90 % busy with 2 and 97 % with 3 (docs/lab_notebook.md). Each runs a module at a time, the longest
# first (tests/conftest.py); every Ray a test starts is its own (ray.init(address="local")). (Not --dist loadgroup:
# with pytest 9.2 and pytest-xdist 3.8 its xdist_group marks no longer group anything.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q -n "${GERL_TEST_PROCS:-3}" --dist loadfile --no-loadscope-reorder --durations=20 "$@"

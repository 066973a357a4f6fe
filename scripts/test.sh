#!/usr/bin/env bash
# Set up, then run the whole test suite (CPU, tiny offline models).
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q "$@"

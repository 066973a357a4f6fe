#!/usr/bin/env bash
# Create .venv (if missing) and install gerl with its test extras. Idempotent; safe to re-run.
# torch is installed first and pinned: with no torch present, a bare `torch` requirement would pull the newest
# CUDA build (several GB). Override with GERL_TORCH="torch==X.Y.Z" (e.g. a CUDA build on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

quiet_pip() {  # pip install, showing its output only if it fails (minus this machine's index-location noise)
  local log
  log="$(mktemp)"
  if ! pip install -q "$@" >"$log" 2>&1; then
    grep -v -E "^WARNING: Location .* is ignored" "$log" || true
    rm -f "$log"
    echo "setup: 'pip install $*' failed" >&2
    return 1
  fi
  rm -f "$log"
}

python -c "import torch" 2>/dev/null || quiet_pip "${GERL_TORCH:-torch==2.13.0}"
quiet_pip -e ".[dev]"
python -c "import gerl, rewards, torch, diffusers, ray; print(f'gerl ready: torch {torch.__version__}, diffusers {diffusers.__version__}')"

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
python -c "import torch" 2>/dev/null || pip install -q "${GERL_TORCH:-torch==2.13.0}"
pip install -q -e ".[dev]" 2>&1 | grep -v -E "^WARNING: Location .* is ignored" || true
python -c "import gerl, rewards, torch, diffusers; print(f'gerl ready: torch {torch.__version__}, diffusers {diffusers.__version__}')"

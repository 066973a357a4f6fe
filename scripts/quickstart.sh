#!/usr/bin/env bash
# Set up, then run the quickstart: Flow-GRPO-Fast on the tiny offline SD3, CPU, JPEG-compressibility reward.
#   bash scripts/quickstart.sh [extra key=value overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
gerl train recipes/tiny_cpu.yaml output_dir=runs/quickstart overwrite=true "$@"
python scripts/summarize_run.py runs/quickstart

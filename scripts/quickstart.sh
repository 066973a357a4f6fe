#!/usr/bin/env bash
# Set up, then run the quickstart: AWM one-step-off (Ray: 1 actor core + 1 rollout core) with the real OCR reward
# (rapidocr) on ocr-mini, the small SD3-architecture model shipped in assets/models/ocr-mini, on CPU: with
# DiffusionNFT one-step-off, the fastest on the sealed test (docs/benchmarks.md). About 6 minutes of training on 2
# cores, 9-10 with validation. Flow-GRPO-Fast: gerl train recipes/ocr_mini.yaml output_dir=runs/quickstart_grpo
#   bash scripts/quickstart.sh [extra key=value overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
gerl train recipes/ocr_mini_awm.yaml output_dir=runs/quickstart overwrite=true engine.kind=ray engine.hybrid=false \
  engine.device=cpu engine.cpus_per_worker=1 engine.schedule=async engine.max_staleness=1 "$@"
python scripts/summarize_run.py runs/quickstart

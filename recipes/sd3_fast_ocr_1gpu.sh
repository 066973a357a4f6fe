#!/usr/bin/env bash
# bash recipes/sd3_fast_ocr_1gpu.sh MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...] [--print-config]
# Flow-GRPO-Fast, SD3.5-M, OCR reward, one GPU, with_reward on. DATASET_DIR holds train.txt and test.txt
# (Flow-GRPO's dataset/ocr layout). Ends by printing throughput and GPU-hours.
set -euo pipefail
MODEL="${1:?usage: $0 MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]}"
DATA="${2:?usage: $0 MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]}"
shift 2
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/sd3_fast_ocr_1gpu}"
gerl train recipes/sd3_fast_ocr_1gpu.yaml model.path="$MODEL" data.train_prompts="$DATA/train.txt" \
  data.test_prompts="$DATA/test.txt" output_dir="$OUT" "$@"
for arg in "$@"; do [ "$arg" = "--print-config" ] && exit 0; done  # printed, nothing ran
python - "$OUT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl") if l.strip()]
steps = [r for r in rows if "step_s" in r]
wall = sum(r["step_s"] + r.get("validate_s", 0) for r in steps)
images = sum(r["images"] for r in steps)
print(f"throughput: {images / wall:.2f} images/s/GPU over {len(steps)} steps; GPU-hours: {wall / 3600:.3f}")
PY

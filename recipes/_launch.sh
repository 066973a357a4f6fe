#!/usr/bin/env bash
# Shared by the run_sd3_fast_*.sh recipes: train, then print throughput (images/s/GPU) and GPU-hours.
#   bash recipes/_launch.sh MODEL DATASET_DIR OUTPUT_DIR [key=value ...]
set -euo pipefail
MODEL="$1"; DATA="$2"; OUT="$3"; shift 3
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
gerl train recipes/sd3_fast_ocr_1gpu.yaml model.path="$MODEL" data.train_prompts="$DATA/train.txt" \
  data.test_prompts="$DATA/test.txt" output_dir="$OUT" "$@"
python - "$OUT" <<'PY'
import json, sys, yaml
run = sys.argv[1]
cfg = yaml.safe_load(open(f"{run}/config.yaml"))
e = cfg["engine"]
devices = e["actor_workers"] if e["hybrid"] else e["actor_workers"] + e["rollout_workers"]
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if l.strip()]
steps = [r for r in rows if "step_s" in r]
wall = sum(r["step_s"] + r.get("validate_s", 0) for r in steps)
images = sum(r["images"] for r in steps)
print(f"{run}: {len(steps)} steps, {devices} GPUs, throughput {images / wall / devices:.2f} images/s/GPU, "
      f"{devices * wall / 3600:.2f} GPU-hours")
PY

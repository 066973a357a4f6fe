#!/usr/bin/env bash
# Shared by the run_*.sh launchers: train RECIPE (default recipes/gerl_sd3_fast_ocr.yaml, GeRL's rows) for EPOCHS
# (default 15, GeRL's trainer.total_epochs) over DATASET_DIR/train.txt, then print throughput (images/s/GPU) and
# GPU-hours. EPOCHS=0 keeps the recipe's own max_steps (the FLUX launchers: their peers stop runs by hand).
#   bash recipes/_launch.sh MODEL DATASET_DIR OUTPUT_DIR [key=value ...] [--print-config]
# PROMPTS_PER_STEP (default 8) must match data.prompts_per_step for the epoch arithmetic; max_steps=N overrides it.
# --print-config prints the resolved config and exits without training or writing anything.
set -euo pipefail
MODEL="$1"; DATA="$2"; OUT="$3"; shift 3
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
if [ ! -f "$DATA/train.txt" ] || [ ! -f "$DATA/test.txt" ]; then
  echo "gerl: error: $DATA must hold train.txt and test.txt (Flow-GRPO's dataset/ocr layout)" >&2
  exit 2
fi
# GeRL's dataloader drops the last partial batch: an epoch is floor(prompts / prompts per step) steps.
STEPS=()
if [ "${EPOCHS:-15}" != 0 ]; then
  PROMPTS=$(grep -c . "$DATA/train.txt" || true)
  N=$(( (PROMPTS / ${PROMPTS_PER_STEP:-8}) * ${EPOCHS:-15} ))
  STEPS=(max_steps="$(( N >= 1 ? N : 1 ))")
fi
PRINT_ONLY=0
for arg in "$@"; do [ "$arg" = "--print-config" ] && PRINT_ONLY=1; done
gerl train "${RECIPE:-recipes/gerl_sd3_fast_ocr.yaml}" model.path="$MODEL" data.train_prompts="$DATA/train.txt" \
  data.test_prompts="$DATA/test.txt" output_dir="$OUT" ${STEPS[@]+"${STEPS[@]}"} "$@"
[ "$PRINT_ONLY" = 1 ] && exit 0
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

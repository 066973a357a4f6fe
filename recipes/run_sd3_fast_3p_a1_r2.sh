#!/usr/bin/env bash
# bash recipes/run_sd3_fast_3p_a1_r2.sh MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]
# GeRL row: 3 GPUs decoupled, 1 actor + 2 rollout, one-step-off; 8 prompts x 8 images.
# SD3.5-M, Flow-GRPO-Fast (cps, noise 0.8, window 3 in [0,5], guidance 1.0), OCR reward, LoRA r32/α64, lr 1e-4,
# 32 validation prompts. DATASET_DIR holds train.txt and test.txt (Flow-GRPO's dataset/ocr layout).
set -euo pipefail
MODEL="${1:?usage: $0 MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]}"
DATA="${2:?usage: $0 MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]}"
shift 2
exec bash "$(dirname "$0")/_launch.sh" "$MODEL" "$DATA" "${OUT:-runs/run_sd3_fast_3p_a1_r2}" engine.kind=ray engine.device=cuda engine.hybrid=false engine.actor_workers=1 engine.rollout_workers=2 engine.schedule=async engine.max_staleness=1 "$@"

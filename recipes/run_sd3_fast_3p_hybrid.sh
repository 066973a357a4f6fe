#!/usr/bin/env bash
# bash recipes/run_sd3_fast_3p_hybrid.sh MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]
# GeRL row: 3 GPUs colocated (hybrid), sync. 9 prompts x 8 images (GeRL: 8 x 8) so whole groups split evenly over 3 GPUs.
# SD3.5-M, Flow-GRPO-Fast (cps, noise 0.8, window 3 in [0,5], guidance 1.0), OCR reward, LoRA r32/α64, lr 1e-4,
# 32 validation prompts. DATASET_DIR holds train.txt and test.txt (Flow-GRPO's dataset/ocr layout).
set -euo pipefail
MODEL="${1:?usage: $0 MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]}"
DATA="${2:?usage: $0 MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]}"
shift 2
exec bash "$(dirname "$0")/_launch.sh" "$MODEL" "$DATA" "${OUT:-runs/run_sd3_fast_3p_hybrid}" engine.kind=ray engine.device=cuda engine.hybrid=true engine.actor_workers=3 engine.rollout_workers=3 data.prompts_per_step=9 train.mini_batch_size=72 "$@"

#!/usr/bin/env bash
# bash recipes/run_qwenimage_fast_ocr_4p_hybrid.sh MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...] [--print-config]
# Flow-GRPO-Fast on Qwen-Image, OCR reward (recipes/flow_grpo_qwenimage_ocr.yaml: verl-omni's Qwen-Image OCR settings,
# bf16), on 4 GPUs colocated (hybrid), sync — verl-omni's run_qwen_image_ocr_lora.sh layout (actor, rollout and its
# reward judge share 4 GPUs; here the OCR reward runs on the CPU). 32 prompts × 16 images = 128 per GPU (16
# micro-batches of 8); two optimizer steps per step.
# DATASET_DIR holds train.txt and test.txt (Flow-GRPO's dataset/ocr layout). max_steps is the recipe's (300, as
# verl-omni's). Rehearse the layout on CPU first: bash recipes/run_qwenimage_fast_ocr_4p_hybrid.sh tiny-qwenimage DATASET_DIR engine.rehearse=true max_steps=2
# --print-config shows the resolved config and exits.
set -euo pipefail
MODEL="${1:?usage: $0 MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]}"
DATA="${2:?usage: $0 MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]}"
shift 2
RECIPE=recipes/flow_grpo_qwenimage_ocr.yaml EPOCHS=0 exec bash "$(dirname "$0")/_launch.sh" "$MODEL" "$DATA" "${OUT:-runs/run_qwenimage_fast_ocr_4p_hybrid}" engine.kind=ray engine.device=cuda engine.hybrid=true engine.actor_workers=4 engine.rollout_workers=4 "$@"

#!/usr/bin/env bash
# bash recipes/run_flux_grpo_ocr_8p_hybrid.sh MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...] [--print-config]
# Flow-GRPO on FLUX.1-dev, OCR reward (recipes/flow_grpo_flux_ocr.yaml: flow_grpo's pickscore_flux settings, bf16),
# on 8 GPUs colocated (hybrid), sync — flow_grpo's pickscore_flux_8gpu layout: every GPU samples and trains. 48
# prompts × 24 images = 144 per GPU (48 micro-batches of 3); two optimizer steps per step.
# DATASET_DIR holds train.txt and test.txt (Flow-GRPO's dataset/ocr layout). max_steps is the recipe's (its peers stop
# runs by hand). Rehearse the layout on CPU first: bash recipes/run_flux_grpo_ocr_8p_hybrid.sh tiny-flux DATASET_DIR engine.rehearse=true max_steps=2
# --print-config shows the resolved config and exits.
set -euo pipefail
MODEL="${1:?usage: $0 MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]}"
DATA="${2:?usage: $0 MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]}"
shift 2
RECIPE=recipes/flow_grpo_flux_ocr.yaml EPOCHS=0 exec bash "$(dirname "$0")/_launch.sh" "$MODEL" "$DATA" "${OUT:-runs/run_flux_grpo_ocr_8p_hybrid}" engine.kind=ray engine.device=cuda engine.hybrid=true engine.actor_workers=8 engine.rollout_workers=8 "$@"

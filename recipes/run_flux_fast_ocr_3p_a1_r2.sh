#!/usr/bin/env bash
# bash recipes/run_flux_fast_ocr_3p_a1_r2.sh MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...] [--print-config]
# Flow-GRPO-Fast on FLUX.1-dev, OCR reward (recipes/flow_grpo_flux_fast_ocr.yaml: flow_grpo's geneval_flux_fast
# settings, bf16), on 3 GPUs decoupled: 1 actor + 2 rollouts, one-step-off (GeRL's fastest SD3 layout; flow_grpo
# itself colocates on 32 GPUs). 24 groups per rollout GPU; two optimizer steps per step.
# DATASET_DIR holds train.txt and test.txt (Flow-GRPO's dataset/ocr layout). max_steps is the recipe's (its peers stop
# runs by hand). Rehearse the layout on CPU first: bash recipes/run_flux_fast_ocr_3p_a1_r2.sh tiny-flux DATASET_DIR engine.rehearse=true max_steps=2
# --print-config shows the resolved config and exits.
set -euo pipefail
MODEL="${1:?usage: $0 MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]}"
DATA="${2:?usage: $0 MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]}"
shift 2
RECIPE=recipes/flow_grpo_flux_fast_ocr.yaml EPOCHS=0 exec bash "$(dirname "$0")/_launch.sh" "$MODEL" "$DATA" "${OUT:-runs/run_flux_fast_ocr_3p_a1_r2}" engine.kind=ray engine.device=cuda engine.hybrid=false engine.actor_workers=1 engine.rollout_workers=2 engine.schedule=async engine.max_staleness=1 "$@"

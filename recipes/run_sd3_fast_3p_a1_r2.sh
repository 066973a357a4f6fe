#!/usr/bin/env bash
# bash recipes/run_sd3_fast_3p_a1_r2.sh MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...] [--print-config]
# GeRL row: 3 GPUs decoupled, 1 actor + 2 rollout, one-step-off.
# Everything else is GeRL's run_sd3_fast_3p_a1_r2.sh with GeRL's conventions (recipes/gerl_sd3_fast_ocr.yaml):
# SD3.5-M, 512 T5 tokens, cps, noise 0.8, window 3 in [0,5], guidance 1.0, 8 prompts x 8 images, mini-batch 4
# prompts in order (two optimizer steps per step), lr 1e-4, wd 1e-4, LoRA r32/a64 (gaussian, attn.*), clip 1e-4,
# adv clip 5, no KL, fp16, 32 validation prompts every 5 steps, 15 epochs. DATASET_DIR holds train.txt and test.txt
# (Flow-GRPO's dataset/ocr layout).
# --print-config shows the resolved config and exits.
set -euo pipefail
MODEL="${1:?usage: $0 MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]}"
DATA="${2:?usage: $0 MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]}"
shift 2
exec bash "$(dirname "$0")/_launch.sh" "$MODEL" "$DATA" "${OUT:-runs/run_sd3_fast_3p_a1_r2}" engine.kind=ray engine.device=cuda engine.hybrid=false engine.actor_workers=1 engine.rollout_workers=2 engine.schedule=async engine.max_staleness=1 "$@"

#!/usr/bin/env bash
# bash recipes/run_flux_full_fsdp_ocr_8p.sh MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...] [--print-config]
# Flow-GRPO-Fast on FLUX.1-dev fully fine-tuned, OCR reward (recipes/flux_full_fsdp_ocr.yaml: Flow-Factory's FLUX.1
# full settings), on 8 GPUs colocated (hybrid), sync, the transformer sharded over them with FSDP2 (engine.fsdp=true:
# each GPU holds 1/8 of the fp32 weights, gradients and AdamW moments). 48 prompts × 16 images = 96 per GPU (12
# micro-batches of 8); two optimizer steps per step. gerl plan, 80 GB card: 33.6 GiB per GPU with the text cache (42.7 without).
# First, once: the prompts' T5/CLIP embeddings into DATASET_DIR/text_cache, so that no host loads the text encoders
# (8.9 GiB each; set TEXT_CACHE=0 to encode on the fly instead).
# DATASET_DIR holds train.txt and test.txt (Flow-GRPO's dataset/ocr layout). Rehearse the layout on CPU first:
#   bash recipes/run_flux_full_fsdp_ocr_8p.sh tiny-flux DATASET_DIR engine.rehearse=true max_steps=2
# --print-config shows the resolved config and exits.
set -euo pipefail
MODEL="${1:?usage: $0 MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]}"
DATA="${2:?usage: $0 MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...]}"
shift 2
cd "$(dirname "$0")/.."  # as _launch.sh: DATASET_DIR and the recipe relative to the repository
[ -f .venv/bin/activate ] && . .venv/bin/activate
CACHE=()
if [ "${TEXT_CACHE:-1}" != 0 ]; then
  CACHE=(model.text_cache="$DATA/text_cache_$(basename "$MODEL")")
  ARGS=()
  for arg in "$@"; do [ "$arg" != "--print-config" ] && ARGS+=("$arg"); done
  # the run's own config (a rehearsal's shrunk one too): a cache written for another is refused at start-up
  [ ${#ARGS[@]} = $# ] && gerl prepare recipes/flux_full_fsdp_ocr.yaml model.path="$MODEL" \
    data.train_prompts="$DATA/train.txt" data.test_prompts="$DATA/test.txt" "${CACHE[@]}" engine.kind=ray engine.device=cuda engine.hybrid=true engine.actor_workers=8 engine.rollout_workers=8 engine.fsdp=true ${ARGS[@]+"${ARGS[@]}"}
fi
RECIPE=recipes/flux_full_fsdp_ocr.yaml EPOCHS=0 exec bash recipes/_launch.sh "$MODEL" "$DATA" "${OUT:-runs/run_flux_full_fsdp_ocr_8p}" ${CACHE[@]+"${CACHE[@]}"} engine.kind=ray engine.device=cuda engine.hybrid=true engine.actor_workers=8 engine.rollout_workers=8 engine.fsdp=true "$@"

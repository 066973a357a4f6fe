#!/usr/bin/env bash
# bash recipes/run_qwenimage_fast_ocr_2n16p_hybrid.sh MODEL_PATH_OR_HUB_ID DATASET_DIR [key=value ...] [--print-config]
# Flow-GRPO-Fast on Qwen-Image with a LoRA, OCR reward (recipes/flow_grpo_qwenimage_ocr.yaml: verl-omni's Qwen-Image
# OCR settings, bf16), on 2 nodes × 8 GPUs colocated (hybrid), sync: 16 replicas (DDP: the adapter's gradients
# all-reduced per block). 32 prompts × 16 images = 32 per GPU (4 micro-batches of 8); two optimizer steps per step.
# The cluster first, one command per node (engine.ray_address=auto joins it from the head node):
#   node 0: ray start --head --port=6379 --num-gpus=8        node 1: ray start --address=NODE0_IP:6379 --num-gpus=8
# then, on node 0: bash recipes/run_qwenimage_fast_ocr_2n16p_hybrid.sh Qwen/Qwen-Image DATASET_DIR
# The hosts go into one Ray placement group, ranks 0-7 on one node and 8-15 on the other (gerl/engine/placement.py);
# NCCL reads engine.env in every host, e.g. 'engine.env={NCCL_SOCKET_IFNAME: eth0, NCCL_IB_HCA: mlx5}' for your fabric.
# First, once: the prompts' Qwen2.5-VL embeddings into DATASET_DIR/text_cache_<model> (gerl prepare, on this node's
# GPU), so that no host loads the 15.5 GiB text encoder. gerl plan, 80 GB card: 62.0 GiB per GPU without it; 77.5 GiB
# with it, which does not fit at train micro-batch 16. DATASET_DIR must be at the same path on both nodes (a shared filesystem,
# or a copy: the cache is read where it lies). TEXT_CACHE=0 encodes on the fly (then add train.micro_batch_size=8).
# Rehearse the two-node layout on this machine first (two Ray nodes of 8 declared GPUs each, on the CPU):
#   python scripts/rehearse_cluster.py --nodes 2 --gpus 8 -- bash recipes/run_qwenimage_fast_ocr_2n16p_hybrid.sh tiny-qwenimage DATASET_DIR engine.rehearse=true max_steps=2
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
  [ ${#ARGS[@]} = $# ] && gerl prepare recipes/flow_grpo_qwenimage_ocr.yaml model.path="$MODEL" \
    data.train_prompts="$DATA/train.txt" data.test_prompts="$DATA/test.txt" "${CACHE[@]}" engine.kind=ray engine.device=cuda engine.hybrid=true engine.actor_workers=16 engine.rollout_workers=16 ${ARGS[@]+"${ARGS[@]}"}
fi
RECIPE=recipes/flow_grpo_qwenimage_ocr.yaml EPOCHS=0 exec bash recipes/_launch.sh "$MODEL" "$DATA" "${OUT:-runs/run_qwenimage_fast_ocr_2n16p_hybrid}" ${CACHE[@]+"${CACHE[@]}"} engine.kind=ray engine.ray_address=auto engine.device=cuda engine.hybrid=true engine.actor_workers=16 engine.rollout_workers=16 "$@"

#!/usr/bin/env bash
# bash scripts/serve_vlm_reward.sh [ocr|judge] [MODEL_PATH_OR_HUB_ID] [extra vllm serve flags ...]
#   ocr   (default) Qwen/Qwen2.5-VL-7B-Instruct, for reward.name: vlm_ocr
#   judge           CodeGoat24/UnifiedReward-qwen-7b, for reward.name: vlm_judge
# Serves an OpenAI-compatible API with vLLM (pip install 'gerl[vllm]') on the GPU(s) in CUDA_VISIBLE_DEVICES, then
# point the trainer at it:
#   export GERL_VLM_BASE_URL=http://HOST:PORT/v1 GERL_VLM_MODEL=<the model argument below>
# Environment: PORT (8000), HOST (0.0.0.0), GPU_MEM (0.9: fraction of the GPU vLLM may take; lower it when the
# GPU is shared with training), MAX_LEN (4096 tokens: prompt + image tokens + reply), MAX_PIXELS (512*512*4:
# Qwen-VL resizes larger images down to this many pixels), GERL_VLM_API_KEY (if set, requests must carry it).
# Example, a dedicated second GPU:  CUDA_VISIBLE_DEVICES=1 bash scripts/serve_vlm_reward.sh ocr
set -euo pipefail
KIND="${1:-ocr}"
case "$KIND" in
  ocr) DEFAULT_MODEL=Qwen/Qwen2.5-VL-7B-Instruct ;;
  judge) DEFAULT_MODEL=CodeGoat24/UnifiedReward-qwen-7b ;;
  *) echo "usage: $0 [ocr|judge] [MODEL_PATH_OR_HUB_ID] [vllm serve flags ...]" >&2; exit 2 ;;
esac
MODEL="${2:-$DEFAULT_MODEL}"
shift $(( $# > 2 ? 2 : $# ))
command -v vllm >/dev/null || { echo "vllm not found: pip install 'gerl[vllm]'" >&2; exit 2; }

# The key goes through the environment (vLLM reads VLLM_API_KEY), not argv, where `ps` would show it.
if [[ -n "${GERL_VLM_API_KEY:-}" ]]; then export VLLM_API_KEY="$GERL_VLM_API_KEY"; fi

# One image per request and no video: vLLM reserves memory for the worst-case multimodal input per prompt.
# Requests are batched continuously; max-num-seqs bounds how many of the reward's in-flight requests run at once.
exec vllm serve "$MODEL" \
  --served-model-name "$MODEL" \
  --host "${HOST:-0.0.0.0}" \
  --port "${PORT:-8000}" \
  --dtype bfloat16 \
  --max-model-len "${MAX_LEN:-4096}" \
  --gpu-memory-utilization "${GPU_MEM:-0.9}" \
  --limit-mm-per-prompt '{"image": 1, "video": 0}' \
  --mm-processor-kwargs "{\"max_pixels\": ${MAX_PIXELS:-1048576}}" \
  --max-num-seqs 64 \
  "$@"

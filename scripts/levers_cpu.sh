#!/usr/bin/env bash
# The exact speed levers on the CPU (docs/benchmarks.md, "The exact levers on ocr-mini"): the quickstart's recipe for
# 12 steps on the local engine, as shipped, with model.merge_lora, and merged + compiled, alternated in 2 rounds;
# prints each run's median s/step over steps 2-12.   usage: bash scripts/levers_cpu.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/levers_cpu}"
mkdir -p "$out"
. .venv/bin/activate
for rep in 1 2; do
  for v in base merge compile; do
    case $v in base) x=();; merge) x=(model.merge_lora=true);; compile) x=(model.merge_lora=true model.compile=true);; esac
    gerl train recipes/ocr_mini_awm.yaml output_dir="$out/${v}_$rep" overwrite=true max_steps=12 validation.every=-1 \
      checkpoint.every=0 log.images_every=0 log.tensorboard=false log.progress_bar=false engine.kind=local \
      ${x[@]+"${x[@]}"} > "$out/${v}_$rep.log" 2>&1
    python - "$out/${v}_$rep/metrics.jsonl" "$v" "$rep" <<'PY'
import json, statistics, sys
s = [json.loads(line).get("step_s") for line in open(sys.argv[1])]
s = [x for x in s if x is not None]
print(f"{sys.argv[2]} round {sys.argv[3]}: step 1 {s[0]:.1f} s, median of steps 2-{len(s)} {statistics.median(s[1:]):.2f} s")
PY
  done
done

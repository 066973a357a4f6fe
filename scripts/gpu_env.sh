# Source at the start of every command on a lent GPU machine (no network, ~64 MiB carried per call):
#   . scripts/gpu_env.sh && python -m benchmarks gpu_day --out "$OUT"      (scripts/gpu_day.sh does this)
# Installs the wheel bundles this call carried (.whl/gpu, .whl/ray from scripts/gpu_bundles.py; GERL_WHEELS to look
# elsewhere) into .site/ of this checkout — an ignored folder, which the machine keeps between calls while it stays
# warm, so that bundles carried by successive calls add up (each wheel is installed once); puts .site and this
# checkout on PYTHONPATH and a `gerl` command on PATH (the launchers call it). The image's own torch, transformers,
# peft, onnxruntime ... are used as they are. Returns 1 naming what is missing of what every phase needs (torch,
# diffusers, transformers, peft); rapidocr (the step phase's OCR) and Ray (the launcher phase) are only named when
# missing — the phases that need them are skipped, the others run.
_gerl_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_gerl_site="$_gerl_root/.site"
mkdir -p "$_gerl_site/bin" "$_gerl_site/.installed"
for _w in "${GERL_WHEELS:-$_gerl_root/.whl}"/*/*.whl; do
  [ -e "$_w" ] || continue
  [ -e "$_gerl_site/.installed/$(basename "$_w")" ] && continue
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$_gerl_site" "$_w" \
    || { echo "gpu_env: installing $_w failed" >&2; return 1; }
  touch "$_gerl_site/.installed/$(basename "$_w")"
done
export PYTHONPATH="$_gerl_site:$_gerl_root${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$_gerl_site/bin:$PATH"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
printf '#!/bin/sh\nexec python3 -m gerl.cli "$@"\n' > "$_gerl_site/bin/gerl"
chmod +x "$_gerl_site/bin/gerl"
python3 - <<'PY' || return 1
import importlib.metadata as md, importlib.util, sys
need = [m for m in ("torch", "diffusers", "transformers", "peft") if importlib.util.find_spec(m) is None]
if need:
    sys.exit(f"gpu_env: not installed: {', '.join(need)}; carry .whl/gpu (scripts/gpu_bundles.py makes it)")
import torch
versions = ", ".join(f"{m} {md.version(m)}" for m in ("diffusers", "transformers", "rapidocr", "ray")
                     if importlib.util.find_spec(m) is not None)
missing = [m for m in ("rapidocr", "ray") if importlib.util.find_spec(m) is None]
print(f"gpu_env: torch {torch.__version__} (CUDA {torch.cuda.is_available()}), {versions}"
      + (f"; without {', '.join(missing)} (the phases that need them are skipped)" if missing else ""))
PY

#!/usr/bin/env bash
# bash scripts/packaged_rewards_env.sh
# A venv in which hpsv2 1.2.0 and image-reward 1.5 run on CPU (GERL_PACKAGED_VENV, default .venv-prefs; ~5 min and
# 2 GB once), for tests/rewards/test_packaged_run.py (`pytest -m packaged`). Separate from gerl's own venv because
# image-reward 1.5 needs transformers<5 and hpsv2 pins pytest==7.2.0 and protobuf<4; the tests put the repo on
# PYTHONPATH. What it takes, each found here:
#   - torch 2.13.0+cpu first (a bare `torch` requirement pulls a CUDA build), then torchvision 0.28.0 as pip resolves
#     it (a CUDA build: gerl/torchvision_ops.py lets its pure-Python transforms import; the rewards arm it);
#   - "transformers<5" (image-reward's BLIP; gerl puts back three helpers it imports from their old place);
#   - clip-anytorch (image-reward imports `clip`) and setuptools<81 (clip imports pkg_resources);
#   - hpsv2's missing bpe_simple_vocab_16e6.txt.gz, copied from open_clip_torch's wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${GERL_PACKAGED_VENV:-.venv-prefs}"
READY="$VENV/.gerl-packaged-ready"
if [[ -f "$READY" ]]; then echo "packaged_rewards_env: $VENV ready ($(cat "$READY"))"; exit 0; fi
t0=$SECONDS
rm -rf "$VENV"
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" torch==2.13.0 "transformers<5" hpsv2==1.2.0 image-reward==1.5 clip-anytorch==2.6.0 "setuptools<81"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps -d "$TMP" open-clip-torch==3.3.0
HPS_DIR="$("$VENV/bin/python" -c 'import importlib.util as u; print(u.find_spec("hpsv2").submodule_search_locations[0])')"
"$VENV/bin/python" - "$TMP"/open_clip_torch-*.whl "$HPS_DIR/src/open_clip/bpe_simple_vocab_16e6.txt.gz" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    open(sys.argv[2], "wb").write(z.read("open_clip/bpe_simple_vocab_16e6.txt.gz"))
PY
"$VENV/bin/python" -c "import torch, transformers, hpsv2, importlib.metadata as m; print(f'torch {torch.__version__}, \
transformers {transformers.__version__}, hpsv2 {m.version(\"hpsv2\")}, image-reward {m.version(\"image-reward\")}')" > "$READY"
echo "packaged_rewards_env: $VENV built in $((SECONDS - t0)) s ($(du -sh "$VENV" | cut -f1)): $(cat "$READY")"

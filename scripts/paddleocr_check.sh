#!/usr/bin/env bash
# bash scripts/paddleocr_check.sh
# The OCR reward's `paddleocr` backend, offline, after `pip install 'gerl[paddleocr]'`: builds (or reuses) a venv with
# gerl and the extra (GERL_PADDLE_VENV, default .venv-paddle: ~4 min and 2 GB once), then, with no network
# (`unshare -n` where the kernel allows it) and an empty PaddleOCR cache, runs `gerl score ocr ... backend paddleocr`
# on a rendered image and scripts/ocr_parity.py (both backends on the same cases). Exit 0 when every reading agrees.
# The venv is separate because paddlepaddle, paddlex and x2paddle are not needed by anything else gerl runs.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${GERL_PADDLE_VENV:-.venv-paddle}"
READY="$VENV/.gerl-paddle-ready"
if [[ ! -f "$READY" ]]; then
  echo "paddleocr_check: building $VENV (torch 2.13.0+cpu, then pip install -e '.[paddleocr]'; a few minutes, once)" >&2
  t0=$SECONDS
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c scripts/pins.txt -e ".[paddleocr]"
  "$VENV/bin/python" -c "import paddle, paddleocr, x2paddle; print(f'paddlepaddle {paddle.__version__}')" > "$READY"
  echo "paddleocr_check: $VENV built in $((SECONDS - t0)) s ($(du -sh "$VENV" | cut -f1)): $(cat "$READY")" >&2
fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
OFFLINE=()
if unshare -n true 2>/dev/null; then OFFLINE=(unshare -n); else echo "paddleocr_check: unshare -n unavailable; the network stays up" >&2; fi
export PADDLE_PDX_CACHE_HOME="$WORK/paddlex" HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
"$VENV/bin/python" - "$WORK/sign.png" <<'PY'
import sys
sys.path.insert(0, "scripts")
from ocr_parity import render
render("OPEN LATE", 160, 20, False).save(sys.argv[1])
PY
t0=$SECONDS
"${OFFLINE[@]}" "$VENV/bin/gerl" score ocr "$WORK/sign.png" --prompt 'a sign that says "OPEN LATE"' \
  --kwargs '{"backend": "paddleocr"}' 2>"$WORK/score.err" | tee "$WORK/score.out" \
  || { tail -20 "$WORK/score.err" >&2; exit 1; }
echo "paddleocr_check: gerl score with backend paddleocr, models converted into an empty cache, in $((SECONDS - t0)) s" \
  "${OFFLINE[*]:+(no network)}"
"${OFFLINE[@]}" "$VENV/bin/python" scripts/ocr_parity.py 2>"$WORK/parity.err" | tail -13 \
  || { tail -20 "$WORK/parity.err" >&2; exit 1; }

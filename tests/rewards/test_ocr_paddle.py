"""The OCR reward's `paddleocr` backend, offline: PP-OCRv6 converted from rapidocr's ONNX files
(rewards/paddle_models.py).

`pytest -m paddleocr` runs scripts/paddleocr_check.sh where its venv is built (`bash scripts/paddleocr_check.sh`
builds .venv-paddle once: ~4 min, 2 GB; GERL_PADDLE_VENV names another): `gerl score` with backend paddleocr and an
empty model cache under `unshare -n`, then every parity case read alike by both backends. Without that venv it is
skipped (CI does not build it). The conversion's missing-tool error runs everywhere: gerl's own venv has no x2paddle.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from gerl.errors import UserError
from rewards import paddle_models

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("GERL_PADDLE_VENV", REPO / ".venv-paddle"))


@pytest.mark.skipif(importlib.util.find_spec("x2paddle") is not None, reason="x2paddle is installed here")
def test_missing_converter_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setenv("PADDLE_PDX_CACHE_HOME", str(tmp_path))
    assert paddle_models.cache_root() == tmp_path / "official_models"
    with pytest.raises(UserError) as err:
        paddle_models.ensure_models()
    assert "pip install 'gerl[paddleocr]'" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "official_models" / paddle_models.DET).exists()  # nothing half-written where PaddleOCR looks


@pytest.mark.paddleocr
@pytest.mark.slow
@pytest.mark.skipif(not (VENV / ".gerl-paddle-ready").is_file(),
                    reason=f"no PaddleOCR venv at {VENV}: `bash scripts/paddleocr_check.sh` builds it (~4 min, 2 GB)")
def test_paddleocr_backend_offline_agrees_with_rapidocr():
    run = subprocess.run(["bash", str(REPO / "scripts" / "paddleocr_check.sh")], cwd=REPO, capture_output=True,
                         text=True, timeout=1200, env={**os.environ, "GERL_PADDLE_VENV": str(VENV)})
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert '"ocr_text": "OPEN LATE"' in run.stdout and '"score": 1.0' in run.stdout  # gerl score, backend paddleocr
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("ocr_parity: 12/12 readings agree"), last

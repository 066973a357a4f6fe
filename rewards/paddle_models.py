"""PaddleOCR's PP-OCR models in Paddle format, derived offline from the ONNX files the `rapidocr` wheel ships.

PaddleOCR 3.x downloads its models at run time (from the Hugging Face hub, BOS or ModelScope), which a machine
without network cannot do, and no PyPI package ships PP-OCRv6 in Paddle format. rapidocr's wheel ships the PP-OCRv6
small detector and recogniser as ONNX (converted from Paddle's own inference models), and x2paddle converts ONNX
back to a Paddle static graph (`inference.json` + `inference.pdiparams`). `ensure_models()` does that once, writing
each model where PaddleOCR looks for it — `$PADDLE_PDX_CACHE_HOME/official_models/<name>/` (default
`~/.paddlex/official_models/`), under PaddleOCR's own names PP-OCRv6_small_det / PP-OCRv6_small_rec — with the
`inference.yml` PaddleX reads: pre- and post-processing as rapidocr runs these models (detector normalised with mean
and std 0.5, DB thresholds 0.3 / 0.5, unclip 1.6; recogniser 3x48x320, CTC over the character list stored in the
ONNX file's metadata). A `gerl_source.json` beside them names the ONNX file (and its sha256) they came from.

Measured on this project's CPU (docs/rewards.md): the converted graphs give the ONNX outputs to 2e-5 (recogniser
probabilities) and 1e-7 (detector map), and the paddleocr backend reads what the rapidocr backend reads.
The converted graphs do not run under Paddle's oneDNN executor (`ConvertPirAttribute2RuntimeAttribute not support
[pir::ArrayAttribute<pir::DoubleAttribute>]`), so the OCR reward runs them with `enable_mkldnn=False`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from gerl.errors import UserError

DET, REC = "PP-OCRv6_small_det", "PP-OCRv6_small_rec"  # PaddleOCR's names for what rapidocr ships as:
ONNX_FILES = {DET: "PP-OCRv6_det_small.onnx", REC: "PP-OCRv6_rec_small.onnx"}
MODEL_FILES = ("inference.json", "inference.pdiparams", "inference.yml")


def cache_root() -> Path:
    """Where PaddleX (PaddleOCR 3.x) keeps official models: $PADDLE_PDX_CACHE_HOME/official_models."""
    return Path(os.environ.get("PADDLE_PDX_CACHE_HOME", "~/.paddlex")).expanduser() / "official_models"


def rapidocr_onnx(name: str) -> Path:
    spec = importlib.util.find_spec("rapidocr")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("OCR backend 'paddleocr' derives its models from the rapidocr wheel's ONNX files, and "
                        "rapidocr is not installed: pip install 'gerl[paddleocr]'")
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / ONNX_FILES[name]
    if not path.is_file():
        raise UserError(f"OCR backend 'paddleocr': {path} is missing; gerl derives {name} from it "
                        f"(rapidocr 3.10 ships it: pip install 'rapidocr==3.10.0')")
    return path


def ensure_models() -> dict[str, Path]:
    """{model name: directory} of the detector and recogniser, converting them first where missing."""
    dirs = {}
    for name in (DET, REC):
        dest = cache_root() / name
        if not all((dest / f).is_file() for f in MODEL_FILES):
            convert(name, dest)
        dirs[name] = dest
    return dirs


def convert(name: str, dest: Path) -> None:
    """rapidocr's ONNX file of `name` → a Paddle static graph and its inference.yml in `dest` (x2paddle, ~30 s)."""
    if importlib.util.find_spec("x2paddle") is None or importlib.util.find_spec("onnx") is None:
        raise UserError(f"OCR backend 'paddleocr': {name} is not in {dest.parent} and converting it from rapidocr's "
                        "ONNX file needs x2paddle and onnx: pip install 'gerl[paddleocr]'")
    onnx_path = rapidocr_onnx(name)
    work = dest.parent / f".{name}.converting"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    # --disable_feedback: x2paddle otherwise reports each conversion to Baidu over the network
    run = subprocess.run([sys.executable, "-m", "x2paddle.convert", "--framework=onnx", f"--model={onnx_path}",
                          f"--save_dir={work}", "--disable_feedback", "True"], capture_output=True, text=True)
    graph = work / "inference_model"
    if run.returncode != 0 or not (graph / "model.json").is_file():
        tail = "\n".join((run.stdout + run.stderr).splitlines()[-15:])
        shutil.rmtree(work, ignore_errors=True)
        raise UserError(f"OCR backend 'paddleocr': converting {onnx_path.name} to Paddle format with x2paddle failed "
                        f"(exit {run.returncode}):\n{tail}")
    import yaml

    config = det_config() if name == DET else rec_config(onnx_path)
    (graph / "inference.yml").write_text(yaml.safe_dump({"Global": {"model_name": name}, **config},
                                                        allow_unicode=True, sort_keys=False))
    (graph / "model.json").rename(graph / "inference.json")
    (graph / "model.pdiparams").rename(graph / "inference.pdiparams")
    digest = hashlib.sha256(onnx_path.read_bytes()).hexdigest()
    (graph / "gerl_source.json").write_text(json.dumps({"converted_from": str(onnx_path), "sha256": digest,
                                                        "by": "x2paddle (gerl rewards/paddle_models.py)"}))
    shutil.rmtree(dest, ignore_errors=True)
    graph.rename(dest)  # complete or absent: a half-written model directory is never left where PaddleOCR looks
    shutil.rmtree(work, ignore_errors=True)


def det_config() -> dict:
    """PaddleX's inference.yml for the DB detector, with rapidocr's PP-OCRv6 settings."""
    return {
        "PreProcess": {"transform_ops": [
            {"DecodeImage": {"channel_first": False, "img_mode": "BGR"}},
            {"DetLabelEncode": None},
            {"DetResizeForTest": {"limit_side_len": 736, "limit_type": "min"}},
            {"NormalizeImage": {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "scale": 1 / 255, "order": "hwc"}},
            {"ToCHWImage": None},
            {"KeepKeys": {"keep_keys": ["image", "shape", "polys", "ignore_tags"]}},
        ]},
        "PostProcess": {"name": "DBPostProcess", "thresh": 0.3, "box_thresh": 0.5, "max_candidates": 1000,
                        "unclip_ratio": 1.6},
    }


def rec_config(onnx_path: Path) -> dict:
    """PaddleX's inference.yml for the CTC recogniser; its characters are the ONNX file's `character` metadata."""
    import onnx

    meta = {p.key: p.value for p in onnx.load(str(onnx_path), load_external_data=False).metadata_props}
    if "character" not in meta:
        raise UserError(f"OCR backend 'paddleocr': {onnx_path} carries no character list in its metadata")
    return {
        "PreProcess": {"transform_ops": [
            {"DecodeImage": {"channel_first": False, "img_mode": "BGR"}},
            {"MultiLabelEncode": {"gtc_encode": "NRTRLabelEncode"}},
            {"RecResizeImg": {"image_shape": [3, 48, 320]}},
            {"KeepKeys": {"keep_keys": ["image", "label_ctc", "label_gtc", "length", "valid_ratio"]}},
        ]},
        "PostProcess": {"name": "CTCLabelDecode", "character_dict": meta["character"].splitlines()},
    }

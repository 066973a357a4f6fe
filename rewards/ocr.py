"""Flow-GRPO's OCR reward: how closely the text an OCR model reads in the image matches the prompt's quoted text.

The prompt `A neon sign that says "OPEN LATE"` has target text `OPEN LATE`. Both the recognised text and the
target are lower-cased with whitespace removed; the score is 1.0 if the target occurs in the recognised
text, else `1 - min(levenshtein(recognised, target), len(target)) / len(target)`, which lies in [0, 1].

Two conventions differ from Flow-GRPO's and GeRL's code, which `strip="spaces"` and `strict_confidence=True`
reproduce (conventions.preset=flow_grpo / gerl_mm_grpo sets both): the peers treat only U+0020 as a space
(`str.replace(" ", "")`) where gerl removes every whitespace character (tabs, newlines, no-break spaces...), and
they keep recognised lines with confidence > 0 where gerl keeps those ≥ min_confidence (0.0). Under "spaces" the
rule holds everywhere, as in the peers: a recognised line of only a tab still counts (a character the target
lacks), and the quoted target keeps a tab or no-break space at its ends (`prompt.split('"')[1]`, not stripped).

Backends:
- `rapidocr` (default): PP-OCR ONNX models shipped inside the `rapidocr` wheel; CPU, offline.
- `paddleocr`: PaddleOCR 3.x (GPU-capable), an optional extra: `pip install gerl[paddleocr]`; offline, it runs the same
  PP-OCRv6 small models, converted once from rapidocr's ONNX files into PaddleOCR's cache (rewards/paddle_models.py).

`score="likelihood"` (rapidocr, rec_only) scores instead how likely the recogniser finds the target: the CTC
probability of the target string (whitespace removed, case as written) under the recogniser's per-frame character
distribution, as a per-character geometric mean `exp(log P(target | image) / len(target))` in [0, 1]. It is the
same recogniser, read densely: two images that the edit score ties (both read right, or both wrong) still differ
in how sure the recogniser is, which gives a GRPO group a signal where the edit score gives none. Validate with the
edit score (a weight-0 `ocr` reward component), since that is the metric the peers report.
"""

from __future__ import annotations

import importlib.util
import math
import threading

import numpy as np
import torch
import torch.nn.functional as F

from gerl.errors import UserError
from rewards.registry import register

BACKENDS = ("rapidocr", "paddleocr")
_OPEN_QUOTES = '"\u201c'  # " and “
_CLOSE_QUOTES = '"\u201d'  # " and ”


def extract_target(prompt: str, strip: str = "whitespace") -> str | None:
    """The text between the first pair of double quotes (straight `"..."` or curly `“...”`), stripped of whitespace
    (strip="whitespace") or of U+0020 spaces only (strip="spaces": the peers keep a tab at the ends, which counts).

    Returns None when there is no opening quote, the quote is never closed, or the quotes hold nothing to score.
    """
    start = next((i for i, ch in enumerate(prompt) if ch in _OPEN_QUOTES), None)
    if start is None:
        return None
    end = next((i for i in range(start + 1, len(prompt)) if prompt[i] in _CLOSE_QUOTES), None)
    if end is None:
        return None
    target = _strip_ends(prompt[start + 1 : end], strip)
    return target or None


def _strip_ends(text: str, strip: str) -> str:
    return text.strip() if strip == "whitespace" else text.strip(" ")


STRIP_MODES = ("whitespace", "spaces")
SCORE_MODES = ("edit", "likelihood")


def normalize_text(text: str, strip: str = "whitespace") -> str:
    """Lower-case and drop every whitespace character (strip="whitespace") or only U+0020 spaces ("spaces", the
    peers' `text.replace(" ", "").lower()`)."""
    if strip == "whitespace":
        return "".join(text.split()).lower()
    if strip == "spaces":
        return text.replace(" ", "").lower()
    raise ValueError(f"unknown OCR strip mode {strip!r}; choose one of {', '.join(STRIP_MODES)}")


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions all cost 1); O(len(a) * len(b)) time, O(len(b)) memory."""
    if a == b:
        return 0
    if len(a) < len(b):
        a, b = b, a  # keep the row (indexed by b) the short one
    if not b:
        return len(a)
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_score(recognized: str, target: str, strip: str = "whitespace") -> float:
    """Flow-GRPO's OCR score in [0, 1] of `recognized` text against `target` text (see the module docstring).

    Raises:
        ValueError: the target is empty after normalisation (nothing to score against).
    """
    recognized, target = normalize_text(recognized, strip), normalize_text(target, strip)
    if not target:
        raise ValueError("ocr_score needs a non-empty target text")
    if target in recognized:
        return 1.0
    return 1.0 - min(levenshtein(recognized, target), len(target)) / len(target)


def ctc_likelihood_score(log_probs: np.ndarray, target_ids: list[int], blank: int = 0) -> float:
    """exp(log P(target) / len(target)): the per-character geometric mean of the CTC probability of a label sequence.

    Args:
        log_probs: (T, C) per-frame log-probabilities of a CTC recogniser (each row sums to 1 in probability).
        target_ids: the target's label indices (non-empty, none equal to `blank`).
        blank: the CTC blank label.

    Returns:
        a score in [0, 1]; 0 when no alignment fits (the target needs more frames than T).
    """
    if not target_ids:
        raise ValueError("ctc_likelihood_score needs a non-empty target")
    lp = torch.as_tensor(np.asarray(log_probs, dtype=np.float32))[:, None, :]  # (T, 1, C)
    nll = F.ctc_loss(lp, torch.tensor([target_ids]), torch.tensor([lp.shape[0]]), torch.tensor([len(target_ids)]),
                     blank=blank, reduction="sum", zero_infinity=False)
    return 0.0 if not math.isfinite(float(nll)) else math.exp(-float(nll) / len(target_ids))


def target_for(prompt: str, metadata: dict | None, strip: str = "whitespace") -> str | None:
    """The target text of one sample: `metadata["target_text"]` when given, else the prompt's quoted text (its ends
    stripped as `extract_target` does for this strip mode)."""
    override = (metadata or {}).get("target_text")
    if override is not None:
        return _strip_ends(str(override), strip) or None
    return extract_target(prompt, strip)


class OcrReward:
    """Callable OCR reward; holds only its settings until the first call loads the OCR model in that process.

    Args:
        backend: "rapidocr" (ONNX, CPU, offline) or "paddleocr" (PaddleOCR 3.x, optional extra).
        rec_only: skip text detection and recognise the whole image as one text line. ~10x faster than detection
            on large images, but only right for images that are mostly a single line of text.
        det_limit_side_len: the detector scales images *down* so the longer side is at most this many pixels and
            never scales them up (limit type "max", PaddleOCR 2.x's default, which Flow-GRPO used). rapidocr's
            own default instead scales the *shorter* side up to 736 px, making a 64 px image cost as much as a
            736 px one.
        num_threads: threads per OCR call (onnxruntime intra-op threads, or PaddleOCR cpu_threads); 1 lets
            several reward worker processes share the CPU; 0 lets the runtime use every core.
        min_confidence: drop recognised text lines scored below this (0.0 keeps all but negative scores).
        strict_confidence: keep only lines scored strictly above min_confidence (the peers keep score > 0).
        strip: "whitespace" removes every whitespace character before comparing; "spaces" only U+0020 (the peers:
            a tab, newline or no-break space in a recognised line or at the target's ends then counts).
        paddle_kwargs: extra keyword arguments for `paddleocr.PaddleOCR` (e.g. {"device": "gpu:0", "lang": "en"}).
        score: "edit" (Flow-GRPO's score of the recognised text) or "likelihood" (the recogniser's CTC probability
            of the target, per character; rapidocr with rec_only only; see the module docstring).
    """

    name = "ocr"
    per_sample = True  # each image is scored on its own: a micro-batch may be split over the reward's workers

    def __init__(
        self,
        backend: str = "rapidocr",
        rec_only: bool = False,
        det_limit_side_len: int = 960,
        num_threads: int = 1,
        min_confidence: float = 0.0,
        paddle_kwargs: dict | None = None,
        strict_confidence: bool = False,
        strip: str = "whitespace",
        score: str = "edit",
    ):
        if score not in SCORE_MODES:
            raise UserError(f"unknown OCR score {score!r}; set reward.kwargs.score to one of {list(SCORE_MODES)}")
        if score == "likelihood" and (backend != "rapidocr" or not rec_only):
            raise UserError("OCR score 'likelihood' reads the rapidocr recogniser directly; set backend: rapidocr and "
                            "rec_only: true (or score: edit)")
        if strip not in STRIP_MODES:
            raise UserError(f"unknown OCR strip mode {strip!r}; set reward.kwargs.strip to one of {list(STRIP_MODES)}")
        if not isinstance(strict_confidence, bool):
            raise UserError(f"OCR strict_confidence must be true or false, got {strict_confidence!r}")
        if backend not in BACKENDS:
            raise UserError(f"unknown OCR backend {backend!r}; set reward.kwargs.backend to one of {list(BACKENDS)}")
        if backend == "paddleocr" and importlib.util.find_spec("paddleocr") is None:
            raise UserError(
                "OCR backend 'paddleocr' needs PaddleOCR 3.x: pip install 'gerl[paddleocr]' (or use backend rapidocr)"
            )
        if not isinstance(det_limit_side_len, int) or det_limit_side_len < 32:
            raise UserError(f"OCR det_limit_side_len must be an int >= 32 pixels, got {det_limit_side_len!r}")
        if not isinstance(num_threads, int) or num_threads < 0:
            raise UserError(f"OCR num_threads must be an int >= 0 (0 = all cores), got {num_threads!r}")
        if paddle_kwargs and backend != "paddleocr":
            raise UserError(
                "OCR paddle_kwargs only apply to backend 'paddleocr'; remove them or set backend: paddleocr"
            )
        self.backend = backend
        self.rec_only = bool(rec_only)
        self.det_limit_side_len = det_limit_side_len
        self.num_threads = num_threads
        self.min_confidence = float(min_confidence)
        self.strict_confidence, self.strip, self.score = strict_confidence, strip, score
        self.paddle_kwargs = dict(paddle_kwargs or {})
        self._engine = None
        self._lock = threading.Lock()  # reward threads may share one instance; load the model once

    # The engine (ONNX sessions) and the lock cannot be pickled; a copy sent to a worker process reloads lazily.
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_engine", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _engine=None, _lock=threading.Lock())

    def __call__(self, images, prompts, metadata) -> tuple[list[float | None], dict[str, list]]:
        """Score each image against its prompt's target text; None where a sample has no target text.

        Returns:
            (scores, {"ocr_text": the text recognised in each image})
        """
        if self.score == "likelihood":
            return self.likelihood(images, [target_for(p, m, self.strip) for p, m in zip(prompts, metadata)])
        scores, texts = [], []
        for image, prompt, meta in zip(images, prompts, metadata):
            target = target_for(prompt, meta, self.strip)
            text = self.read(image) if target is not None else ""
            scores.append(ocr_score(text, target, self.strip) if target is not None else None)
            texts.append(text)
        return scores, {"ocr_text": texts}

    def read(self, image) -> str:
        """All text lines recognised in a PIL image (those `keeps` passes), joined by spaces. A line of only
        whitespace is kept: strip="whitespace" removes it anyway, and under "spaces" a tab counts, as in the peers'
        `"".join(...)`."""
        # Both backends take a numpy array to be BGR (OpenCV's order). (H, W, 3) uint8
        bgr = np.ascontiguousarray(np.asarray(image.convert("RGB"))[:, :, ::-1])
        engine = self._load()
        if self.backend == "rapidocr":
            res = engine(bgr)
            scored = list(zip(res.txts or (), res.scores or ()))  # None when nothing was found
        elif self.rec_only:
            scored = [(r["rec_text"], r["rec_score"]) for r in engine.predict(bgr)]
        else:
            scored = [ts for r in engine.predict(bgr) for ts in zip(r["rec_texts"], r["rec_scores"])]
        return " ".join(t for t, score in scored if self.keeps(float(score)))

    def likelihood(self, images, targets: list[str | None]) -> tuple[list[float | None], dict[str, list]]:
        """score="likelihood": one batched recogniser pass; each image's CTC score of its target (None: no target).

        Returns:
            (scores, {"ocr_text": the recogniser's greedy reading of each image})
        """
        rec = self._load()._load_rec_model()  # rapidocr's TextRecognizer: preprocessing, ONNX session, CTC decoder
        _, height, width = rec.rec_image_shape
        batch = np.concatenate([
            rec.resize_norm_img(np.ascontiguousarray(np.asarray(im.convert("RGB"))[:, :, ::-1]), width / height)[None]
            for im in images
        ]).astype(np.float32)
        probs = rec.session(batch)  # (N, frames, classes), softmax over classes; class 0 is the CTC blank
        texts = [text for text, _ in rec.postprocess_op(probs)[0]]
        log_probs = np.log(np.clip(probs, 1e-30, 1.0))
        scores = [
            None if t is None else ctc_likelihood_score(log_probs[i], self.label_ids(rec, t))
            for i, t in enumerate(targets)
        ]
        return scores, {"ocr_text": texts}

    @staticmethod
    def label_ids(rec, target: str) -> list[int]:
        """The recogniser's label indices of `target` with whitespace removed; ValueError naming an unknown char."""
        chars = "".join(target.split())
        missing = sorted({ch for ch in chars if ch not in rec.postprocess_op.dict})
        if missing or not chars:
            raise ValueError(f"the OCR recogniser cannot write {''.join(missing) or 'an empty target'!r}")
        return [rec.postprocess_op.dict[ch] for ch in chars]

    def keeps(self, confidence: float) -> bool:
        """Whether a recognised line with this confidence counts (≥ min_confidence, or > with strict_confidence)."""
        return confidence > self.min_confidence if self.strict_confidence else confidence >= self.min_confidence

    def validate(self, prompts: list[str], metadata: list[dict]) -> None:
        """Raise UserError naming the prompts that have no target text (so they could never be scored)."""
        metadata = metadata or [{}] * len(prompts)
        bad = [i for i, (p, m) in enumerate(zip(prompts, metadata)) if target_for(p, m, self.strip) is None]
        if bad:
            first = bad[0]
            raise UserError(
                f"OCR reward: {len(bad)} of {len(prompts)} prompts have no target text, first is prompt #{first + 1} "
                f"{prompts[first][:80]!r}; put the text to render in \"double quotes\" in each prompt or give a "
                f"non-empty target_text field (.jsonl)"
            )
        if self.score == "likelihood":
            rec = self._load()._load_rec_model()
            for i, (p, m) in enumerate(zip(prompts, metadata)):
                try:
                    self.label_ids(rec, target_for(p, m, self.strip))
                except ValueError as e:
                    raise UserError(f"OCR score 'likelihood': prompt #{i + 1} {p[:80]!r}: {e}; use score: edit")

    def _load(self):
        if self._engine is None:
            with self._lock:
                if self._engine is None:
                    self._engine = self._build_rapidocr() if self.backend == "rapidocr" else self._build_paddleocr()
        return self._engine

    def _build_rapidocr(self):
        from rapidocr import RapidOCR  # imported here: ~1 s, and only the processes that score need it

        threads = self.num_threads or -1  # -1 = onnxruntime's default (all cores)
        return RapidOCR(
            params={
                "Global.log_level": "error",
                "Global.use_cls": False,  # generated text is upright; the 180-degree classifier only costs time
                "Global.use_det": not self.rec_only,
                "Global.text_score": self.min_confidence,
                "Det.limit_side_len": self.det_limit_side_len,
                "Det.limit_type": "max",
                "EngineConfig.onnxruntime.intra_op_num_threads": threads,
                "EngineConfig.onnxruntime.inter_op_num_threads": 1 if self.num_threads else -1,
            }
        )

    def _build_paddleocr(self):
        try:
            import paddleocr
        except ImportError as e:
            raise UserError(f"OCR backend 'paddleocr' failed to import ({e}); pip install 'gerl[paddleocr]'")
        import os

        from rewards import paddle_models as pm

        # Offline by default: PaddleX otherwise probes its model hosts at start-up. The models are the PP-OCRv6 small
        # pair rapidocr ships (so both backends read with the same weights), converted once into PaddleOCR's cache
        # (rewards/paddle_models.py) unless paddle_kwargs name other models. The converted graphs need
        # enable_mkldnn=False (Paddle's oneDNN executor rejects one of their attributes).
        os.environ.setdefault("PADDLE_PDX_DISABLE_MODEL_SOURCE_CHECK", "True")
        common = {"cpu_threads": self.num_threads} if self.num_threads else {}
        kw = dict(self.paddle_kwargs)
        if self.rec_only:
            if not {"model_name", "model_dir"} & kw.keys():
                kw = {"model_name": pm.REC, "model_dir": str(pm.ensure_models()[pm.REC]), "enable_mkldnn": False,
                      **kw}
            return paddleocr.TextRecognition(**common, **kw)
        if not {"text_detection_model_name", "text_recognition_model_name"} & kw.keys():
            dirs = pm.ensure_models()
            kw = {"text_detection_model_name": pm.DET, "text_detection_model_dir": str(dirs[pm.DET]),
                  "text_recognition_model_name": pm.REC, "text_recognition_model_dir": str(dirs[pm.REC]),
                  "enable_mkldnn": False, **kw}
        return paddleocr.PaddleOCR(
            use_doc_orientation_classify=False,
            use_doc_unwarping=False,
            use_textline_orientation=False,
            text_det_limit_side_len=self.det_limit_side_len,
            text_det_limit_type="max",
            text_rec_score_thresh=self.min_confidence,
            **{**common, **kw},
        )


@register("ocr")
def ocr(
    backend: str = "rapidocr",
    rec_only: bool = False,
    det_limit_side_len: int = 960,
    num_threads: int = 1,
    min_confidence: float = 0.0,
    paddle_kwargs: dict | None = None,
    strict_confidence: bool = False,
    strip: str = "whitespace",
    score: str = "edit",
) -> OcrReward:
    """Flow-GRPO's OCR reward (see `OcrReward` for the arguments)."""
    return OcrReward(backend, rec_only, det_limit_side_len, num_threads, min_confidence, paddle_kwargs,
                     strict_confidence, strip, score)

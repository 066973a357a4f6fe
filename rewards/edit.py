"""An image-editing reward: did the edit write the asked-for text, compared with the image it started from?

An edit prompt file (assets/edit/train.jsonl) gives each prompt a conditioning image; the rollout hands it to every
reward as `metadata["source_image"]` (PIL, RGB) beside its path `metadata["image"]`. `edit_ocr` reads both images
with the OCR reward's engine and scores the target text (`target_text`, else the prompt's quoted text) as the `ocr`
reward does (1 when it is read, else 1 − edit distance / length):

    baseline: none    score = OCR(edited)                     (the edited text is right)
    baseline: source  score = OCR(edited) − OCR(source)       (the edit made the text more right than it was)

Extras per sample: `ocr_text` (read in the edited image), `source_ocr_text`, `source_ocr` (the source image's score).
The source image is read once per file per reward instance (a group's n samples share it). A custom edit reward
that compares the pictures instead is in docs/rewards.md.
"""

from __future__ import annotations

from gerl.errors import UserError
from rewards.ocr import OcrReward, ocr_score, target_for
from rewards.registry import register

BASELINES = ("none", "source")


class EditOcrReward(OcrReward):
    """OcrReward on the edited image, optionally less its score on the source image (see the module docstring).

    Args:
        baseline: "none" or "source".
        **ocr: OcrReward's arguments (backend, rec_only, …).
    """

    name = "edit_ocr"

    def __init__(self, baseline: str = "none", **ocr):
        if baseline not in BASELINES:
            raise UserError(f"unknown edit_ocr baseline {baseline!r}; set reward.kwargs.baseline to one of "
                            f"{list(BASELINES)}")
        if ocr.get("score", "edit") != "edit":
            raise UserError("edit_ocr scores the recognised text (score: edit); use the ocr reward for 'likelihood'")
        super().__init__(**ocr)
        self.baseline = baseline
        self._source: dict[str, tuple[str, float]] = {}  # (path, target) → (text read, score) of the source image

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_source": {}}

    def __call__(self, images, prompts, metadata):
        scores, extras = super().__call__(images, prompts, metadata)
        src_text, src_score = [], []
        for i, (prompt, meta) in enumerate(zip(prompts, metadata)):
            target = target_for(prompt, meta, self.strip)
            if target is None or scores[i] is None:
                src_text.append("")
                src_score.append(None)
                continue
            key = f"{meta['image']}\0{target}"
            if key not in self._source:
                text = self.read(meta["source_image"])
                self._source[key] = (text, ocr_score(text, target, self.strip))
            text, before = self._source[key]
            src_text.append(text)
            src_score.append(before)
            if self.baseline == "source":
                scores[i] = scores[i] - before
        return scores, {**extras, "source_ocr_text": src_text, "source_ocr": src_score}

    def validate(self, prompts: list[str], metadata: list[dict]) -> None:
        """The OCR reward's check (every prompt has a target text), and every prompt has a source image."""
        super().validate(prompts, metadata)
        missing = [i for i, m in enumerate(metadata or [{}] * len(prompts)) if not (m or {}).get("image")]
        if missing:
            raise UserError(f"edit_ocr compares each edit with its source image: {len(missing)} of {len(prompts)} "
                            f"prompts have none, first is prompt #{missing[0] + 1} {prompts[missing[0]][:80]!r}; "
                            'use a .jsonl prompt file with {"prompt": ..., "image": PATH} lines')


@register("edit_ocr")
def edit_ocr(
    baseline: str = "none",
    backend: str = "rapidocr",
    rec_only: bool = False,
    det_limit_side_len: int = 960,
    num_threads: int = 1,
    min_confidence: float = 0.0,
    paddle_kwargs: dict | None = None,
    strict_confidence: bool = False,
    strip: str = "whitespace",
) -> EditOcrReward:
    """OCR of the edited text in an edited image, optionally less the source image's (see `EditOcrReward`; the other
    arguments are the ocr reward's)."""
    return EditOcrReward(baseline, backend=backend, rec_only=rec_only, det_limit_side_len=det_limit_side_len,
                         num_threads=num_threads, min_confidence=min_confidence, paddle_kwargs=paddle_kwargs,
                         strict_confidence=strict_confidence, strip=strip)

"""rewards/edit.py: the edit_ocr reward reads the edited image and the source image the rollout hands it
(metadata["source_image"]), on assets/edit's example signs; rapidocr, offline."""

from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from gerl.data.prompts import load_prompts, with_source_images
from gerl.errors import UserError
from rewards.registry import build_reward, call_reward, validate_reward_inputs

REPO = Path(__file__).resolve().parents[2]


def sign(word: str) -> Image.Image:
    """The edit done right: assets/edit's sign drawn with the target word."""
    im = Image.new("RGB", (96, 64), (200, 200, 190))
    d = ImageDraw.Draw(im)
    d.rectangle([8, 14, 88, 50], fill=(90, 60, 40), outline=(20, 20, 20))
    d.text((16, 26), word, fill=(250, 250, 250))
    return im


@pytest.fixture(scope="module")
def edit_prompts():
    loaded = load_prompts(REPO / "assets" / "edit" / "train.jsonl")[:2]  # CLOSED → "OPEN", SALE → "SOLD"
    return [p.text for p in loaded], with_source_images([p.metadata for p in loaded])


def test_edit_ocr_scores_the_edit_and_with_a_source_baseline_its_gain(edit_prompts):
    """By hand: the source sign reads CLOSED against the target OPEN — edit distance 4, the target's 4
    letters: 1 − 4/4 = 0; SALE against SOLD — two substitutions: 1 − 2/4 = 0.5. The edited images read OPEN (1) and
    SALE (0.5: an edit that changed nothing gains nothing)."""
    prompts, meta = edit_prompts
    edited = [sign("OPEN"), Image.open(meta[1]["image"]).convert("RGB")]
    plain = build_reward("edit_ocr", {"rec_only": True})
    scores, extras = call_reward(plain, edited, prompts, meta)
    assert scores == [1.0, 0.5] and extras["source_ocr"] == [0.0, 0.5]
    assert extras["ocr_text"] == ["OPEN", "SALE"] and extras["source_ocr_text"] == ["CLOSED", "SALE"]
    gain = build_reward("edit_ocr", {"rec_only": True, "baseline": "source"})
    assert call_reward(gain, edited, prompts, meta)[0] == [1.0, 0.0]


def test_edit_ocr_needs_each_prompt_s_source_image(edit_prompts):
    prompts, meta = edit_prompts
    fn = build_reward("edit_ocr", {})
    validate_reward_inputs(fn, prompts, meta)
    with pytest.raises(UserError, match="prompt #2 .* use a .jsonl prompt file"):
        validate_reward_inputs(fn, prompts, [meta[0], {"target_text": "SOLD"}])
    with pytest.raises(UserError, match="unknown edit_ocr baseline"):
        build_reward("edit_ocr", {"baseline": "target"})

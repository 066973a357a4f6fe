"""The OCR reward: target extraction, the score formula, and real rapidocr reads of PIL-rendered text."""

import itertools
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from gerl.config import load_config
from gerl.errors import UserError
from rewards import build_reward, call_reward, validate_reward_inputs
from rewards.ocr import OcrReward, ctc_likelihood_score, extract_target, levenshtein, ocr_score, target_for


def render(text: str, size: int = 128, font_size: int = 20) -> Image.Image:
    """Black text centred on a white square; load_default(size=...) needs no system font."""
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=font_size)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((size - (right - left)) / 2 - left, (size - (bottom - top)) / 2 - top), text, fill="black", font=font)
    return image


@pytest.fixture(scope="module")
def reward():
    return build_reward("ocr", {})


# ---- target extraction -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "prompt, expected",
    [
        ('A sign that says "OPEN LATE"', "OPEN LATE"),
        ('First "one" then "two"', "one"),
        ("A sign with no quotes", None),
        ('A sign with one " quote', None),
        ('Empty quotes "" here', None),
        ('Blank quotes "   " here', None),
        ("Curly \u201cHello World\u201d quotes", "Hello World"),
        ('Padded "  hi  " text', "hi"),
    ],
)
def test_extract_target(prompt, expected):
    assert extract_target(prompt) == expected


def test_extract_target_under_spaces_strips_only_spaces():
    assert extract_target('A sign "\tOPEN\t"') == "OPEN"
    assert extract_target('A sign "\tOPEN\t"', "spaces") == "\tOPEN\t"  # the peers' prompt.split('"')[1]
    assert extract_target('A sign "  \u00a0OPEN "', "spaces") == "\u00a0OPEN"
    assert extract_target('Blank "   " here', "spaces") is None  # nothing left to score (the peers divide by 0)
    assert target_for("no quotes", {"target_text": "\nhi "}, "spaces") == "\nhi"
    assert target_for("no quotes", {"target_text": "\nhi "}) == "hi"


# ---- score formula ----------------------------------------------------------------------------------------------

def test_levenshtein():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert levenshtein("abc", "abc") == 0
    assert levenshtein("flaw", "lawn") == 2
    assert levenshtein("ab", "ba") == 2  # plain Levenshtein: no transpositions


def test_score_exact_containment_and_normalisation():
    assert ocr_score("OPEN LATE", "open late") == 1.0
    assert ocr_score("o p e n\tl a t e", "OPENLATE") == 1.0  # all whitespace removed
    assert ocr_score("Welcome! open late tonight", "Open Late") == 1.0  # target contained in more text


def test_score_partial_and_cap():
    assert ocr_score("Hallo World", "Hello World") == pytest.approx(1 - 1 / 10)
    assert ocr_score("", "hello") == 0.0
    # A long wrong reading has distance > len(target); the cap keeps the score at 0, not negative.
    assert ocr_score("zzzzzzzzzzzzzzzzzzzz", "abc") == 0.0


def test_score_rejects_empty_target():
    with pytest.raises(ValueError):
        ocr_score("anything", "  ")


# ---- real OCR ---------------------------------------------------------------------------------------------------

def test_exact_text_scores_one_blank_scores_zero_typo_in_between(reward):
    images = [render("Hello World"), Image.new("RGB", (128, 128), "white"), render("Hallo World")]
    prompts = ['A sign that says "Hello World"'] * 3
    scores, extras = call_reward(reward, images, prompts, [{}] * 3)
    exact, blank, typo = scores
    assert exact >= 0.95
    assert blank <= 0.05
    assert blank < typo < exact
    assert len(extras["ocr_text"]) == 3 and extras["ocr_text"][1] == ""


def test_small_64px_image(reward):
    scores, _ = call_reward(reward, [render("OPEN", size=64, font_size=14)], ['"OPEN"'], [{}])
    assert scores[0] >= 0.95


def test_metadata_target_overrides_prompt(reward):
    image = render("Hello World")
    scores, _ = call_reward(reward, [image, image], ["no quotes here", 'says "Goodbye"'],
                            [{"target_text": "hello world"}, {"target_text": "hello world"}])
    assert scores[0] >= 0.95 and scores[1] >= 0.95


def test_prompt_without_target_is_not_applicable(reward):
    scores, _ = call_reward(reward, [render("Hello")], ["a photo of a dog"], [{}])
    assert scores == [None]


def test_rec_only_reads_a_text_line():
    reward = build_reward("ocr", {"rec_only": True})
    line = render("OPEN LATE", size=160, font_size=24).crop((0, 60, 160, 100))  # a 160x40 strip of text
    blank = Image.new("RGB", (160, 40), "white")
    scores, extras = call_reward(reward, [line, blank], ['"OPEN LATE"'] * 2, [{}, {}])
    assert scores[0] >= 0.95, extras
    assert scores[1] <= 0.05


def test_validate_names_the_bad_prompt(reward):
    prompts = ['fine "text"', "no target here", 'also "fine"']
    with pytest.raises(UserError, match=r"1 of 3 prompts.*#2.*no target here.*double quotes"):
        validate_reward_inputs(reward, prompts, [{}, {}, {}])
    validate_reward_inputs(reward, prompts, [{}, {"target_text": "ok"}, {}])  # metadata fixes it
    with pytest.raises(UserError):
        validate_reward_inputs(reward, ['"x"'], [{"target_text": "  "}])  # an empty override is no target


def test_pickles_without_the_loaded_model(reward):
    reward(images=[render("A")], prompts=['"A"'], metadata=[{}])  # make sure the engine is loaded
    clone = pickle.loads(pickle.dumps(reward))
    assert clone._engine is None and clone.det_limit_side_len == reward.det_limit_side_len
    assert clone([render("Hello World")], ['"Hello World"'], [{}])[0][0] >= 0.95


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"backend": "tesseract"}, "unknown OCR backend"),
        ({"det_limit_side_len": 8}, "det_limit_side_len"),
        ({"num_threads": -1}, "num_threads"),
        ({"paddle_kwargs": {"lang": "en"}}, "paddle_kwargs only apply"),
        ({"score": "confidence"}, "unknown OCR score"),
        ({"score": "likelihood"}, "rec_only: true"),
        ({"score": "likelihood", "rec_only": True, "backend": "paddleocr"}, "backend: rapidocr"),
    ],
)
def test_bad_settings_are_user_errors(kwargs, match):
    with pytest.raises(UserError, match=match):
        OcrReward(**kwargs)


def test_paddleocr_missing_is_a_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "paddleocr" else real(name, *a))
    with pytest.raises(UserError, match=r"pip install 'gerl\[paddleocr\]'"):
        build_reward("ocr", {"backend": "paddleocr"})


# ---- normalisation conventions (conventions.preset=flow_grpo / gerl_mm_grpo set strip=spaces, strict_confidence) ---

def peer_ocr_reward(lines: list[tuple[str, float]], prompt: str) -> float:
    """Flow-GRPO's flow_grpo/ocr.py and GeRL's reward_score/ocr.py with its text_dataset.get_ground_truth, written
    out (python-Levenshtein's distance = ours): every line with score > 0 joined with "", a whitespace-only one
    included; the target is prompt.split('"')[1], unstripped; only U+0020 is removed from either."""
    recognized = "".join(t if score > 0 else "" for t, score in lines).replace(" ", "").lower()
    target = prompt.split('"')[1].replace(" ", "").lower()
    dist = 0 if target in recognized else levenshtein(recognized, target)
    return 1 - min(dist, len(target)) / len(target)


class FakeOcrEngine:
    """Stands in for the loaded rapidocr engine: every image reads as these (text, confidence) lines."""

    def __init__(self, lines: list[tuple[str, float]]):
        self.lines = lines

    def __call__(self, bgr):
        return SimpleNamespace(txts=tuple(t for t, _ in self.lines) or None,
                               scores=tuple(s for _, s in self.lines) or None)


def score_lines(kwargs: dict, lines: list[tuple[str, float]], prompt: str) -> float:
    """OcrReward's whole path (target extraction, line filter, join, score) on an image that reads as `lines`."""
    reward = build_reward("ocr", kwargs)
    reward._engine = FakeOcrEngine(lines)
    scores, _ = call_reward(reward, [Image.new("RGB", (32, 32), "white")], [prompt], [{}])
    return scores[0]


def preset_ocr_kwargs(preset: str) -> dict:
    return load_config(None, [f"conventions.preset={preset}"]).reward.kwargs


def test_normalize_text_modes():
    from rewards.ocr import normalize_text
    text = "Open\tLATE\nnow\u00a0here now"
    assert normalize_text(text) == "openlatenowherenow"  # every whitespace character (gerl)
    assert normalize_text(text, "spaces") == "open\tlate\nnow\u00a0herenow"  # only U+0020 (peers)
    with pytest.raises(ValueError, match="whitespace, spaces"):
        normalize_text(text, "tabs")


@pytest.mark.parametrize("preset", ["flow_grpo", "gerl_mm_grpo"])
@pytest.mark.parametrize("lines, prompt", [
    ([("OPEN LATE", 0.9)], 'A sign "Open Late"'),
    ([("OPEN\tLATE", 0.9)], 'A sign "Open Late"'),  # a tab: the peers keep it, so no containment
    ([("OPEN", 0.8), ("LATE", 0.0)], 'A sign "Open Late"'),  # a zero-confidence line: the peers drop it
    ([("Hallo", 0.7), ("World", 0.6)], 'says "Hello World"'),
    ([("x\u00a0y", 0.5)], 'says "x y"'),
    ([], 'says "abc"'),
    ([("HELLO", 0.9), ("\t", 0.9), ("WORLD", 0.9)], 'A sign that says "HELLO WORLD"'),  # a whitespace-only line
    ([("HELLO", 0.9), ("\u00a0", 0.8), ("\n", 0.7), ("WORLD", 0.9)], 'A sign that says "HELLO WORLD"'),
    ([("OPEN", 0.9)], 'A sign that says "\tOPEN\t"'),  # the target keeps its tabs
    ([("OPEN", 0.9)], 'A sign that says "\u00a0OPEN\n"'),
    ([("\tOPEN\t", 0.9)], 'A sign that says "\tOPEN\t"'),
])
def test_preset_scores_match_the_peers_formula(preset, lines, prompt):
    assert score_lines(preset_ocr_kwargs(preset), lines, prompt) == pytest.approx(peer_ocr_reward(lines, prompt),
                                                                                  abs=1e-12)


@pytest.mark.parametrize("preset", ["flow_grpo", "gerl_mm_grpo"])
def test_the_issues_examples_score_as_the_peers_under_the_presets(preset):
    kw = preset_ocr_kwargs(preset)
    hello = [("HELLO", 0.9), ("\t", 0.9), ("WORLD", 0.9)]
    # "hello\tworld" against "helloworld": one insertion in 10 characters
    assert score_lines(kw, hello, 'A sign that says "HELLO WORLD"') == pytest.approx(0.9)
    # "open" against "\topen\t": two insertions in 6 characters
    assert score_lines(kw, [("OPEN", 0.9)], 'A sign that says "\tOPEN\t"') == pytest.approx(1 - 2 / 6)
    assert peer_ocr_reward(hello, 'A sign that says "HELLO WORLD"') == pytest.approx(0.9)
    assert peer_ocr_reward([("OPEN", 0.9)], 'A sign that says "\tOPEN\t"') == pytest.approx(1 - 2 / 6)


def test_gerls_default_ignores_every_whitespace_character():
    assert score_lines({}, [("HELLO", 0.9), ("\t", 0.9), ("WORLD", 0.9)], 'A sign that says "HELLO WORLD"') == 1.0
    assert score_lines({}, [("OPEN", 0.9)], 'A sign that says "\tOPEN\t"') == 1.0


def test_confidence_rules():
    assert OcrReward().keeps(0.0) and not OcrReward(strict_confidence=True).keeps(0.0)
    assert OcrReward(strict_confidence=True).keeps(1e-6)
    assert not OcrReward(min_confidence=0.5).keeps(0.49) and OcrReward(min_confidence=0.5).keeps(0.5)
    with pytest.raises(UserError, match="strip"):
        OcrReward(strip="tabs")


def test_peer_settings_read_real_text():
    reward = build_reward("ocr", {"strip": "spaces", "strict_confidence": True})
    scores, extras = call_reward(reward, [render("Hello World")], ['"Hello World"'], [{}])
    assert scores[0] >= 0.95, extras


# ---- score="likelihood": the recogniser's CTC probability of the target -------------------------------------------

def brute_force_ctc(probs: np.ndarray, target: list[int], blank: int = 0) -> float:
    """P(target) by summing every frame path that collapses (merge repeats, drop blanks) to the target."""
    total = 0.0
    for path in itertools.product(range(probs.shape[1]), repeat=probs.shape[0]):
        collapsed = [c for i, c in enumerate(path) if c != blank and (i == 0 or c != path[i - 1])]
        if collapsed == target:
            total += float(np.prod([probs[t, c] for t, c in enumerate(path)]))
    return total


@pytest.mark.parametrize("target", [[1], [1, 2], [2, 2], [1, 2, 1]])
def test_ctc_likelihood_matches_the_sum_over_alignments(target):
    probs = np.random.default_rng(len(target)).dirichlet(np.ones(3), size=5)  # 5 frames, blank + 2 labels
    expected = brute_force_ctc(probs, target) ** (1 / len(target))
    assert ctc_likelihood_score(np.log(probs), target) == pytest.approx(expected, rel=1e-5)


def test_ctc_likelihood_edges():
    frames = np.log(np.full((2, 3), 1 / 3))
    assert ctc_likelihood_score(frames, [1, 1, 1]) == 0.0  # "aaa" needs 5 frames (a blank between repeats)
    sure = np.log(np.array([[1e-9, 1 - 2e-9, 1e-9], [1 - 2e-9, 1e-9, 1e-9]]))  # "a" then blank
    assert ctc_likelihood_score(sure, [1]) == pytest.approx(1.0, abs=1e-6)
    assert ctc_likelihood_score(sure, [2]) < 1e-4
    with pytest.raises(ValueError):
        ctc_likelihood_score(sure, [])


def test_likelihood_score_ranks_legible_above_wrong_and_blank():
    reward = build_reward("ocr", {"rec_only": True, "score": "likelihood"})
    line = render("2048", size=160, font_size=24).crop((0, 60, 160, 100))
    blank = Image.new("RGB", (160, 40), "white")
    scores, extras = call_reward(reward, [line, line, blank], ['"2048"', '"2049"', '"2048"'], [{}] * 3)
    assert extras["ocr_text"][0] == "2048"
    assert scores[0] > 0.9 > 0.5 > scores[1] > scores[2]  # one wrong digit of four costs, not all of it
    assert scores[1] > 1e-3  # and is not zero: the other three characters still count


def test_likelihood_names_a_character_the_recogniser_cannot_write():
    reward = build_reward("ocr", {"rec_only": True, "score": "likelihood"})
    with pytest.raises(UserError, match=r"prompt #2 .*cannot write .*score: edit"):
        validate_reward_inputs(reward, ['a "42"', 'a "4\u16a0"'], [{}, {}])  # a runic letter

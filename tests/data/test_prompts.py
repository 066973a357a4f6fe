"""Prompt datasets (.txt / .jsonl), their errors, and the seeded resumable sampler; plus the shipped OCR sets."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from gerl.data import Prompt, PromptSampler, load_prompts
from gerl.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# ---- loading ----------------------------------------------------------------------------------------------------

def test_txt_one_prompt_per_line_blank_lines_skipped(tmp_path):
    path = write(tmp_path / "p.txt", 'A sign that says "OPEN"\n\n   \n  A cake with "Happy Birthday"  \n')
    assert load_prompts(path) == [Prompt('A sign that says "OPEN"'), Prompt('A cake with "Happy Birthday"')]


def test_jsonl_prompt_plus_metadata(tmp_path):
    lines = [{"prompt": "a cat", "target_text": "meow", "id": 3}, {"prompt": "a dog"}]
    path = write(tmp_path / "p.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert load_prompts(path) == [Prompt("a cat", {"target_text": "meow", "id": 3}), Prompt("a dog", {})]


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("p.csv", "a,b\n", r"unknown extension '\.csv'.*\.txt, \.jsonl"),
        ("p.txt", "\n  \n", r"p\.txt has no prompts"),
        ("p.jsonl", '{"prompt": "ok"}\n{"prompt": oops}\n', r"p\.jsonl:2: bad JSON"),
        ("p.jsonl", '{"prompt": "ok"}\n\n{"text": "no prompt"}\n', r"p\.jsonl:3: missing or empty \"prompt\""),
        ("p.jsonl", '["a list"]\n', r"p\.jsonl:1: expected a JSON object"),
    ],
)
def test_bad_files_are_one_line_user_errors(tmp_path, name, content, match):
    path = write(tmp_path / name, content)
    with pytest.raises(UserError, match=match) as info:
        load_prompts(path)
    assert "\n" not in str(info.value)


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_prompts(tmp_path / "nope.txt")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xfa not utf-8")
    with pytest.raises(UserError, match="UTF-8"):
        load_prompts(tmp_path / "bad.txt")


# ---- sampler ----------------------------------------------------------------------------------------------------

PROMPTS = [Prompt(f"prompt {i}") for i in range(10)]


def draw(sampler: PromptSampler, steps: int) -> list[list[int]]:
    return [sampler.next_indices() for _ in range(steps)]


def test_same_seed_same_sequence_other_seed_differs():
    assert draw(PromptSampler(PROMPTS, 3, seed=1), 6) == draw(PromptSampler(PROMPTS, 3, seed=1), 6)
    assert draw(PromptSampler(PROMPTS, 3, seed=1), 6) != draw(PromptSampler(PROMPTS, 3, seed=2), 6)


def test_resume_draws_exactly_what_an_uninterrupted_run_draws():
    uninterrupted = draw(PromptSampler(PROMPTS, 4, seed=7), 5)  # crosses two epoch boundaries (10 // 4 = 2 steps)

    first = PromptSampler(PROMPTS, 4, seed=7)
    head = draw(first, 2)
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON round trip
    resumed = PromptSampler(PROMPTS, 4, seed=0)  # the seed comes back from the state
    resumed.load_state_dict(state)
    assert head + draw(resumed, 3) == uninterrupted


def test_steps_are_distinct_and_an_epoch_has_no_repeats():
    sampler = PromptSampler(PROMPTS, 3, seed=0)
    epoch = draw(sampler, 3)  # 3 full steps of 3; the 10th prompt is the skipped tail
    flat = [i for step in epoch for i in step]
    assert all(len(set(step)) == 3 for step in epoch)
    assert len(set(flat)) == 9
    assert sampler.state_dict()["epoch"] == 0
    next_step = sampler.next_indices()  # rolls over into a fresh permutation
    assert sampler.state_dict()["epoch"] == 1 and len(set(next_step)) == 3


def test_every_prompt_is_seen_across_epochs_and_order_changes():
    sampler = PromptSampler(PROMPTS, 5, seed=3)
    epochs = [draw(sampler, 2) for _ in range(3)]
    for epoch in epochs:
        assert sorted(i for step in epoch for i in step) == list(range(10))  # 10 // 5: no tail to skip
    assert epochs[0] != epochs[1]


def test_next_prompts_returns_dataset_entries():
    sampler = PromptSampler(PROMPTS, 2, seed=5)
    reference = PromptSampler(PROMPTS, 2, seed=5)
    assert sampler.next_prompts() == [PROMPTS[i] for i in reference.next_indices()]


def test_sampler_errors():
    with pytest.raises(UserError, match="prompts_per_step=11 exceeds the dataset's 10 prompts"):
        PromptSampler(PROMPTS, 11)
    with pytest.raises(UserError, match="seed must be an int >= 0"):
        PromptSampler(PROMPTS, 2, seed=-1)
    sampler = PromptSampler(PROMPTS, 2)
    state = sampler.state_dict()
    with pytest.raises(UserError, match="num_prompts=10 but this run has 9"):
        PromptSampler(PROMPTS[:9], 2).load_state_dict(state)


# ---- the shipped OCR prompt sets ----------------------------------------------------------------------------------

def test_shipped_ocr_sets_load_validate_and_hold_out_test_targets():
    from rewards.ocr import OcrReward, extract_target, normalize_text

    train, test = load_prompts(ROOT / "assets/ocr/train.txt"), load_prompts(ROOT / "assets/ocr/test.txt")
    assert len(train) == 2000 and len(test) == 64
    reward = OcrReward()
    for prompts in (train, test):
        reward.validate([p.text for p in prompts], [p.metadata for p in prompts])  # every line has a target
    words = {len(extract_target(p.text).split()) for p in train}
    assert words == {1, 2, 3}
    train_targets = {normalize_text(extract_target(p.text)) for p in train}
    test_targets = {normalize_text(extract_target(p.text)) for p in test}
    assert len(test_targets) == 64 and not train_targets & test_targets


def test_generator_is_deterministic(tmp_path):
    script = ROOT / "scripts/make_ocr_prompts.py"
    for out, hash_seed in (("a", "1"), ("b", "2")):  # a different str-hash seed must not change the output
        command = [sys.executable, str(script), "--out-dir", str(tmp_path / out), "--train-size", "300"]
        subprocess.run(command, check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": hash_seed})
    for name in ("train.txt", "test.txt"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    shipped = (ROOT / "assets/ocr/test.txt").read_text()
    assert (tmp_path / "a" / "test.txt").read_text() == shipped  # the test split does not depend on train-size


# ---- conditioning images (image editing) -----------------------------------------------------------------------

def test_image_lines_resolve_relative_to_the_file_and_reach_the_rewards_opened(tmp_path):
    """assets/edit/train.jsonl, the documented example: each "image" resolved against the file's folder and kept as
    an absolute path; `with_source_images` gives the rewards the opened image beside it (one open per file)."""
    from gerl.data.prompts import condition_images, with_source_images

    repo = Path(__file__).resolve().parents[2]
    loaded = load_prompts(repo / "assets" / "edit" / "train.jsonl")
    assert loaded[0].metadata["image"] == str(repo / "assets" / "edit" / "images" / "closed.png")
    assert loaded[0].metadata["target_text"] == "OPEN"
    meta = [p.metadata for p in loaded] + [{}]
    assert condition_images(meta)[:1] == [loaded[0].metadata["image"]] and condition_images([{}, {}]) is None
    given = with_source_images(meta)
    assert given[0]["source_image"].size == (96, 64) and given[0]["source_image"].mode == "RGB"
    assert given[-1] == {} and "source_image" not in meta[0], "the prompts' own metadata is left as it was"
    sub = tmp_path / "sub"
    sub.mkdir()
    given[0]["source_image"].save(sub / "a.png")
    assert load_prompts(write(tmp_path / "p.jsonl", '{"prompt": "x", "image": "sub/a.png"}\n'))[0].metadata == {
        "image": str(sub / "a.png")}


@pytest.mark.parametrize("line, match", [
    ('{"prompt": "x", "image": "missing.png"}', r"p\.jsonl:2: image missing\.png not found \(looked for "),
    ('{"prompt": "x", "image": "not_an_image.png"}', r"p\.jsonl:2: image not_an_image\.png .* is not a readable image"),
    ('{"prompt": "x", "image": 3}', r'p\.jsonl:2: "image" must be a path string'),
])
def test_a_missing_or_unreadable_image_is_a_one_line_error_naming_the_line(tmp_path, line, match):
    (tmp_path / "not_an_image.png").write_text("plain text")
    Image.new("RGB", (8, 8)).save(tmp_path / "ok.png")
    path = write(tmp_path / "p.jsonl", '{"prompt": "fine", "image": "ok.png"}\n' + line + "\n")
    with pytest.raises(UserError, match=match) as info:
        load_prompts(path)
    assert "\n" not in str(info.value)

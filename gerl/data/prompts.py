"""Prompt datasets and the seeded, resumable sampler that picks each step's prompts.

Formats:
- `.txt`: one prompt per line, blank lines skipped (the layout of Flow-GRPO's dataset/ocr/{train,test}.txt,
  where the text to render sits in "double quotes").
- `.jsonl`: one JSON object per line with a `prompt` string; every other field becomes that prompt's metadata
  (e.g. `target_text`, which the OCR reward prefers over the quoted text). An `image` field is the prompt's
  conditioning image for an image-editing model (FLUX.1-Kontext, Qwen-Image-Edit-Plus): a path relative to the
  prompt file (or absolute), checked when the file is read — a missing or unreadable image is one error naming the
  line — and kept in the metadata as the resolved absolute path. Rewards receive it there, and the opened image as
  `source_image` (`with_source_images`). assets/edit/ holds an example.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from gerl.errors import UserError

FORMATS = (".txt", ".jsonl")


@dataclass
class Prompt:
    """One dataset entry: the prompt text and its metadata (handed to the reward alongside the image)."""

    text: str
    metadata: dict = field(default_factory=dict)


def open_image(path: str | Path):
    """A conditioning image as the pipelines take it: PIL, RGB, fully read (the file is closed)."""
    from PIL import Image

    with Image.open(path) as im:
        return im.convert("RGB")


def condition_images(metadata: list[dict]) -> list | None:
    """Each sample's conditioning image path (its metadata's "image"), or None when no sample has one."""
    paths = [m.get("image") if isinstance(m, dict) else None for m in metadata]
    return None if all(p is None for p in paths) else paths


def with_source_images(metadata: list[dict]) -> list[dict]:
    """The metadata with each prompt's conditioning image opened as `source_image` (PIL, RGB) beside its `image`
    path, for the rewards (an edit reward compares the edited image with it); entries without one are unchanged.
    Each file is opened once per call."""
    opened: dict[str, object] = {}
    out = []
    for m in metadata:
        path = m.get("image") if isinstance(m, dict) else None
        if path is None or "source_image" in m:
            out.append(m)
            continue
        if path not in opened:
            opened[path] = open_image(path)
        out.append({**m, "source_image": opened[path]})
    return out


def load_prompts(path: str | Path) -> list[Prompt]:
    """Read a prompt dataset.

    Args:
        path: a `.txt` (one prompt per line) or `.jsonl` (one {"prompt": ..., ...} object per line) file.

    Raises:
        UserError: missing or unreadable file, unknown extension, bad JSON, missing `prompt`, or no prompts at all.
    """
    path = Path(path)
    if path.suffix not in FORMATS:
        raise UserError(f"prompt file {path} has unknown extension {path.suffix!r}; use one of {', '.join(FORMATS)}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"prompt file {path} does not exist; check the data path in the config")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read prompt file {path} ({e}); it must be a readable UTF-8 text file")
    parse = _parse_jsonl_line if path.suffix == ".jsonl" else _parse_txt_line
    prompts = [parse(line, path, number) for number, line in enumerate(lines, start=1) if line.strip()]
    if not prompts:
        raise UserError(f"prompt file {path} has no prompts; add at least one non-blank line")
    return prompts


def _parse_txt_line(line: str, path: Path, number: int) -> Prompt:
    return Prompt(line.strip())


def _parse_jsonl_line(line: str, path: Path, number: int) -> Prompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{number}: bad JSON ({e.msg} at column {e.colno}); each line must be one JSON object")
    if not isinstance(record, dict):
        kind = type(record).__name__
        raise UserError(f'{path}:{number}: expected a JSON object like {{"prompt": "..."}}, got a {kind}')
    text = record.pop("prompt", None)
    if not isinstance(text, str) or not text.strip():
        raise UserError(f"{path}:{number}: missing or empty \"prompt\" string field; give every line a \"prompt\"")
    if "image" in record:
        record["image"] = _image_path(record["image"], path, number)
    return Prompt(text.strip(), record)


def _image_path(value, path: Path, number: int) -> str:
    """The line's "image" resolved against the prompt file's folder, checked to open as an image."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(value, str) or not value.strip():
        raise UserError(f'{path}:{number}: "image" must be a path string (relative to {path.parent} or absolute), '
                        f"got {value!r}")
    image = (path.parent / value).resolve()
    if not image.is_file():
        raise UserError(f"{path}:{number}: image {value} not found (looked for {image}; paths are relative to the "
                        "prompt file)")
    try:
        with Image.open(image) as im:
            im.verify()  # reads the whole file's structure without decoding it into memory
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as e:
        raise UserError(f"{path}:{number}: image {value} ({image}) is not a readable image "
                        f"({str(e).splitlines()[0][:100] if str(e) else type(e).__name__}); use PNG or JPEG") from None
    return str(image)


class PromptSampler:
    """Draws `prompts_per_step` distinct prompts per step, in a seeded order that a resume reproduces.

    Each epoch is a fresh permutation of the dataset seeded by (seed, epoch); steps take consecutive slices of it.
    The tail of an epoch too short for a full step is skipped (like `drop_last`), so a step never holds the same
    prompt twice; the next epoch's different permutation reaches the skipped prompts. The sampler draws the
    *global* prompt set of a step, so its sequence does not depend on device count or micro-batch size; the
    caller repeats each prompt `n` times (the group) and splits the work.

    Args:
        prompts: the dataset (from `load_prompts`).
        prompts_per_step: distinct prompts per step (the number of groups); at most `len(prompts)`.
        seed: the data seed.
    """

    def __init__(self, prompts: Sequence[Prompt], prompts_per_step: int, seed: int = 0):
        num_prompts = len(prompts)
        if prompts_per_step < 1:
            raise UserError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        if not isinstance(seed, int) or seed < 0:
            raise UserError(f"the data seed must be an int >= 0, got {seed!r}")
        if prompts_per_step > num_prompts:
            raise UserError(
                f"prompts_per_step={prompts_per_step} exceeds the dataset's {num_prompts} prompts; "
                f"lower prompts_per_step or use a larger prompt file"
            )
        self.prompts = prompts
        self.num_prompts = num_prompts
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.epoch = 0
        self.index = 0  # position in this epoch's permutation
        self._order = self._permutation(self.epoch)

    def next_indices(self) -> list[int]:
        """The dataset indices of the next step's prompts (distinct), advancing the sampler."""
        if self.index + self.prompts_per_step > self.num_prompts:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        chosen = self._order[self.index : self.index + self.prompts_per_step]
        self.index += self.prompts_per_step
        return [int(i) for i in chosen]

    def next_prompts(self) -> list[Prompt]:
        """The next step's prompts (distinct), advancing the sampler."""
        return [self.prompts[i] for i in self.next_indices()]

    def state_dict(self) -> dict:
        """JSON-friendly position, saved with a checkpoint."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "index": self.index,
            "num_prompts": self.num_prompts,
            "prompts_per_step": self.prompts_per_step,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`; the next draw is the one an uninterrupted run would have made.

        Raises:
            UserError: the checkpoint was made with a different dataset size or prompts_per_step, so the
                positions would not line up.
        """
        for key in ("num_prompts", "prompts_per_step"):
            if key in state and state[key] != getattr(self, key):
                raise UserError(
                    f"checkpoint's prompt sampler has {key}={state[key]} but this run has {getattr(self, key)}; "
                    f"resume with the same prompt file and prompts_per_step, or start a new run"
                )
        self.seed, self.epoch, self.index = int(state["seed"]), int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        # SeedSequence([seed, epoch]) gives independent, reproducible streams per epoch without storing any RNG
        # state: the (seed, epoch, index) triple is the whole position.
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)

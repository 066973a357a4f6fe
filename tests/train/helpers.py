"""Small configs for end-to-end trainer tests (the tiny model, a handful of images per step)."""

from pathlib import Path

from gerl.config import load_config

REPO = Path(__file__).resolve().parents[2]


def small_config(output_dir, *overrides: str):
    """The quickstart recipe shrunk to 2 prompts × 4 images, no validation, no TensorBoard, no progress bar."""
    return load_config(
        str(REPO / "recipes" / "tiny_cpu.yaml"),
        [
            f"output_dir={output_dir}",
            f"data.train_prompts={REPO / 'assets/ocr/train.txt'}",
            f"data.test_prompts={REPO / 'assets/ocr/test.txt'}",
            "data.prompts_per_step=2",
            "data.group_size=4",
            "sampling.micro_batch_size=4",
            "train.mini_batch_size=4",
            "train.micro_batch_size=4",
            "validation.every=-1",
            "log.tensorboard=false",
            "log.progress_bar=false",
            "log.images_every=0",
            *overrides,
        ],
    )


# The same small run as `small_config`, as `gerl train` arguments (for CLI and subprocess tests).
SMALL_CLI = [str(REPO / "recipes" / "tiny_cpu.yaml"), f"data.train_prompts={REPO / 'assets/ocr/train.txt'}",
             f"data.test_prompts={REPO / 'assets/ocr/test.txt'}", "data.prompts_per_step=2", "data.group_size=4",
             "sampling.micro_batch_size=4", "train.mini_batch_size=4", "train.micro_batch_size=4",
             "validation.every=-1", "log.tensorboard=false", "log.progress_bar=false", "log.images_every=0"]

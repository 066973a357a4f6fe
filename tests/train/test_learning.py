"""The whole loop learns the mission's task: on ocr-mini with the real OCR reward (rapidocr) the OCR reward of the
dev numbers rises; with the advantage sign flipped it falls.

It runs recipes/ocr_mini_awm.yaml (AWM, sync): of the three algorithms' recipes it gained most on the dev numbers
in 20 steps (docs/lab_notebook.md, "Algorithms on ocr-mini"), with its rollout, training and validations on merged
LoRA weights (model.merge_lora; the rollout alone, as sampling.merge_lora, took 7 % less: 145 s instead of 157 s
alone on 2 cores), and the merged LoRA is proven in a learning run end to end. Both runs share every seed, so the only difference is
the sign of the advantages, and a run is its seed's (one torch thread; the fresh LoRA's A comes from the run's seed
since issue 25: before, each run drew another A, so the margins below were single draws). 16 steps: the dev numbers
(16 × 8 images, seed 1234, one thread each) every 2 steps of both runs, docs/lab_notebook.md, "The learning test's
length": at step 16 learning +0.117 and flipped −0.215 from the base (+0.059 and −0.223 with the one earlier random
A that was traced); at 14 steps the learning − flipped gap (0.262) comes close to its bar.

The two runs are the experiment and its control, and they are all this module trains: one module-scoped fixture runs
them once (side by side, one process each) and every test below reads them. Each claim is held to its fixed bar and
to 3 standard errors of its own noise: the validation's images are paired across runs (image j of prompt i has the
same noise seed in every validation), so a held-out difference's SE comes from the 128 per-image differences; the
training-reward gap's from the 8 step means of each run. Also printed, not asserted: the SE over the 16 prompts'
mean differences (a prompt's 8 images share its text, so they are not independent samples), which is larger: by it
the rise is 2.8 SE (measured 2026-11-28: +0.094, SE 0.029 per image, 0.033 per prompt). The tests print their numbers
(pytest -s) and put them in every failure message.
"""

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from gerl.config import load_config
from gerl.trainer import train

REPO = Path(__file__).resolve().parents[2]
# the two training runs take 420–510 s in a fresh-clone suite and more beside a busy neighbour: this module's limit
# is 2,400 s, not the suite's 900 s per test (pyproject.toml)
pytestmark = pytest.mark.timeout(2400)
STEPS = 16
IMAGES_PER_PROMPT = 8  # recipes/ocr_mini_awm.yaml's validation.images_per_prompt: a prompt's images are adjacent
SE_BAR = 3.0  # each claim's difference, in standard errors of its own noise


def _overrides(run_dir, *extra) -> list[str]:
    return [f"output_dir={run_dir}", f"max_steps={STEPS}", f"data.train_prompts={REPO / 'assets/ocr_mini/train.txt'}",
            f"data.test_prompts={REPO / 'assets/ocr_mini/dev.txt'}", "log.tensorboard=false",
            "log.progress_bar=false", "log.images_every=0", "checkpoint.every=0", "model.merge_lora=true", *extra]


class Run:
    """A finished run's numbers: held-out validation rewards per image, and the training reward per step."""

    def __init__(self, run_dir: Path):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        self.train = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]  # one mean per step
        assert len(self.train) == STEPS
        self.val_mean = {r["step"]: r["val_reward_mean"] for r in rows if r.get("val_reward_mean") is not None}
        # the validation grids' sidecars: every image's score, in prompt-major order (gerl/trainer.py:validate)
        self.val = {s: json.loads((run_dir / "samples" / f"val_step_{s:06d}.json").read_text())["scores"]
                    for s in self.val_mean}

    def last8(self) -> float:
        return sum(self.train[-8:]) / 8


def paired(a: list, b: list) -> tuple[float, float, float]:
    """(mean of a − b, its standard error over the images, and over the prompts' mean differences), over the images
    scored in both validations, a and b in the same image order."""
    pairs = [(x - y, i // IMAGES_PER_PROMPT) for i, (x, y) in enumerate(zip(a, b, strict=True))
             if x is not None and y is not None]
    d = [x for x, _ in pairs]
    per_prompt: dict[int, list[float]] = {}
    for x, p in pairs:
        per_prompt.setdefault(p, []).append(x)
    means = [sum(v) / len(v) for v in per_prompt.values()]
    se_image = statistics.stdev(d) / math.sqrt(len(d))
    se_prompt = statistics.stdev(means) / math.sqrt(len(means))
    return sum(d) / len(d), se_image, se_prompt


def unpaired(a: list[float], b: list[float]) -> tuple[float, float, None]:
    """(mean of a − mean of b, its standard error, None) of two independent samples."""
    return (sum(a) / len(a) - sum(b) / len(b),
            math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b)), None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(learning run, flipped run), trained once for the module. The flipped run trains in a second process at the
    same time (one torch thread each, as this suite runs): the two runs share no state, and the wall time is nearly
    halved."""
    tmp = tmp_path_factory.mktemp("learning")
    flip_dir = tmp / "flip"
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    flip_proc = subprocess.Popen(
        [sys.executable, "-c", "import torch, sys; torch.set_num_threads(1); from gerl.cli import main; "
         "sys.exit(main(sys.argv[1:]))", "train", str(REPO / "recipes" / "ocr_mini_awm.yaml"),
         *_overrides(flip_dir, "validation.every=0", "train.flip_advantage=true")],  # validates at the last step
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        train(load_config(str(REPO / "recipes" / "ocr_mini_awm.yaml"),
                          _overrides(tmp / "learn", f"validation.every={STEPS}")))  # validates at 0 and the last step
        _, err = flip_proc.communicate(timeout=1800)
    finally:
        flip_proc.kill()
    assert flip_proc.returncode == 0, err[-2000:]
    learn, flip = Run(tmp / "learn"), Run(flip_dir)
    assert sorted(learn.val) == [0, STEPS] and sorted(flip.val) == [STEPS]
    return learn, flip


@pytest.fixture(scope="module")
def claims(runs):
    """{claim: (difference, its standard error, the SE over prompts or None, the difference's fixed bar)} and a
    summary of them."""
    learn, flip = runs
    base = learn.val[0]  # the flipped run's step 0 is the same model, seeds and images
    # measured (1 thread each, seed 0's adapter): dev 0.332 → 0.449 learning, → 0.117 flipped; training reward of
    # the last 8 steps 0.492 learning, 0.216 flipped. With issue 34's training noise (per rank, epoch and sample;
    # AWM's strata per micro-batch): 0.332 → 0.426 learning, → 0.121 flipped; 0.462 and 0.219. With the rollout on
    # merged LoRA weights (2026-11-27): 0.332 → 0.434, → 0.121; 0.461 and 0.219 (unmerged, the same day: as above)
    # Merged, as the test runs, 2026-11-28 (issue 48), twice: 0.332 → 0.426, → 0.121; 0.462 and 0.219.
    out = {
        "rise (learning − base, held-out)": (*paired(learn.val[STEPS], base), 0.03),
        "drop (base − flipped, held-out)": (*paired(base, flip.val[STEPS]), 0.1),
        "gap (learning − flipped, held-out)": (*paired(learn.val[STEPS], flip.val[STEPS]), 0.2),
        # the training reward's SE from its 8 step means per run (their spread includes the trend: conservative)
        "gap (learning − flipped, training reward of the last 8 steps)":
            (*unpaired(learn.train[-8:], flip.train[-8:]), 0.15),
    }
    summary = (f"held-out OCR {learn.val_mean[0]:.3f} → {learn.val_mean[STEPS]:.3f} learning, "
               f"→ {flip.val_mean[STEPS]:.3f} flipped; training reward of the last 8 steps {learn.last8():.3f} "
               f"learning, {flip.last8():.3f} flipped\n" + "\n".join(
                   f"  {name}: {d:+.3f} (bar {bar}), SE {se:.3f}: {d / se:.1f} SE from no change, "
                   f"{(d - bar) / se:+.1f} SE over the bar"
                   + (f" (SE over prompts {sp:.3f}: {d / sp:.1f} SE)" if sp else "")
                   for name, (d, se, sp, bar) in out.items()))
    print(summary)
    return out, summary


def test_the_validation_means_are_the_images_means(runs):
    for run in runs:
        for step, scores in run.val.items():
            assert len(scores) == 16 * IMAGES_PER_PROMPT and None not in scores
            assert sum(scores) / len(scores) == pytest.approx(run.val_mean[step], abs=1e-6)


def test_held_out_ocr_reward_rises(claims):
    out, summary = claims
    d, _, _, bar = out["rise (learning − base, held-out)"]
    assert d > bar, f"the dev OCR reward did not rise: {summary}"


def test_flipped_advantage_lowers_it(claims):
    out, summary = claims
    d, _, _, bar = out["drop (base − flipped, held-out)"]
    assert d > bar, f"flipped advantages did not lower the dev OCR reward: {summary}"


def test_the_advantages_sign_decides(claims):
    out, summary = claims
    d, _, _, bar = out["gap (learning − flipped, held-out)"]
    assert d > bar, f"the advantage's sign barely matters: {summary}"
    d, _, _, bar = out["gap (learning − flipped, training reward of the last 8 steps)"]
    assert d > bar, f"the policy gradient's sign barely matters: {summary}"


def test_every_difference_is_beyond_3_standard_errors(claims):
    out, summary = claims
    weak = [name for name, (d, se, _, _) in out.items() if not d > SE_BAR * se]
    assert not weak, f"within {SE_BAR:g} standard errors of no change: {', '.join(weak)}\n{summary}"

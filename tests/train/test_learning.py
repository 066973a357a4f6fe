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
A that was traced); at 14 steps the learning − flipped gap (0.262) comes close to its bar. The test prints its own
numbers (pytest -s) and puts them in every failure message.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from gerl.config import load_config
from gerl.trainer import train

REPO = Path(__file__).resolve().parents[2]
STEPS = 16


def _overrides(run_dir, *extra) -> list[str]:
    return [f"output_dir={run_dir}", f"max_steps={STEPS}", f"data.train_prompts={REPO / 'assets/ocr_mini/train.txt'}",
            f"data.test_prompts={REPO / 'assets/ocr_mini/dev.txt'}", "log.tensorboard=false",
            "log.progress_bar=false", "log.images_every=0", "checkpoint.every=0", "model.merge_lora=true", *extra]


def _read(run_dir) -> tuple[dict[int, float], float]:
    """({step: held-out validation reward}, mean training reward of the last 8 steps) of a finished run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    assert len(rewards) == STEPS
    val = {r["step"]: r["val_reward_mean"] for r in rows if r.get("val_reward_mean") is not None}
    return val, sum(rewards[-8:]) / 8


def test_held_out_ocr_reward_rises_and_flipped_advantage_lowers_it(tmp_path):
    # The flipped run trains in a second process at the same time (one torch thread each, as this suite runs):
    # the two runs share no state, and the suite's wall time is nearly halved.
    flip_dir = tmp_path / "flip"
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    flip_proc = subprocess.Popen(
        [sys.executable, "-c", "import torch, sys; torch.set_num_threads(1); from gerl.cli import main; "
         "sys.exit(main(sys.argv[1:]))", "train", str(REPO / "recipes" / "ocr_mini_awm.yaml"),
         *_overrides(flip_dir, "validation.every=0", "train.flip_advantage=true")],  # validates at the last step
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        train(load_config(str(REPO / "recipes" / "ocr_mini_awm.yaml"),
                          _overrides(tmp_path / "learn", f"validation.every={STEPS}")))  # validates at 0 and the last step
        _, err = flip_proc.communicate(timeout=900)
    finally:
        flip_proc.kill()
    assert flip_proc.returncode == 0, err[-2000:]
    learn, learn_train = _read(tmp_path / "learn")
    flip, flip_train = _read(flip_dir)
    base = learn[0]
    summary = (f"held-out OCR {base:.3f} → {learn[STEPS]:.3f} learning, → {flip[STEPS]:.3f} flipped; training reward "
               f"of the last 8 steps {learn_train:.3f} learning, {flip_train:.3f} flipped")
    print(summary)
    assert sorted(learn) == [0, STEPS] and sorted(flip) == [STEPS]
    # measured (1 thread each, seed 0's adapter): dev 0.332 → 0.449 learning, → 0.117 flipped; training reward of
    # the last 8 steps 0.492 learning, 0.216 flipped. With issue 34's training noise (per rank, epoch and sample;
    # AWM's strata per micro-batch): 0.332 → 0.426 learning, → 0.121 flipped; 0.462 and 0.219. With the rollout on
    # merged LoRA weights (2026-11-27): 0.332 → 0.434, → 0.121; 0.461 and 0.219 (unmerged, the same day: as above)
    # With model.merge_lora (rollout and training merged, 2026-11-28): 0.332 → 0.426, → 0.121; 0.462 and 0.219
    assert learn[STEPS] - base > 0.03, f"the dev OCR reward did not rise: {summary}"
    assert flip[STEPS] < base - 0.1, f"flipped advantages did not lower the dev OCR reward: {summary}"
    assert learn[STEPS] - flip[STEPS] > 0.2, f"the advantage's sign barely matters: {summary}"
    assert learn_train - flip_train > 0.15, f"the policy gradient's sign barely matters: {summary}"

"""hpsv2 and ImageReward executed through gerl's rewards, on CPU, with tiny random weights (`pytest -m packaged`).

They run in the venv of scripts/packaged_rewards_env.sh (image-reward 1.5 needs transformers<5; hpsv2 pins pytest
7.2 and protobuf<4), so tests/rewards/packaged_child.py runs there with the repo on PYTHONPATH; without that venv
the test is skipped (CI does not build it; docs/rewards.md says why). No network: the BERT tokenizer ImageReward
asks the hub for is a tiny one written into a fresh HF_HUB_CACHE, and the process runs under `unshare -n` where
the kernel allows it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("GERL_PACKAGED_VENV", REPO / ".venv-prefs"))

pytestmark = [
    pytest.mark.packaged, pytest.mark.slow,
    pytest.mark.skipif(not (VENV / ".gerl-packaged-ready").is_file(),
                       reason=f"no venv at {VENV}: `bash scripts/packaged_rewards_env.sh` builds it (~5 min, 2 GB)"),
]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    work = tmp_path_factory.mktemp("packaged")
    offline = ["unshare", "-n"] if subprocess.run(["unshare", "-n", "true"]).returncode == 0 else []
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_CACHE": str(work / "hub"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([*offline, str(VENV / "bin" / "python"), str(REPO / "tests" / "rewards" / "packaged_child.py"),
                          str(work), str(work / "hub")], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_hpsv2_scores_are_the_packages_cosines(result):
    hps = result["hpsv2"]
    assert hps["loaded_equal"], "the reward did not load the checkpoint it was given"
    assert hps["scores"] == pytest.approx(hps["expected"], abs=1e-6)
    assert hps["batch_size_1"] == pytest.approx(hps["scores"], abs=1e-6)  # batch-independent
    assert all(-1 <= s <= 1 for s in hps["scores"]) and len(set(hps["scores"])) == len(hps["scores"])


def test_imagereward_scores_are_the_packages_scores(result):
    ir = result["imagereward"]
    assert ir["loaded_equal"], "RM.load did not load the reward head from the checkpoint"
    assert ir["scores"] == pytest.approx(ir["expected"], rel=1e-5)  # gerl groups by prompt; the package, one by one
    assert len(set(round(s, 3) for s in ir["scores"])) == len(ir["scores"])


def test_torchvision_is_the_pure_python_part(result):
    tv = result["torchvision"]
    if tv["schemas_declared"]:  # the CUDA wheel beside the CPU torch: its compiled ops are still unavailable
        assert not tv["has_compiled_ops"]

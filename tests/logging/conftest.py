"""Real tiny CPU runs shared by the report and timeline tests (built once per session: ~20 s for both on 2 busy cores)."""

import pytest

from tests.train.helpers import small_config

# Shrunk further than small_config: 2 prompts × 2 images (two rollout micro-batches), 4 denoising steps with a
# 2-step window, 2 ODE steps for validation — every stage still runs, on CPU, in a few seconds per run.
FAST = ["data.group_size=2", "sampling.micro_batch_size=2", "train.mini_batch_size=4", "train.micro_batch_size=2",
        "sampling.num_steps=4", "sampling.eval_num_steps=2", "sampling.sde_window_size=2",
        "sampling.sde_window_range=[0,3]", "validation.every=1", "validation.num_prompts=4"]


@pytest.fixture(scope="session")
def report_runs(tmp_path_factory):
    """Two finished runs that differ in learning rate: lr_a (3 steps, lr 0.01) and lr_b (1 step, lr 0.003)."""
    from gerl.trainer import train

    base = tmp_path_factory.mktemp("report_runs")
    runs = []
    for name, lr, steps in (("lr_a", "0.01", 3), ("lr_b", "0.003", 1)):
        runs.append(train(small_config(base / name, f"max_steps={steps}", f"train.learning_rate={lr}", *FAST)))
    return runs

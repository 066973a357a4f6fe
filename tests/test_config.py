"""The typed config: defaults, overrides, errors that name the closest key, batch arithmetic, shipped recipes."""

from pathlib import Path

import pytest

from gerl.config import Config, derived_sizes, load_config, trained_steps_per_sample, validate
from gerl.errors import UserError

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def test_defaults_are_valid():
    assert validate(Config()) == []


def test_overrides_are_typed():
    cfg = load_config(None, ["train.learning_rate=1e-3", "sampling.sde_window_range=[1,4]", "reward.with_reward=false",
                             "max_steps=7", "model.path=stabilityai/stable-diffusion-3.5-medium"])
    assert cfg.train.learning_rate == 1e-3 and isinstance(cfg.train.learning_rate, float)
    assert cfg.sampling.sde_window_range == [1, 4]
    assert cfg.reward.with_reward is False and cfg.max_steps == 7


def test_unknown_key_suggests_the_closest_valid_one():
    with pytest.raises(UserError, match=r"unknown key 'train.learning_rat'.*did you mean 'train.learning_rate'"):
        load_config(None, ["train.learning_rat=1e-3"])


def test_all_errors_are_reported_at_once():
    with pytest.raises(UserError) as e:
        load_config(None, ["max_steps=ten", "sampling.sampler=sdee", "model.dtype=fp64"])
    msg = str(e.value)
    assert "max_steps: expected an integer" in msg
    assert "'sdee' is not one of sde, cps (did you mean 'sde'?)" in msg
    assert "model.dtype" in msg and "\n" not in msg


def test_batch_sizes_must_divide():
    with pytest.raises(UserError, match=r"sampling.micro_batch_size=5 must divide images per step"):
        load_config(None, ["data.prompts_per_step=2", "data.group_size=4", "sampling.micro_batch_size=5"])
    with pytest.raises(UserError, match=r"train.micro_batch_size=3 must divide"):
        load_config(None, ["data.prompts_per_step=2", "data.group_size=4", "sampling.micro_batch_size=4",
                           "train.micro_batch_size=3"])


def test_window_must_fit_and_avoid_the_final_step():
    with pytest.raises(UserError, match="sde_window_range"):
        load_config(None, ["sampling.num_steps=6", "sampling.sde_window_range=[0,6]"])
    with pytest.raises(UserError, match="sde_window_range"):
        load_config(None, ["sampling.sde_window_size=4", "sampling.sde_window_range=[0,3]"])


def test_derived_sizes_and_group_size_independent_of_micro_batch():
    a = load_config(None, ["data.prompts_per_step=4", "data.group_size=8", "sampling.micro_batch_size=2",
                           "train.micro_batch_size=2", "train.mini_batch_size=16"])
    b = load_config(None, ["data.prompts_per_step=4", "data.group_size=8", "sampling.micro_batch_size=32",
                           "train.micro_batch_size=8", "train.mini_batch_size=16"])
    sa, sb = derived_sizes(a, trained_steps_per_sample(a)), derived_sizes(b, trained_steps_per_sample(b))
    assert sa["images_per_step"] == sb["images_per_step"] == 32
    assert sa["group_size"] == sb["group_size"] == 8
    assert sa["rollout_micro_batches"] == 16 and sb["rollout_micro_batches"] == 1
    assert sa["optimizer_steps_per_epoch"] == 2
    assert sa["grad_accumulation"] == 8 * 3  # 16/2 micro-batches × 3 trained window steps


def test_flow_grpo_trains_every_step_but_the_last_with_timestep_fraction():
    cfg = load_config(None, ["sampling.sde_window_size=0", "sampling.num_steps=10", "sampling.timestep_fraction=0.5"])
    assert trained_steps_per_sample(cfg) == 5  # round(9 × 0.5)


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_shipped_recipe_loads_and_validates(recipe):
    text = recipe.read_text()
    assert text.startswith("#") and "gerl train" in text.splitlines()[1], "a recipe opens with its launch command"
    cfg = load_config(str(recipe))
    assert validate(cfg) == []
    for path in (cfg.data.train_prompts, cfg.data.test_prompts):
        assert (REPO / path).is_file() or "{" in path or path.startswith("/"), path


def test_recipes_exist():
    assert any(r.name == "tiny_cpu.yaml" for r in RECIPES)


SCRIPTS = sorted((REPO / "recipes").glob("run_*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_every_gpu_launcher_validates(script):
    """The .sh launchers pass engine/data overrides to the shared YAML: those must validate too."""
    import shlex

    lines = script.read_text().splitlines()
    assert lines[1].startswith(f"# bash recipes/{script.name}"), "a launcher opens with its launch command"
    exec_line = next(line for line in lines if line.startswith("exec "))
    words = shlex.split(exec_line)
    overrides = [w for w in words if "=" in w and not w.startswith("$") and "." in w.split("=")[0]]
    assert overrides, exec_line
    load_config(str(REPO / "recipes" / "sd3_fast_ocr_1gpu.yaml"), overrides)


def test_gpu_launchers_exist():
    names = {s.name for s in SCRIPTS}
    assert {"run_sd3_fast_3p_a1_r2.sh", "run_sd3_fast_3p_a2_r1.sh", "run_sd3_fast_3p_hybrid.sh"} <= names


def test_stream_schedule_checks():
    base = ["engine.kind=ray", "engine.schedule=stream"]
    with pytest.raises(UserError, match="engine.schedule=stream needs engine.hybrid=false"):
        load_config(None, base)
    with pytest.raises(UserError, match="stages weights through the object store"):
        load_config(None, [*base, "engine.hybrid=false", "engine.weight_sync=broadcast"])
    with pytest.raises(UserError, match="engine.stale_decay must be in"):
        load_config(None, [*base, "engine.hybrid=false", "engine.stale_decay=0"])
    cfg = load_config(None, [*base, "engine.hybrid=false", "engine.stale=downweight"])
    assert cfg.engine.schedule == "stream" and cfg.engine.stale == "downweight"

"""The typed config: defaults, overrides, errors that name the closest key, batch arithmetic, shipped recipes."""

import dataclasses
import re
from pathlib import Path

import pytest

from gerl.config import (RANGES, Config, RewardComponent, derived_sizes, load_config, numeric_fields,
                         trained_steps_per_sample, validate)
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
    exec_line = next(line for line in lines if "exec bash" in line)
    words = shlex.split(exec_line)
    overrides = [w for w in words if "=" in w and not w.startswith("$") and "." in w.split("=")[0]]
    assert overrides, exec_line
    # the recipe it launches: RECIPE=... before `exec bash`, else _launch.sh's default
    recipe = next((w.split("=", 1)[1] for w in words if w.startswith("RECIPE=")), "recipes/gerl_sd3_fast_ocr.yaml")
    load_config(str(REPO / recipe), overrides)


def test_gpu_launchers_exist():
    names = {s.name for s in SCRIPTS}
    assert {"run_sd3_fast_3p_a1_r2.sh", "run_sd3_fast_3p_a2_r1.sh", "run_sd3_fast_3p_hybrid.sh"} <= names


# ------------------------------------------------------------------ ranges of every numeric field

def _tree_with_every_field():
    """The default tree plus one reward component, so the component fields are walked too, and a reused velocity
    step (empty by default; nft/awm/dgpo only) so its list is walked."""
    c = Config()
    return Config(reward=dataclasses.replace(c.reward, components=[RewardComponent(name="ocr")]),
                  sampling=dataclasses.replace(c.sampling, reuse_velocity_steps=[2]),
                  algo=dataclasses.replace(c.algo, name="awm"))


def test_every_numeric_field_has_a_range_and_every_range_a_field():
    keys = {k for k, _, _ in numeric_fields(_tree_with_every_field())}
    assert keys - set(RANGES) == set(), "numeric fields without a range in gerl.config.RANGES"
    assert set(RANGES) - keys == set(), "RANGES entries that name no numeric field"
    assert validate(_tree_with_every_field()) == []  # every default is inside its own range


def _outside(rng) -> float:
    if rng.lo is not None:
        return rng.lo if rng.lo_open else rng.lo - 1
    if rng.hi is not None:
        return rng.hi if rng.hi_open else rng.hi + 1
    return float("inf")


def _get_default(key: str):
    node = Config()
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _override(key: str, bad) -> tuple[str, str]:
    """(override, the key as the error names it) setting `key` — or the first element of a list field — to `bad`."""
    if key.startswith("reward.components[]."):
        field = key.rsplit(".", 1)[1]
        return f"reward.components=[{{name: ocr, {field}: {bad}}}]", f"reward.components[0].{field}"
    default = _get_default(key)
    if isinstance(default, list):
        return f"{key}=[{', '.join(map(str, [bad, *default[1:]]))}]", f"{key}[0]"
    return f"{key}={bad}", key


@pytest.mark.parametrize("key", sorted(RANGES))
def test_a_value_just_outside_each_range_is_refused_naming_the_key(key):
    rng = RANGES[key]
    bad = _outside(rng)
    sample = None if "[]" in key else _get_default(key)
    sample = (sample[0] if sample else 1) if isinstance(sample, list) else sample  # an empty list holds ints here
    if isinstance(sample, int) and float(bad).is_integer():
        bad = int(bad)  # an int field is given an int, so the range check (not the type check) must refuse it
    override, shown = _override(key, ".inf" if bad == float("inf") else bad)
    with pytest.raises(UserError) as e:
        load_config(None, [override])
    assert f"{shown}=" in str(e.value) and rng.text() in str(e.value), str(e.value)


def test_issue_examples_are_refused_before_anything_loads():
    for override, words in (("model.resolution=0", "model.resolution=0 must be ≥ 16"),
                            ("model.resolution=-16", "model.resolution=-16"),
                            ("train.adv_clip_max=-1", "train.adv_clip_max=-1.0 must be > 0"),
                            ("checkpoint.every=-2", "checkpoint.every=-2 must be ≥ 0"),
                            ("validation.every=-2", "validation.every=-2 must be ≥ -1"),
                            ("train.max_grad_norm=-1", "train.max_grad_norm=-1.0 must be ≥ 0"),
                            ("seed=-1", "seed=-1 must be in [0, 4294967295]"),
                            ("train.learning_rate=.nan", "train.learning_rate=nan")):
        with pytest.raises(UserError, match=re.escape(words)):
            load_config(None, [override])


def test_mistyped_keys_are_matched_by_their_last_component():
    for typed, meant in (("train.lr", "train.learning_rate"), ("learning_rate", "train.learning_rate"),
                         ("model.group_size", "data.group_size"), ("train.clip", "train.clip_range")):
        with pytest.raises(UserError, match=re.escape(f"unknown key {typed!r} (did you mean {meant!r}?)")):
            load_config(None, [f"{typed}=1"])


def test_unknown_keys_type_errors_and_range_errors_are_reported_together():
    with pytest.raises(UserError) as e:
        load_config(None, ["train.lr=1", "max_steps=ten", "seed=-1", "checkpoint.every=-3"])
    msg = str(e.value)
    for part in ("unknown key 'train.lr'", "max_steps: expected an integer", "seed=-1", "checkpoint.every=-3"):
        assert part in msg, msg


def test_stream_schedule_checks():
    base = ["engine.kind=ray", "engine.schedule=stream"]
    with pytest.raises(UserError, match="engine.schedule=stream needs engine.hybrid=false"):
        load_config(None, base)
    with pytest.raises(UserError, match="stages weights through the object store"):
        load_config(None, [*base, "engine.hybrid=false", "engine.weight_sync=broadcast"])
    with pytest.raises(UserError, match="engine.stale_decay=0"):
        load_config(None, [*base, "engine.hybrid=false", "engine.stale_decay=0"])
    cfg = load_config(None, [*base, "engine.hybrid=false", "engine.stale=downweight"])
    assert cfg.engine.schedule == "stream" and cfg.engine.stale == "downweight"


def test_nft_with_guidance_is_refused_naming_the_fix():
    """DiffusionNFT samples and trains without CFG (every NVlabs config ends with guidance_scale 1); gerl refuses
    the combination rather than train something no reference does."""
    with pytest.raises(UserError, match=r"algo.name=nft trains without classifier-free guidance.*"
                                        r"set sampling.guidance_scale=1 \(here 4.5\)"):
        load_config(None, ["algo.name=nft", "sampling.guidance_scale=4.5"])
    assert load_config(None, ["algo.name=nft", "sampling.eval_guidance_scale=4.5"]).sampling.eval_guidance_scale == 4.5
    assert load_config(None, ["algo.name=awm", "sampling.guidance_scale=4.5"]).algo.name == "awm"  # AWM's train.cfg


def test_dgpo_combinations_that_cannot_work_are_refused_naming_the_fix():
    """DGPO needs both sets of a group inside one optimizer step, a group of ≥ 2, a moving anchor when the anchor is
    its reference; and its options on another algorithm would be ignored without a word."""
    dgpo = ["algo.name=dgpo", "data.prompts_per_step=4", "data.group_size=4"]
    for extra, words in (
            (["data.group_size=1"], "data.group_size=1 must be ≥ 2"),
            (["train.mini_batch_size=8", "train.micro_batch_size=2", "data.group_size=3", "data.prompts_per_step=8",
              "sampling.micro_batch_size=8"],
             "train.mini_batch_size / engine.actor_workers (8) must be a multiple of data.group_size (3)"),
            (["algo.dgpo_reference=anchor"], "set algo.anchor_decay_rate=0.001 algo.anchor_decay_max=0.3"),
            (["algo.anchor_beta=0.5"], "set algo.anchor_beta=0"),
            (["algo.dgpo_reference=anchor", "algo.anchor_decay_rate=0.001", "algo.anchor_decay_max=0.3",
              "algo.dgpo_reference_guidance=4.5"], "algo.dgpo_reference_guidance=4.5 guides the frozen base"),
            (["algo.timesteps=shared", "sampling.num_steps=6", "sampling.timestep_fraction=0.5",
              "algo.train_timesteps=4"], "algo.train_timesteps=4 needs ≥ that many schedule indices in [0, num_steps")):
        with pytest.raises(UserError, match=re.escape(words)):
            load_config(None, [*dgpo, *extra])
    with pytest.raises(UserError, match=re.escape("algo.dgpo_beta applies to algo.name=dgpo only (here nft)")):
        load_config(None, ["algo.name=nft", "algo.dgpo_beta=10"])
    cfg = load_config(None, [*dgpo, "train.mini_batch_size=8", "train.micro_batch_size=4", "sampling.guidance_scale=4.5",
                             "algo.timesteps=shared", "sampling.timestep_fraction=0.7", "algo.train_timesteps=4"])
    assert cfg.algo.name == "dgpo" and cfg.sampling.guidance_scale == 4.5  # DGPO's default mode: rollouts with CFG


def test_fsdp_refuses_what_it_does_not_shard_yet():
    ray = ["engine.kind=ray", "engine.hybrid=false", "engine.fsdp=true"]
    assert load_config(None, [*ray, "engine.schedule=async"]).engine.fsdp
    with pytest.raises(UserError, match="engine.fsdp=true with engine.schedule=stream is not supported"):
        load_config(None, [*ray, "engine.schedule=stream"])
    with pytest.raises(UserError, match="model.merge_lora=true merges the adapter into base weights that engine.fsdp"):
        load_config(None, ["engine.fsdp=true", "model.merge_lora=true"])
    with pytest.raises(UserError, match="model.compile=true with engine.fsdp=true is not supported"):
        load_config(None, ["engine.fsdp=true", "model.compile=true"])


def test_fractional_gpu_hosts_are_accepted_and_fp16_full_fine_tuning_is_not():
    one_gpu = ["engine.kind=ray", "engine.hybrid=false", "engine.device=cuda", "engine.gpus_per_worker=0.5"]
    # hosts sharing a GPU: NCCL cannot join them, so their groups carry CUDA tensors with gloo (tests/engine/test_dist.py)
    for extra in ([], ["model.lora=false"], ["engine.weight_sync=broadcast"],
                  ["engine.actor_workers=2", "train.mini_batch_size=32"]):
        assert load_config(None, [*one_gpu, *extra]).engine.gpus_per_worker == 0.5
    for bad in ("0", "1.5", "-0.5"):
        with pytest.raises(UserError, match=rf"engine.gpus_per_worker={bad}"):
            load_config(None, ["engine.kind=ray", f"engine.gpus_per_worker={bad}"])
    with pytest.raises(UserError, match="model.dtype=fp16 with model.lora=false: full fine-tuning in fp16 is not"):
        load_config(None, ["model.dtype=fp16", "model.lora=false"])
    load_config(None, ["model.dtype=bf16", "model.lora=false"])
    with pytest.raises(UserError, match="engine.rehearse=true rehearses a GPU layout on CPU; it needs engine.device=cuda"):
        load_config(None, ["engine.rehearse=true", "engine.device=cpu"])


def test_every_recipe_validates_without_importing_torch():
    """A config is read and checked before any heavy import (gerl/cli.py): a bad one fails, and --print-config
    answers, in milliseconds. In a fresh interpreter (this one has torch loaded): every shipped recipe, one loss per
    registered name, and the error path, with none of torch, numpy, diffusers or transformers imported."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from gerl.config import load_config\n"
            "from gerl.errors import UserError\n"
            f"for r in {[str(p) for p in RECIPES]!r}:\n"
            "    load_config(r, ['output_dir=/tmp/unused'])\n"
            "for loss in ('ppo_clip', 'tis', 'topr', 'cispo'):\n"
            "    load_config(None, [f'train.loss={loss}'])\n"
            "try:\n"
            "    load_config(None, ['train.loss=ppo'])\n"
            "except UserError as e:\n"
            "    assert 'not a registered policy loss' in str(e), e\n"
            "print(sorted(m for m in ('torch', 'numpy', 'diffusers', 'transformers') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", f"validating a config imported {r.stdout.strip()}"


def test_engine_env_takes_variable_names_and_plain_values():
    cfg = load_config(None, ["engine.env={NCCL_SOCKET_IFNAME: eth0, NCCL_IB_DISABLE: 1}"])
    assert cfg.engine.env == {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": 1}
    with pytest.raises(UserError, match=r"engine.env: NCCL-IB, NCCL_X: each entry is NAME: value"):
        load_config(None, ["engine.env={NCCL-IB: 1, NCCL_X: [a]}"])

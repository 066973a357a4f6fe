"""Every shipped recipe and launcher resolves with --print-config, offline, as real processes; the GeRL and
Flow-GRPO recipes resolve to the peers' hyperparameters and conventions. (The launchers really train in
tests/engine/test_rehearsal.py, each in its own GPU layout rehearsed on CPU.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gerl.config import Config, load_config, to_dict, trained_steps_per_sample

REPO = Path(__file__).resolve().parents[2]
YAMLS = sorted((REPO / "recipes").glob("*.yaml"))
LAUNCHERS = sorted(p for p in (REPO / "recipes").glob("*.sh") if not p.name.startswith("_"))
DATA = REPO / "assets" / "ocr"  # train.txt (2000 prompts) and test.txt: the dataset layout the launchers expect
# Both peers' LoRA target_modules (GeRL's select_lora_modules, Flow-GRPO's train_sd3.py): the attn.* projections only,
# so SD3.5-M's attn2 (blocks 0-12) is not adapted: 191 layers, 18.8M parameters at r=32
ATTN_TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                "attn.to_out.0", "attn.to_q", "attn.to_v"]


def env():
    e = dict(os.environ)
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"  # the venv's `gerl`
    e["PYTHONPATH"] = f"{REPO}{os.pathsep}{e.get('PYTHONPATH', '')}"  # this checkout's gerl, not another install
    return e


def run(args):
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300, env=env())


def resolved(stdout: str) -> dict:
    data = yaml.safe_load(stdout)
    assert set(data) == set(to_dict(Config())), "the whole tree is printed"
    return data


@pytest.mark.parametrize("recipe", YAMLS, ids=[p.name for p in YAMLS])
def test_every_yaml_recipe_prints_its_resolved_config(recipe, tmp_path):
    out = tmp_path / "run"
    r = run([sys.executable, "-m", "gerl.cli", "train", str(recipe), f"output_dir={out}", "--print-config"])
    assert r.returncode == 0, r.stderr
    data = resolved(r.stdout)
    assert data["output_dir"] == str(out) and not out.exists(), "--print-config writes nothing"
    # what was printed is what a run would use: loading the printed YAML gives the same config
    printed = tmp_path / "printed.yaml"
    printed.write_text(r.stdout)
    assert to_dict(load_config(str(printed))) == to_dict(load_config(str(recipe), [f"output_dir={out}"]))


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=[p.name for p in LAUNCHERS])
def test_every_launcher_passes_print_config_through(launcher, tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(["bash", str(launcher), "tiny", str(DATA), "train.learning_rate=2e-4", "--print-config", "seed=7"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**env(), "OUT": str(out)})
    assert r.returncode == 0, r.stderr
    data = resolved(r.stdout)
    assert data["model"]["path"] == "tiny" and data["train"]["learning_rate"] == 2e-4 and data["seed"] == 7
    assert data["data"]["train_prompts"] == f"{DATA}/train.txt"
    assert not out.exists() and not any(tmp_path.iterdir()), "--print-config writes nothing"


def launcher_config(name, *extra):
    r = subprocess.run(["bash", str(REPO / "recipes" / name), "tiny", str(DATA), *extra, "--print-config"],
                       capture_output=True, text=True, timeout=300, env=env())
    assert r.returncode == 0, r.stderr
    return resolved(r.stdout)


def test_gerl_row_launcher_is_gerls_run_sd3_fast_3p_a1_r2():
    c = launcher_config("run_sd3_fast_3p_a1_r2.sh")
    d, s, t, m = c["data"], c["sampling"], c["train"], c["model"]
    assert (d["prompts_per_step"], d["group_size"]) == (8, 8)  # data.train_batch_size=8, rollout.n=8
    images = d["prompts_per_step"] * d["group_size"]
    assert (t["mini_batch_size"], images // t["mini_batch_size"]) == (32, 2)  # ppo_mini_batch_size=4 prompts: 2 steps
    assert t["micro_batch_size"] == 8 and s["micro_batch_size"] == 8  # ppo_micro_batch_size_per_gpu=8
    assert (t["learning_rate"], t["weight_decay"]) == (1e-4, 1e-4)
    assert (m["lora_rank"], m["lora_alpha"], m["dtype"], m["resolution"]) == (32, 64, "fp16", 512)
    assert (m["lora_init"], m["lora_targets"]) == ("gaussian", ATTN_TARGETS)  # lora_init_weights, target_modules auto
    assert m["max_sequence_length"] == 512  # data.max_prompt_length=512 is rollout.prompt_length, T5's length
    # actor.clip_ratio: actor.yaml's 0.0001 (since f53138a, 2025-11-20)
    assert (t["clip_range"], t["adv_clip_max"], t["beta"], t["max_grad_norm"]) == (1e-4, 5.0, 0.0, 1.0)
    assert t["shuffle_mini_batches"] is False  # update_policy: data.split(ppo_mini_batch_size), in order
    assert (s["sampler"], s["noise_level"], s["sde_window_size"], s["sde_window_range"]) == ("cps", 0.8, 3, [0, 5])
    assert (s["guidance_scale"], s["num_steps"], s["eval_num_steps"]) == (1.0, 10, 40)
    assert (c["validation"]["every"], c["validation"]["num_prompts"]) == (5, 32)
    assert c["max_steps"] == 15 * (2000 // 8)  # trainer.total_epochs=15 over the 2000-prompt train set
    e = c["engine"]
    assert (e["hybrid"], e["actor_workers"], e["rollout_workers"], e["schedule"], e["max_staleness"]) == \
        (False, 1, 2, "async", 1)
    assert c["conventions"] == {"preset": "gerl_mm_grpo", "sde_log_prob": "gaussian", "cps_log_prob": "squared_error",
                                "kl_std": "noise_coef", "group_std": "unbiased"}
    assert t["advantage"] == "global_std" and not t["per_prompt_tracker"]
    assert c["reward"]["kwargs"] == {"strip": "spaces", "strict_confidence": True}


@pytest.mark.parametrize("name", ["run_sd3_fast_3p_hybrid.sh", "run_sd3_fast_8p_hybrid_with_reward.sh",
                                  "run_sd3_fast_3p_a2_r1.sh", "run_sd3_fast_1p_with_reward.sh"])
def test_every_gerl_row_keeps_two_optimizer_steps_and_gerls_conventions(name):
    c = launcher_config(name)
    images = c["data"]["prompts_per_step"] * c["data"]["group_size"]
    assert images // c["train"]["mini_batch_size"] == 2
    assert c["conventions"]["preset"] == "gerl_mm_grpo" and c["train"]["clip_range"] == 1e-4
    assert c["train"]["shuffle_mini_batches"] is False and c["model"]["lora_targets"] == ATTN_TARGETS
    assert c["max_steps"] == 15 * (2000 // c["data"]["prompts_per_step"])


def test_flow_grpo_recipe_is_general_ocr_sd3():
    c = to_dict(load_config(str(REPO / "recipes" / "flow_grpo_sd3_ocr.yaml")))
    s, t = c["sampling"], c["train"]
    assert (s["sampler"], s["num_steps"], s["eval_num_steps"], s["sde_window_size"]) == ("sde", 10, 40, 0)
    assert (s["noise_level"], s["guidance_scale"], s["timestep_fraction"]) == (0.7, 4.5, 0.99)
    assert c["model"]["resolution"] == 512 and (c["data"]["prompts_per_step"], c["data"]["group_size"]) == (48, 24)
    assert (t["beta"], t["clip_range"], t["learning_rate"], t["advantage"]) == (0.04, 1e-4, 3e-4, "global_std")
    assert c["data"]["prompts_per_step"] * c["data"]["group_size"] // t["mini_batch_size"] == 2
    assert c["conventions"]["preset"] == "flow_grpo" and c["conventions"]["group_std"] == "biased"
    m = c["model"]
    assert (m["lora_rank"], m["lora_alpha"], m["lora_init"], m["lora_targets"]) == (32, 64, "gaussian", ATTN_TARGETS)
    assert m["max_sequence_length"] == 128 and t["shuffle_mini_batches"] is True  # samples[perm] before rebatching
    assert trained_steps_per_sample(load_config(str(REPO / "recipes" / "flow_grpo_sd3_ocr.yaml"))) == 9  # int(10·0.99)


@pytest.mark.parametrize("recipe", ["gerl_sd3_fast_ocr.yaml", "flow_grpo_sd3_ocr.yaml"])
def test_the_peer_recipes_adapt_the_peers_layers_of_sd35_medium(recipe):
    """SD3.5-M's real transformer config on the meta device: the peers' 191 attn.* layers (8 per block, the last
    block has no to_add_out), none of attn2 of the 13 dual-attention blocks; the short names would add those 52."""
    import torch

    from gerl.models.loader import add_lora
    from gerl.models.sd35_arch import build_component

    m = load_config(str(REPO / "recipes" / recipe)).model
    with torch.device("meta"):
        tr = build_component("transformer")
    add_lora(tr, m.lora_rank, m.lora_alpha, m.lora_targets, m.lora_init)
    adapted = [n for n, mod in tr.named_modules() if hasattr(mod, "lora_A")]
    assert len(adapted) == 191 and not any(".attn2." in n for n in adapted)
    assert sum(p.numel() for p in tr.parameters() if p.requires_grad) == 18_776_064  # vs 23,887,872 with attn2


# flow_grpo's scripts/train_flux.py target_modules, which Flow-Factory's flux1.py default_target_modules repeat
FLUX_TARGETS = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                "ff_context.net.2"]
# recipe → its peer's values: (sampler or algorithm, num_steps, eval steps, guidance, resolution, prompts × group,
# optimizer steps per step, clip range, noise level / nft beta, T5 tokens)
FLUX_RECIPES = {
    "flow_grpo_flux_ocr.yaml": ("sde", 6, 28, 3.5, 512, (48, 24), 2, 1e-4, 0.9, 128),  # pickscore_flux
    "flow_grpo_flux_fast_ocr.yaml": ("cps", 6, 28, 3.5, 512, (48, 24), 2, 1e-5, 0.8, 128),  # geneval_flux_fast
    "nft_flux_ocr.yaml": ("nft", 8, 28, 1.0, 384, (48, 16), 1, None, 1.0, 512),  # Flow-Factory nft/lora/flux1
    "awm_flux_ocr.yaml": ("awm", 10, 20, 3.5, 512, (48, 16), 1, 1.0, None, 512),  # Flow-Factory awm/lora/flux1
}


@pytest.mark.parametrize("recipe", list(FLUX_RECIPES))
def test_flux_recipes_are_their_peers_settings(recipe):
    kind, steps, eval_steps, guidance, res, (prompts, group), opt_steps, clip, level, tokens = FLUX_RECIPES[recipe]
    c = to_dict(load_config(str(REPO / "recipes" / recipe)))
    m, s, t, a = c["model"], c["sampling"], c["train"], c["algo"]
    assert (m["path"], m["dtype"], m["resolution"], m["max_sequence_length"]) == \
        ("black-forest-labs/FLUX.1-dev", "bf16", res, tokens)
    assert (m["lora_rank"], m["lora_alpha"], m["lora_init"], m["lora_targets"]) == (64, 128, "gaussian", FLUX_TARGETS)
    assert (s["num_steps"], s["eval_num_steps"], s["guidance_scale"], s["eval_guidance_scale"]) == \
        (steps, eval_steps, guidance, guidance)
    assert (c["data"]["prompts_per_step"], c["data"]["group_size"], c["reward"]["name"]) == (prompts, group, "ocr")
    assert prompts * group // t["mini_batch_size"] == opt_steps
    assert (t["learning_rate"], t["weight_decay"], t["beta"]) == (3e-4, 1e-4, 0.0)
    if kind in ("sde", "cps"):
        assert (a["name"], s["sampler"], t["clip_range"], s["noise_level"]) == ("flow_grpo", kind, clip, level)
        assert c["conventions"]["preset"] == "flow_grpo" and t["advantage"] == "global_std"
    else:
        assert a["name"] == kind and (t["clip_range"] == clip if clip else a["nft_beta"] == level)


def test_launcher_without_the_dataset_fails_cleanly(tmp_path):
    r = subprocess.run(["bash", str(REPO / "recipes" / "run_sd3_fast_3p_a1_r2.sh"), "tiny", str(tmp_path), "--print-config"],
                       capture_output=True, text=True, timeout=60, env=env())
    assert r.returncode == 2 and r.stderr.strip().startswith("gerl: error:") and "train.txt" in r.stderr


# verl-omni's run_qwen_image_ocr_lora.sh target_modules, the same as flow_grpo's scripts/train_qwenimage.py
QWEN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]


def test_qwenimage_recipe_and_launcher_are_verl_omnis_ocr_run():
    """verl-omni a1139ba, run_qwen_image_ocr_lora.sh over _generated_diffusion_trainer.yaml's defaults."""
    from gerl.models.family import families

    c = launcher_config("run_qwenimage_fast_ocr_4p_hybrid.sh")
    m, d, s, t, e = c["model"], c["data"], c["sampling"], c["train"], c["engine"]
    assert (m["dtype"], m["resolution"], m["max_sequence_length"], m["gradient_checkpointing"]) == \
        ("bf16", 512, 256, True)
    assert to_dict(load_config(str(REPO / "recipes" / "flow_grpo_qwenimage_ocr.yaml")))["model"]["path"] == \
        "Qwen/Qwen-Image"
    assert (m["lora_rank"], m["lora_alpha"], m["lora_init"], m["lora_targets"]) == (64, 128, "gaussian", QWEN_TARGETS)
    assert QWEN_TARGETS == list(families()["qwenimage"].lora_targets)  # the family's default is the peers' list
    assert (d["prompts_per_step"], d["group_size"]) == (32, 16)
    assert (s["sampler"], s["noise_level"], s["sde_window_size"], s["sde_window_range"], s["timestep_fraction"]) == \
        ("sde", 1.2, 2, [0, 5], 1.0)
    assert (s["num_steps"], s["eval_num_steps"], s["guidance_scale"], s["eval_guidance_scale"]) == (10, 50, 4.0, 4.0)
    assert (t["learning_rate"], t["weight_decay"], t["adam_betas"], t["lr_schedule"]) == \
        (3e-4, 1e-4, [0.9, 0.999], "constant")
    assert (t["clip_range"], t["adv_clip_max"], t["beta"], t["max_grad_norm"], t["inner_epochs"]) == \
        (1e-5, 5.0, 0.0, 1.0, 1)
    images = d["prompts_per_step"] * d["group_size"]
    assert images // t["mini_batch_size"] == 2  # ppo_mini_batch_size=16 prompts × n=16
    assert t["mini_batch_size"] // e["actor_workers"] // t["micro_batch_size"] == 4  # micro 16 per GPU
    assert t["advantage"] == "global_std" and not t["shuffle_mini_batches"] and not t["per_prompt_tracker"]
    assert (c["conventions"]["sde_log_prob"], c["conventions"]["group_std"]) == ("gaussian", "unbiased")
    assert (c["max_steps"], c["validation"]["every"], c["checkpoint"]["every"]) == (300, 30, 30)
    assert c["reward"]["name"] == "ocr"  # verl-omni's Qwen3-VL-8B OCR judge → gerl's OCR reward (the recipe says so)
    assert (e["kind"], e["hybrid"], e["actor_workers"], e["rollout_workers"], e["schedule"]) == \
        ("ray", True, 4, 4, "sync")  # 4 GPUs, actor, rollout and reward colocated

"""The conventions group: defaults are gerl's, presets fill in a peer's conventions without overriding what a config
sets, OCR kwargs reach only OCR rewards, docs/conventions.md names every preset key; `gerl train --print-config`;
the actor's mini-batch order (train.shuffle_mini_batches, which gerl_mm_grpo turns off)."""

from pathlib import Path

import pytest
import torch
import yaml

from gerl.cli import main
from gerl.config import (PRESETS, AlgoConfig, ConventionsConfig, ModelConfig, SamplingConfig, TrainConfig, load_config,
                         to_dict)
from gerl.workers import matching
from gerl.workers.actor import ActorWorker

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "recipes" / "tiny_cpu.yaml")


def test_defaults_are_gerls_conventions():
    c = load_config(None)
    assert to_dict(c)["conventions"] == {"preset": "gerl", "sde_log_prob": "gaussian", "cps_log_prob": "gaussian",
                                         "kl_std": "transition", "group_std": "biased"}
    assert c.train.advantage == "group" and c.reward.kwargs == {}
    assert PRESETS["gerl"] == {}, "the gerl preset is the defaults"


@pytest.mark.parametrize("preset", ["flow_grpo", "gerl_mm_grpo"])
def test_a_preset_sets_every_one_of_its_keys(preset):
    c = to_dict(load_config(None, [f"conventions.preset={preset}"]))
    for key, value in PRESETS[preset].items():
        if key.startswith("ocr:"):
            assert c["reward"]["kwargs"][key[4:]] == value
        else:
            section, leaf = key.split(".")
            assert c[section][leaf] == value, key


def test_explicit_keys_win_over_the_preset(tmp_path):
    c = load_config(None, ["conventions.preset=gerl_mm_grpo", "conventions.group_std=biased", "train.advantage=group",
                           "reward.kwargs.strip=whitespace"])
    assert c.conventions.group_std == "biased" and c.train.advantage == "group"
    assert c.reward.kwargs == {"strip": "whitespace", "strict_confidence": True}
    assert c.conventions.cps_log_prob == "squared_error"  # the rest still comes from the preset
    # a YAML's explicit key wins the same way
    y = tmp_path / "c.yaml"
    y.write_text(yaml.safe_dump({"train": {"advantage": "group"}, "conventions": {"preset": "flow_grpo"}}))
    assert load_config(str(y)).train.advantage == "group"


def test_ocr_kwargs_go_only_to_ocr_rewards():
    c = load_config(None, ["conventions.preset=flow_grpo", "reward.name=jpeg_compressibility"])
    assert c.reward.kwargs == {}
    c = load_config(None, ["conventions.preset=flow_grpo", "reward.name=",
                           "reward.components=[{name: ocr, weight: 1.0}, {name: jpeg_compressibility, weight: 0.1}]"])
    assert c.reward.components[0].kwargs == {"strip": "spaces", "strict_confidence": True}
    assert c.reward.components[1].kwargs == {}


def test_unknown_preset_and_convention_are_named(capsys):
    assert main(["train", TINY, "conventions.preset=flowgrpo", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "conventions.preset" in err and "did you mean 'flow_grpo'" in err
    assert main(["train", TINY, "conventions.kl_std=g2"]) == 2
    assert "transition, noise_coef" in capsys.readouterr().err


def test_docs_table_names_every_preset_key_and_convention():
    doc = (REPO / "docs" / "conventions.md").read_text()
    for preset in PRESETS:
        assert f"`{preset}`" in doc
    for keys in PRESETS.values():
        for key in keys:
            assert (f"`reward.kwargs.{key[4:]}`" if key.startswith("ocr:") else f"`{key}`") in doc, key
    for name in ConventionsConfig.__dataclass_fields__:
        assert f"`conventions.{name}`" in doc, name


def test_print_config_prints_the_resolved_yaml_and_writes_nothing(capsys, tmp_path):
    out = tmp_path / "run"
    # --print-config may sit anywhere among the overrides
    code = main(["train", TINY, "conventions.preset=flow_grpo", "--print-config", f"output_dir={out}", "seed=5"])
    printed = capsys.readouterr().out
    assert code == 0 and not out.exists()
    data = yaml.safe_load(printed)
    assert data["seed"] == 5 and data["output_dir"] == str(out)
    assert data["conventions"]["cps_log_prob"] == "squared_error" and data["train"]["advantage"] == "global_std"
    assert "# derived: images_per_step = 32" in printed  # tiny_cpu: 4 prompts × 8


def test_print_config_redacts_secrets(capsys):
    assert main(["train", TINY, "reward.name=vlm_ocr", "reward.kwargs.api_key=sk-123", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "sk-123" not in out and "api_key: '***'" in out


def test_print_config_is_only_for_train(capsys):
    assert main(["report", "x", "--print-config"]) == 2
    assert "only applies to `gerl train`" in capsys.readouterr().err


@pytest.mark.parametrize("algo", ["flow_grpo", "nft"])
def test_shuffle_mini_batches_false_takes_the_samples_in_order(algo, make_rollout, lora_transformer, monkeypatch):
    """gerl_mm_grpo's train.shuffle_mini_batches=false: each optimizer step trains the next consecutive slice of the
    rollout (GeRL's data.split); true (Flow-GRPO, the default): a seeded permutation. Both algorithm paths."""
    sampling = SamplingConfig(sampler="cps", num_steps=4, sde_window_size=1, sde_window_range=[0, 3],
                              micro_batch_size=8)
    rollout = make_rollout(sampling, lora_transformer())
    rollout.record_sde = algo == "flow_grpo"  # nft keeps only the clean latents, as the engine's roles build it
    batch = rollout.generate(["a"] * 4 + ["b"] * 4, [{}] * 8, torch.tensor([0] * 4 + [1] * 4), step=1)
    adv = torch.linspace(-1, 1, 8)
    order, replay_point = {}, matching._point
    for shuffle in (True, False):
        seen: list[list[int]] = []
        actor = ActorWorker(lora_transformer(), TrainConfig(mini_batch_size=4, micro_batch_size=2,
                                                            shuffle_mini_batches=shuffle),
                            ModelConfig(lora=True), sampling, max_steps=1, images_per_step=8, seed=0,
                            algo=AlgoConfig(name=algo, train_timesteps=1))
        if algo == "flow_grpo":
            replay = actor._replay
            monkeypatch.setattr(actor, "_replay",
                                lambda tr, b, idx, k: (seen.append(idx.tolist()), replay(tr, b, idx, k))[1])
        else:
            monkeypatch.setattr(matching, "_point",
                                lambda b, idx, *a: (seen.append(idx.tolist()), replay_point(b, idx, *a))[1])
        assert actor.update(batch, adv, step=1)["optimizer_steps"] == 2
        order[shuffle] = [i for micro in seen for i in micro]
    assert order[False] == list(range(8))  # [0, 1], [2, 3] | [4, 5], [6, 7]: the first group, then the second
    assert sorted(order[True]) == list(range(8)) and order[True] != list(range(8))

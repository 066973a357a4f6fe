"""FLUX.1 and Qwen-Image on the engine's Ray schedules, two steps each: each family's launcher in its own GPU layout
rehearsed on CPU (FLUX.1-dev: decoupled hosts, one-step-off; Qwen-Image: verl-omni's 4 colocated hosts; bf16, the
GPU backend map), the stream (FLUX.1-schnell with nft, Qwen-Image with Flow-GRPO-Fast and true CFG, generating ahead
of training) and hybrid hosts (FLUX.1-dev, awm, no policy lag). The engine never asks which family it
runs; these runs show that nothing in it assumed SD3. Local sync: tests/models/test_flux.py, test_qwenimage.py. (The
8-GPU hybrid FLUX launchers and Qwen-Image's async one-step-off layout are rehearsed the same way by hand:
docs/lab_notebook.md.)"""

import json

import pytest
import yaml

ray = pytest.importorskip("ray")

from gerl.config import load_config  # noqa: E402
from gerl.engine import pool  # noqa: E402
from gerl.engine.resources import own_ray_env  # noqa: E402
from gerl.trainer import train  # noqa: E402
from tests.engine.test_rehearsal import QUIET, flat, launcher_config, rows  # noqa: E402
from tests.train.helpers import REPO, small_config  # noqa: E402

CPU_HOSTS = ["engine.kind=ray", "engine.device=cpu", "engine.cpus_per_worker=1", "max_steps=2"]


@pytest.fixture(scope="module")
def declared_gpus():
    """One Ray for the module: the 8 GPUs a launcher may ask for, declared, and CPUs for the CPU hosts."""
    own_ray_env()
    ray.init(address="local", num_cpus=32, num_gpus=8, include_dashboard=False, log_to_driver=False)
    with pool.kept():
        yield
    ray.shutdown()


LAUNCHERS = {  # launcher → its tiny model and the layout it must keep in the rehearsal
    "run_flux_fast_ocr_3p_a1_r2.sh": ("tiny-flux", dict(hybrid=False, actor_workers=1, rollout_workers=2,
                                                        schedule="async", max_staleness=1)),
    "run_qwenimage_fast_ocr_4p_hybrid.sh": ("tiny-qwenimage", dict(hybrid=True, actor_workers=4, rollout_workers=4,
                                                                   schedule="sync", max_staleness=1)),
}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_a_family_launcher_rehearses_its_gpu_layout(tmp_path, declared_gpus, capfd, launcher):
    """The launcher's resolved config as a rehearsal, its OCR reward swapped for one that tells the random model's
    images apart (OCR scores them all 0), so that the first update really moves the bf16 policy."""
    model, layout = LAUNCHERS[launcher]
    want = launcher_config(launcher, model, REPO / "assets" / "ocr")
    out = tmp_path / "run"
    train(load_config(None, [f"{k}={json.dumps(v)}" for k, v in flat(want).items()]
                      + [f"output_dir={out}", "engine.rehearse=true", "max_steps=2", "validation.every=-1",
                         "reward.name=jpeg_compressibility", "reward.kwargs={}", *QUIET]))
    assert "gerl: rehearsal of the GPU layout on CPU" in capfd.readouterr().err
    ran = yaml.safe_load((out / "config.yaml").read_text())
    assert ran["model"]["path"] == model and ran["model"]["dtype"] == "bf16"
    assert {k: ran["engine"][k] for k in layout} == {k: want["engine"][k] for k in layout} == layout
    hosts = json.loads((out / "placement.json").read_text())
    n = layout["actor_workers"] if layout["hybrid"] else layout["actor_workers"] + layout["rollout_workers"]
    assert len(hosts) == n and len({h["gpu_ids"][0] for h in hosts}) == n, "each host on its own declared GPU"
    assert all(h["dtype"] == "bf16" and h["device"] == "cpu" for h in hosts)
    steps = rows(out)
    lag = layout["max_staleness"] if layout["schedule"] == "async" else 0  # one-step-off generates one step behind
    assert [r["step"] for r in steps] == [1, 2] and [r["policy_lag"] for r in steps] == [0, lag]
    assert steps[0]["grad_norm"] > 0 and steps[0]["optimizer_steps"] == 2
    assert all(r["ratio_max_dev_before_update"] <= 1e-2 for r in steps if r["policy_lag"] == 0)  # bf16, same weights


EDIT = [f"data.train_prompts={REPO / 'assets/edit/train.jsonl'}", f"data.test_prompts={REPO / 'assets/edit/test.jsonl'}",
        "model.condition_resolution=64", "model.lora_targets=[]"]


# the stream's runs together, then the hybrid ones: each shape's hosts are kept for the next run of that shape
# (gerl/engine/pool.py keeps one shape at a time); any order passes
@pytest.mark.parametrize("model, algo, placement", [
    ("tiny-flux-schnell", ["algo.name=nft", "algo.train_timesteps=2", "algo.anchor_decay_rate=1",
                           "algo.anchor_decay_max=0.5"],
     ["engine.hybrid=false", "engine.schedule=stream", "engine.max_staleness=1"]),
    # the editing families' prompts carry their images across Ray (the rollout hosts read them, the actor trains on
    # the cached reference tokens)
    ("tiny-flux-kontext", ["sampling.sde_window_size=2", *EDIT],
     ["engine.hybrid=false", "engine.schedule=stream", "engine.max_staleness=1"]),
    ("tiny-qwenimage", ["sampling.sde_window_size=2", "model.lora_targets=[]"],
     ["engine.hybrid=false", "engine.schedule=stream", "engine.max_staleness=1"]),
    ("tiny-qwenimage-edit", ["algo.name=awm", "algo.timesteps=stratified", "algo.train_timesteps=2", *EDIT],
     ["engine.hybrid=true", "engine.actor_workers=1"]),
    ("tiny-flux", ["algo.name=awm", "algo.timesteps=stratified", "algo.train_timesteps=2"],
     ["engine.hybrid=true", "engine.actor_workers=1"]),
], ids=["schnell-nft-stream", "kontext-fast-stream", "qwenimage-fast-stream", "qwenimage-edit-awm-hybrid",
        "dev-awm-hybrid"])
def test_a_family_on_the_stream_and_on_hybrid_hosts(tmp_path, declared_gpus, model, algo, placement):
    # nft trains without guidance (NVlabs'; gerl refuses it); dev's guidance embedding, Qwen-Image's true CFG
    guidance = {"tiny-flux-schnell": 1.0, "tiny-flux": 3.5, "tiny-qwenimage": 4.0, "tiny-flux-kontext": 2.5,
                "tiny-qwenimage-edit": 4.0}[model]
    train(small_config(tmp_path, f"model.path={model}", "sampling.num_steps=4", f"sampling.guidance_scale={guidance}",
                       "sampling.sde_window_range=[0,3]", *CPU_HOSTS, *placement, *algo))
    steps = rows(tmp_path)
    assert [r["step"] for r in steps] == [1, 2] and all(r["grad_norm"] > 0 for r in steps)
    if "engine.schedule=stream" in placement:
        assert max(r["policy_lag"] for r in steps) >= 1  # the stream generated ahead of training
    else:
        assert [r["policy_lag"] for r in steps] == [0, 0]  # colocated hosts generate with the weights they train

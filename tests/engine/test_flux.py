"""FLUX.1 on the engine's Ray schedules, two steps each: a FLUX launcher's own GPU layout rehearsed on CPU (decoupled
hosts, one-step-off, bf16, the GPU backend map), the stream (FLUX.1-schnell, nft, generating ahead of training) and
hybrid hosts (FLUX.1-dev, awm, ratio 1 at the first update). The engine never asks which family it runs; these runs
show that nothing in it assumed SD3. Local sync: tests/models/test_flux.py. (The 8-GPU hybrid FLUX launchers are
rehearsed the same way by hand, ~100 s each here: docs/lab_notebook.md.)"""

import json

import pytest
import yaml

ray = pytest.importorskip("ray")

from gerl.config import load_config  # noqa: E402
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
    yield
    ray.shutdown()


def test_the_flux_fast_launcher_rehearses_its_decoupled_one_step_off_layout(tmp_path, declared_gpus, capfd):
    launcher = "run_flux_fast_ocr_3p_a1_r2.sh"
    want = launcher_config(launcher, "tiny-flux", REPO / "assets" / "ocr")
    out = tmp_path / "run"
    train(load_config(None, [f"{k}={json.dumps(v)}" for k, v in flat(want).items()]
                      + [f"output_dir={out}", "engine.rehearse=true", "max_steps=2", "validation.every=-1", *QUIET]))
    assert "gerl: rehearsal of the GPU layout on CPU" in capfd.readouterr().err
    ran = yaml.safe_load((out / "config.yaml").read_text())
    assert ran["model"]["path"] == "tiny-flux" and ran["model"]["dtype"] == "bf16"
    assert {k: ran["engine"][k] for k in ("hybrid", "actor_workers", "rollout_workers", "schedule", "max_staleness")} \
        == {"hybrid": False, "actor_workers": 1, "rollout_workers": 2, "schedule": "async", "max_staleness": 1}
    hosts = json.loads((out / "placement.json").read_text())
    assert len(hosts) == 3 and len({h["gpu_ids"][0] for h in hosts}) == 3, "each host on its own declared GPU"
    assert all(h["dtype"] == "bf16" and h["device"] == "cpu" for h in hosts)
    steps = rows(out)
    assert [r["step"] for r in steps] == [1, 2] and steps[1]["policy_lag"] == 1  # generated one step behind
    assert steps[0]["ratio_max_dev_before_update"] <= 1e-2  # bf16: rollout and actor compute the same forward


@pytest.mark.parametrize("model, algo, placement", [
    ("tiny-flux-schnell", ["algo.name=nft", "algo.train_timesteps=2", "algo.anchor_decay_rate=1",
                           "algo.anchor_decay_max=0.5"],
     ["engine.hybrid=false", "engine.schedule=stream", "engine.max_staleness=1"]),
    ("tiny-flux", ["algo.name=awm", "algo.timesteps=stratified", "algo.train_timesteps=2"],
     ["engine.hybrid=true", "engine.actor_workers=1"]),
], ids=["schnell-nft-stream", "dev-awm-hybrid"])
def test_flux_on_the_stream_and_on_hybrid_hosts(tmp_path, declared_gpus, model, algo, placement):
    train(small_config(tmp_path, f"model.path={model}", "sampling.num_steps=4", "sampling.guidance_scale=3.5",
                       "sampling.sde_window_range=[0,3]", *CPU_HOSTS, *placement, *algo))
    steps = rows(tmp_path)
    assert [r["step"] for r in steps] == [1, 2] and all(r["grad_norm"] > 0 for r in steps)
    if "engine.schedule=stream" in placement:
        assert max(r["policy_lag"] for r in steps) >= 1  # the stream generated ahead of training
    else:
        assert steps[0]["ratio_max_dev_before_update"] <= 1e-5  # awm's surrogate ratio starts at 1 (fp32)

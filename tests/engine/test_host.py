"""Everything a Ray host returns is on the CPU: a pickled CUDA tensor would be restored on the receiver's cuda:0.
No GPU here, so a `meta` tensor stands in for a non-CPU one (the check is the device type, whatever it is)."""

from types import SimpleNamespace

import pytest
import torch

from gerl.engine.host import Host, assert_on_cpu
from gerl.sampling.loop import Embeds, Schedule, Trajectory
from gerl.workers.batch import RolloutBatch


def _batch(device="cpu"):
    z = torch.zeros(2, 1, 4, 2, 2)
    traj = Trajectory(z, z.clone(), torch.zeros(2, 1, device=device), torch.tensor([0]), torch.zeros(2, 4, 2, 2))
    return RolloutBatch(prompts=["a", "b"], metadata=[{}, {}], group_ids=torch.tensor([0, 0]),
                        embeds=Embeds(torch.zeros(2, 3, 8), torch.zeros(2, 8)),
                        schedule=Schedule(torch.linspace(1, 0, 3), torch.tensor([1000.0, 500.0])), traj=traj,
                        images=[], policy_version=0)


def test_a_non_cpu_tensor_anywhere_in_a_return_value_is_named():
    assert_on_cpu((_batch(), {"x": [torch.zeros(1)]}, 3.0, "text"), "ret")
    with pytest.raises(RuntimeError, match=r"ret\[0\]\.traj\.log_probs is on meta, but everything a Ray host returns "
                                           r"must be on the CPU"):
        assert_on_cpu((_batch("meta"), None), "ret")
    with pytest.raises(RuntimeError, match=r"w\['lora_A'\] is on meta"):
        assert_on_cpu({"lora_A": torch.zeros(2, device="meta")}, "w")


def test_host_methods_check_what_they_return():
    host = Host.__new__(Host)  # no Ray, no model: only the return-value checks are under test
    host.device, host.actor = "cpu", None  # a rollout-only host
    host.rollout = SimpleNamespace(generate=lambda *a: (_batch("meta"), None), weights=lambda: {"w": torch.zeros(1)})
    with pytest.raises(RuntimeError, match=r"Host\.generate\(\)\[0\]\.traj\.log_probs is on meta"):
        host.generate(["a"], [{}], torch.tensor([0]), 1, 0)
    assert host.rollout_weights()["w"].device.type == "cpu"
    host.rollout = None  # an actor-only host
    host.actor = SimpleNamespace(update=lambda *a: {"grad_norm": torch.ones(1, device="meta")}, version=1)
    with pytest.raises(RuntimeError, match=r"Host\.update\(\)\['grad_norm'\] is on meta"):
        host.update(_batch(), torch.zeros(2), 1)


def test_the_rollout_hands_back_cpu_tensors(make_rollout):
    from gerl.config import SamplingConfig

    cfg = SamplingConfig(sampler="cps", num_steps=3, sde_window_size=1, sde_window_range=[0, 2], micro_batch_size=2)
    batch = make_rollout(cfg).generate(["a", "a"], [{}, {}], torch.tensor([0, 0]), step=1)
    assert_on_cpu(batch, "batch")

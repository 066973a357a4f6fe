"""Everything a Ray host returns is on the CPU: a pickled CUDA tensor would be restored on the receiver's cuda:0.
No GPU here, so a `meta` tensor stands in for a non-CPU one (the check is the device type, whatever it is)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch.utils._pytree import tree_map

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


class Elsewhere(torch.Tensor):
    """A tensor that reports the meta device but keeps its data on the CPU: an op on it runs on that data and is
    wrapped again, and only a copy to the CPU (.cpu(), .to("cpu")) returns a plain CPU tensor — as a CUDA tensor
    behaves, on a machine without CUDA."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=data.dtype,
                                                device="meta")
        t.held = data
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.held if isinstance(x, Elsewhere) else x  # noqa: E731
        args, kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs or {})
        if func is torch.ops.aten._to_copy.default and torch.device(kwargs.get("device") or "meta").type == "cpu":
            return func(*args, **kwargs)  # the way back to the CPU
        return tree_map(lambda x: Elsewhere(x) if isinstance(x, torch.Tensor) else x, func(*args, **kwargs))


def _elsewhere(obj):
    """A Trajectory or Embeds with every tensor field moved "elsewhere"."""
    return dataclasses.replace(obj, **{f.name: Elsewhere(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                                       if isinstance(getattr(obj, f.name), torch.Tensor)})


def test_the_rollout_hands_back_cpu_tensors_whatever_device_it_computes_on(make_rollout, monkeypatch):
    """The denoiser's trajectory and the text encoder's embeddings come back on another device (as on a GPU); the
    batch generate() returns holds CPU tensors with the same values as a plain CPU run's."""
    import gerl.workers.rollout as rollout
    from gerl.config import SamplingConfig

    held = Elsewhere(torch.arange(3.0))
    assert held.device.type == "meta" and torch.equal((held * 2).cpu(), torch.tensor([0.0, 2.0, 4.0]))
    with pytest.raises(RuntimeError, match=r"x\[0\] is on meta"):
        assert_on_cpu([held + 1], "x")

    cfg = SamplingConfig(sampler="cps", num_steps=3, sde_window_size=1, sde_window_range=[0, 2], micro_batch_size=2)
    args = (["a", "b", "a", "b"], [{}] * 4, torch.tensor([0, 1, 0, 1]))
    plain = make_rollout(cfg).generate(*args, step=1)
    worker = make_rollout(cfg)
    real_denoise, real_embedder = rollout.denoise, worker.embedder
    monkeypatch.setattr(rollout, "denoise", lambda transformer, embeds, *rest: _elsewhere(
        real_denoise(transformer, embeds.to("cpu"), *rest)))
    worker.embedder = lambda prompts, with_negative, images=None: _elsewhere(
        real_embedder(prompts, with_negative=with_negative, images=images))
    batch = worker.generate(*args, step=1)
    assert_on_cpu(batch, "batch")
    for name in ("latents", "next_latents", "log_probs", "step_indices", "final_latents"):
        assert torch.equal(getattr(batch.traj, name), getattr(plain.traj, name)), name
    assert torch.equal(batch.embeds.prompt, plain.embeds.prompt)
    assert torch.equal(batch.embeds.pooled, plain.embeds.pooled)
    assert [im.tobytes() for im in batch.images] == [im.tobytes() for im in plain.images]

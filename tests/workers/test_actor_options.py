"""Actor options that change memory, not results: gradient checkpointing recomputes each block in the backward
pass and must give the same gradients and ratios as keeping the activations."""

import copy

import torch

from gerl.config import ModelConfig, SamplingConfig, TrainConfig
from gerl.workers.actor import ActorWorker

PROMPTS = ["a red cat", "a red cat", "hello 42", "hello 42"]


def test_gradient_checkpointing_gives_the_same_update(make_rollout, lora_transformer):
    base = lora_transformer(randomize=True)
    cfg = SamplingConfig(sampler="cps", num_steps=4, sde_window_size=2, sde_window_range=[0, 3], micro_batch_size=4)
    batch = make_rollout(cfg, base).generate(PROMPTS, [{}] * 4, torch.tensor([0, 0, 1, 1]), step=1)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    grads, metrics = {}, {}
    for ckpt in (False, True):
        tr = copy.deepcopy(base)
        seen = []
        actor = ActorWorker(tr, TrainConfig(micro_batch_size=2), ModelConfig(lora=True, gradient_checkpointing=ckpt),
                            cfg, max_steps=1, images_per_step=4, seed=0,
                            grad_sync=lambda ps, a, b: (seen.append([p.grad.clone() for p in ps]), (a, b))[1])
        assert tr.gradient_checkpointing is ckpt
        metrics[ckpt] = actor.update(batch, adv, step=1)
        grads[ckpt] = torch.cat([g.flatten() for g in seen[0]])
    assert grads[False].abs().sum() > 0
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-4, atol=1e-9)
    assert metrics[True]["ratio_max_dev_before_update"] <= 1e-5
    assert abs(metrics[True]["grad_norm"] - metrics[False]["grad_norm"]) <= 1e-5 * metrics[False]["grad_norm"]

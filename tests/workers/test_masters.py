"""fp32 master weights for full fine-tuning in bf16 on one process (gerl/workers/masters.py): an AdamW step of lr 1e-6
rounds away in bf16 weights (|w| ≈ 0.02: one bf16 ulp ≈ 1e-4) but moves the fp32 masters, which the model's weights
are re-cast from; checkpoints hold the masters (fp32 trainable.safetensors) so a resume is exact, and export the
transformer in the model dtype. Under the data-parallel layer the masters are the sharded parameters themselves
(tests/engine/test_parallel.py)."""

import torch
from safetensors.torch import load_file

from gerl.checkpoint import load_checkpoint, save_checkpoint
from gerl.config import ModelConfig, SamplingConfig, TrainConfig
from gerl.workers.actor import ActorWorker
from tests.engine.test_parallel import _loss, _transformer

LR = 1e-6


def _actor(seed: int = 0) -> ActorWorker:
    tr = _transformer(dtype=torch.bfloat16)
    return ActorWorker(tr, TrainConfig(learning_rate=LR, weight_decay=0.0), ModelConfig(lora=False, dtype="bf16"),
                       SamplingConfig(), max_steps=1, images_per_step=4, seed=seed)


def _one_step(actor: ActorWorker) -> None:
    actor.optimizer.zero_grad(set_to_none=True)  # as each mini-batch of the update loop starts
    for s in range(2):  # two micro-batches accumulate into the fp32 master gradients
        assert actor.backward(_loss(actor.transformer, s, torch.bfloat16) / 2, last=s == 1)
    gn, why = actor.optimizer_step(True)
    assert why is None and gn > 0


def test_bf16_full_fine_tuning_moves_the_fp32_masters(tmp_path):
    actor = _actor()
    assert actor.masters is not None and all(p.dtype == torch.float32 for p in actor.params)
    assert all(p.dtype == torch.bfloat16 for p in actor.model_params)
    before = [p.detach().clone() for p in actor.params]
    bf16_before = [p.detach().clone() for p in actor.model_params]
    _one_step(actor)
    moved = sum(int((p != b).sum()) for p, b in zip(actor.params, before))
    n = sum(p.numel() for p in actor.params)
    bf16_moved = sum(int((p != b).sum()) for p, b in zip(actor.model_params, bf16_before))
    # nearly every master moves by ~lr; a bf16 weight only where lr reaches half an ulp (the smallest weights)
    assert moved > 0.9 * n and bf16_moved < 0.5 * moved
    # the model computes with its masters rounded once
    assert all(torch.equal(p, m.bfloat16()) for m, p in zip(actor.params, actor.model_params))

    # the checkpoint holds the masters (fp32) and exports the transformer in bf16; a resume restores both exactly
    save_checkpoint(tmp_path, 1, actor, {}, 0)
    ckpt = tmp_path / "checkpoints/step_000001"
    saved = load_file(str(ckpt / "trainable.safetensors"))
    assert all(saved[n].dtype == torch.float32 and torch.equal(saved[n], p) for (n, _), p in
               zip(actor.named_params, actor.params))
    export = load_file(str(ckpt / "transformer/diffusion_pytorch_model.safetensors"))
    assert {t.dtype for t in export.values()} == {torch.bfloat16}
    fresh = _actor()
    load_checkpoint(ckpt, fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.params, actor.params))
    assert all(torch.equal(a, b) for a, b in zip(fresh.model_params, actor.model_params))
    # and the next step is the uninterrupted one's (AdamW's moments came back too)
    _one_step(actor)
    _one_step(fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.params, actor.params))

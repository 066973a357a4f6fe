"""The data-parallel layer (gerl/engine/parallel.py) on 2 gloo ranks against 1 process: the tiny FLUX transformer
sharded per block and at the root (fully trained, or a LoRA over its sharded frozen base), or a LoRA replicated,
accumulates gradients over micro-batches without reducing them
until the last backward, then holds the 1-process gradient and takes the same AdamW step; bf16 full fine-tuning keeps
fp32 masters that an lr of 1e-6 moves, and computes exactly what the unsharded bf16 model computes.

Each case runs in two forked processes (they inherit the imported torch; a process group of 2 over a file store) and
writes what it saw; the parent computes the 1-process reference and compares."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gerl.engine import parallel

B, MICRO = 4, 1  # samples per step; per micro-batch. Rank r trains samples 2r, 2r + 1 as two micro-batches.


def _transformer(lora: bool = False, dtype=torch.float32):
    from diffusers import FluxTransformer2DModel

    from gerl.models.loader import add_lora
    from gerl.models.tiny import FLUX_TRANSFORMER_KWARGS

    torch.manual_seed(0)
    tr = FluxTransformer2DModel(**FLUX_TRANSFORMER_KWARGS, guidance_embeds=True).to(dtype)
    if lora:
        tr.requires_grad_(False)
        add_lora(tr, 4, 8.0, [], "gaussian", seed=0)
        with torch.no_grad():  # B = 0 would leave A without a gradient
            for n, p in tr.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    else:
        tr.requires_grad_(True)
    return tr


def _inputs(tr, idx: slice, dtype) -> dict:
    g = torch.Generator().manual_seed(1)
    c = tr.config
    x = torch.randn(B, 16, c.in_channels, generator=g)
    ctx = torch.randn(B, 8, c.joint_attention_dim, generator=g)
    pooled = torch.randn(B, c.pooled_projection_dim, generator=g)
    t = torch.rand(B, generator=g)
    ids = torch.stack([torch.zeros(16), torch.arange(16.0) // 4, torch.arange(16.0) % 4], 1)
    return dict(hidden_states=x[idx].to(dtype), encoder_hidden_states=ctx[idx].to(dtype),
                pooled_projections=pooled[idx].to(dtype), timestep=t[idx].to(dtype), guidance=torch.full((idx.stop - idx.start,), 3.5),
                img_ids=ids.to(dtype), txt_ids=torch.zeros(8, 3, dtype=dtype))


def _loss(tr, s: int, dtype) -> torch.Tensor:
    out = tr(**_inputs(tr, slice(s, s + MICRO), dtype), return_dict=False)[0]
    return out.float().square().mean()


def _step(tr, params, samples, dtype, dp=None, lr=1e-3) -> dict:
    """Backward on each sample as a micro-batch (the loss a mean over this rank's samples), an AdamW step. Returns
    what the test reads: whether any gradient existed before the last backward, the gradients, the weights."""
    grads_before_last = []
    for i, s in enumerate(samples):
        last = i == len(samples) - 1
        if dp is not None:
            dp.sync_gradients(last)
        (_loss(tr, s, dtype) / len(samples)).backward()
        if not last:
            grads_before_last.append(any(p.grad is not None for p in params))
    full = (lambda t: dp.full(t)) if dp is not None else (lambda t: t)
    grads = [full(p.grad).clone() for p in params]
    torch.optim.AdamW(params, lr=lr, weight_decay=0.0).step()
    return {"early_grads": any(grads_before_last), "grads": grads, "weights": [full(p.detach()).clone() for p in params]}


def _rank(rank: int, store: str, out: str, case: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        lora, shard, dtype = {"shard": (False, True, torch.float32), "replicate-lora": (True, False, torch.float32),
                              "replicate-merged": (True, False, torch.float32),
                              "shard-lora": (True, True, torch.float32), "shard-bf16": (False, True, torch.bfloat16)}[case]
        tr = _transformer(lora, dtype)
        if case == "replicate-merged":  # model.merge_lora's layers under replicas (the roles merge before parallelize)
            from gerl.models.lora_merge import use_merged_lora

            use_merged_lora(tr)
        plain = copy.deepcopy(tr)  # the unsharded model, for the bf16 forward parity
        dp = parallel.parallelize(tr, None, group=dist.group.WORLD, shard=shard, dtype=dtype, lora=lora)
        params = [p for p in tr.parameters() if p.requires_grad]
        res = {"blocks_managed": all(isinstance(b, parallel_module()) for b in [*parallel.transformer_blocks(tr), tr]),
               "param_dtypes": sorted({str(p.dtype) for p in params}),
               "local_fraction": sum(parallel.local(p).numel() for p in params) / sum(p.numel() for p in params)}
        if case == "shard-bf16":
            with torch.no_grad():
                ours, theirs = _loss_out(tr, dtype), _loss_out(plain, dtype)
            res["forward_equal"] = torch.equal(ours, theirs)
            before = [dp.full(p.detach()).clone() for p in params]
            after = _step(tr, params, [2 * rank, 2 * rank + 1], dtype, dp, lr=1e-6)["weights"]
            res["masters_moved"] = sum(int((a != b).sum()) for a, b in zip(after, before))
            res["bf16_moved"] = sum(int((a.bfloat16() != b.bfloat16()).sum()) for a, b in zip(after, before))
        else:
            if case == "replicate-merged":
                with torch.no_grad():
                    res["out_before"] = _loss_out(tr, dtype)
            res.update(_step(tr, params, [2 * rank, 2 * rank + 1], dtype, dp))
            if case == "replicate-merged":  # the next forward re-merges the stepped adapter (the root's hook)
                with torch.no_grad():
                    res["out_after"] = _loss_out(tr, dtype)
        if rank == 0:
            torch.save(res, out)
    finally:
        dist.destroy_process_group()


def parallel_module():
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule  # replicate's modules are FSDPModules too


def _loss_out(tr, dtype) -> torch.Tensor:
    return tr(**_inputs(tr, slice(0, B), dtype), return_dict=False)[0]


def _two_ranks(tmp_path, case: str) -> dict:
    out = tmp_path / f"{case}.pt"
    # fork: the ranks inherit the imported torch instead of importing it again (seconds on a busy machine)
    mp.start_processes(_rank, args=(str(tmp_path / f"{case}.store"), str(out), case), nprocs=2, start_method="fork")
    return torch.load(out)


@pytest.mark.parametrize("case, lora", [("shard", False), ("replicate-lora", True), ("shard-lora", True),
                                        ("replicate-merged", True)])
def test_two_ranks_accumulate_then_reduce_to_the_one_process_gradient(tmp_path, case, lora):
    """Broken versions this catches: sharding the root only (blocks not managed, and a rank holds more than its
    half), reducing on every backward (a gradient exists before the last one: accumulation without no_sync),
    never reducing or summing instead of averaging (the gradients differ from one process's)."""
    got = _two_ranks(tmp_path, case)
    tr = _transformer(lora)
    if case == "replicate-merged":  # against one process on the same merged layers (a re-merge after its step too)
        from gerl.models.lora_merge import use_merged_lora

        use_merged_lora(tr)
    params = [p for p in tr.parameters() if p.requires_grad]
    ref = _step(tr, params, list(range(B)), torch.float32)
    assert got["blocks_managed"]
    if case.startswith("shard"):
        assert got["local_fraction"] <= 0.5 + 0.01  # each rank keeps half of every weight (dim 0 rounds up)
    else:
        assert got["local_fraction"] == 1.0  # replicas
    assert not got["early_grads"], "gradients were reduced before the last backward of the step"
    for g, r in zip(got["grads"], ref["grads"]):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-9)
    # one AdamW step of lr 1e-3: the same within 1 % of a step (entries whose gradient is about eps move by a
    # fraction of lr that the gradient's last bits decide)
    for w, r in zip(got["weights"], ref["weights"]):
        torch.testing.assert_close(w, r, rtol=0, atol=1e-5)
    if case == "replicate-merged":  # a stale merged weight (no re-merge after the replicated step) fails here
        with torch.no_grad():
            ref_after = _loss_out(tr, torch.float32)
        moved = (got["out_before"] - ref_after).abs().max()
        assert (got["out_after"] - ref_after).abs().max() < 1e-3 * moved, moved


def test_bf16_shards_keep_fp32_masters_and_compute_as_the_bf16_model(tmp_path):
    """FSDP2's mixed precision: the sharded weights are fp32 masters; each forward casts them to bf16, exactly the
    unsharded bf16 model's weights and computation (inputs are not cast again: FLUX's rotary embedding stays fp32);
    a step of lr 1e-6 moves the masters where the bf16 weights themselves barely move."""
    got = _two_ranks(tmp_path, "shard-bf16")
    assert got["param_dtypes"] == ["torch.float32"]
    assert got["forward_equal"]
    assert got["masters_moved"] > 100 * max(got["bf16_moved"], 1)


def test_world_one_group_shards_on_one_process():
    """engine.fsdp with one actor rank (the local engine, a one-GPU benchmark): FSDP2 over a group of this process
    alone, in a child so that this process's torch.distributed state stays untouched."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_world_one, args=(q,))
    p.start()
    p.join(120)
    assert q.get(timeout=5) == (1, True, True)


def _world_one(q) -> None:
    torch.set_num_threads(1)
    tr = _transformer()
    ref = copy.deepcopy(tr)
    dp = parallel.parallelize(tr, None, group=parallel.single_process_group("cpu"), shard=True,
                              dtype=torch.float32, lora=False)
    with torch.no_grad():
        same = torch.equal(_loss_out(tr, torch.float32), _loss_out(ref, torch.float32))
    q.put((dp.world, same, all(isinstance(b, parallel_module()) for b in parallel.transformer_blocks(tr))))
    dist.destroy_process_group()

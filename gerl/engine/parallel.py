"""The data-parallel layer of the actor ranks: torch's own engines, applied in one place, in a fixed order.

`parallelize` is the one call (ActorWorker makes it through the `parallel` the actor role hands it, before the
optimizer exists): over the actor ranks' process group (gerl/engine/dist.py: NCCL on GPUs, gloo on the CPU) it turns
the transformer into either

- replicas (`engine.fsdp=false`, more than one actor rank): FSDP2's `replicate`, per transformer block then the root
  — DDP's contract (every rank holds the whole model, gradients averaged over the ranks), bucketed by block and
  all-reduced as each block's backward ends, so the reduction overlaps the rest of the backward. A LoRA replicates
  only its adapters (the frozen base is left out of the engine: nothing of it is copied or reduced);
- shards (`engine.fsdp=true`, any number of ranks, 1 included): FSDP2's `fully_shard`, per transformer block then the
  root. Each rank keeps 1/N of every parameter, its gradient and its AdamW state; a block's weights are all-gathered
  for its forward (and again for its backward), its gradients reduce-scattered. A LoRA is sharded with its frozen
  base; the frozen copy that full fine-tuning's KL reference needs is sharded the same way.

Mixed precision, the same in both: trained weights are stored in fp32 — they are the fp32 master weights, and their
AdamW state is fp32 — and FSDP2 casts them to the model dtype for each forward (`param_dtype`), exactly the values a
bf16 model re-cast from its masters holds; gradients are reduced in fp32 (`reduce_dtype`) and accumulate in fp32
over micro-batches. A LoRA keeps every parameter in its own dtype (the base in the model dtype, the adapter in fp32,
as unsharded). Inputs are not cast by FSDP: the model family already casts them to `compute_dtype`, so a sharded
forward is the unsharded model's computation.

Every rank must then run the same forwards and backwards in the same order (each carries collectives): the actor's
loops give every rank the same number of micro-batches, and a rank whose loss is not finite still goes backward
(its step is skipped on every rank). Gradient accumulation: `sync_gradients(last)` before each backward reduces only
on the last backward before an optimizer step.

The model, the losses and the update loops never ask whether they are sharded: ActorWorker reads full tensors
through `full`, writes them through `load_full`, agrees on skipped steps through `agree`, and averages its logged
statistics over the ranks through `mean_stats` / `max` / `sum`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

# FSDP2 warns that a block returns a view of its output (FLUX's single-stream blocks split their output into text
# and image halves); no caller changes those views in place, and the 2-rank tests show equal gradients.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def transformer_blocks(transformer) -> list[torch.nn.Module]:
    """The transformer's repeated blocks, in order, from the lists its model family names (Family.block_lists)."""
    from gerl.models.family import family_of

    return [b for name in family_of(transformer).block_lists for b in getattr(transformer, name)]


def _dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` (the whole of an unsharded or replicated tensor)."""
    return t.to_local() if _dtensor(t) else t


@dataclass
class DataParallel:
    """What `parallelize` did, and the few operations the actor needs from it."""

    group: object  # the actor ranks' torch.distributed group
    mesh: object  # the 1-D DeviceMesh over it
    sharded: bool  # fully_shard (true) or replicate
    module: torch.nn.Module  # the trained transformer (an FSDP2 module)
    compute_dtype: torch.dtype  # the dtype forwards compute in

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group)

    @property
    def world(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self.group)

    def sync_gradients(self, last: bool) -> None:
        """Reduce gradients in the coming backward only if it is the last before an optimizer step (accumulation)."""
        self.module.set_requires_gradient_sync(last)

    def agree(self, params, loss_ok: bool, grads_ok: bool) -> tuple[bool, bool]:
        """Every rank's "was my loss finite", "were my (reduced, unscaled) gradients finite", summed over the ranks as a
        CPU tensor — the reason the group's backend map has a CPU entry — so that every rank skips the same steps.
        With shards each rank has seen only its own part of the gradients: the check is global only after this."""
        import torch.distributed as dist

        flags = torch.tensor([0.0 if loss_ok else 1.0, 0.0 if grads_ok else 1.0])
        dist.all_reduce(flags, group=self.group)
        return bool(flags[0] == 0), bool(flags[1] == 0)

    def sum(self, values: list[float]) -> list[float]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def max(self, value: float) -> float:
        """The largest over the ranks (NaN if any rank's is NaN)."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64)
        nan = torch.tensor([float(value != value)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        dist.all_reduce(nan, group=self.group)
        return float("nan") if nan.item() else t.item()

    def mean_stats(self, sums: dict[str, float], count: int) -> dict[str, float]:
        """Means over every rank's micro-batches: Σ_ranks sums / Σ_ranks counts, key by key (a rank whose every loss
        was non-finite has no keys, so the keys travel too)."""
        import torch.distributed as dist

        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, (sums, count), group=self.group)
        total = sum(c for _, c in everyone)
        keys = sorted({k for s, _ in everyone for k in s})
        return {k: sum(s.get(k, 0.0) for s, _ in everyone) / max(total, 1) for k in keys}

    def full(self, t: torch.Tensor) -> torch.Tensor:
        """The whole tensor on this device (an all-gather over the ranks for a shard: every rank must call it)."""
        return t.full_tensor() if _dtensor(t) else t

    @torch.no_grad()
    def load_full(self, target: torch.Tensor, full: torch.Tensor) -> None:
        """Write a whole tensor, held by every rank, into `target` (a shard takes its own slice; no collective)."""
        if _dtensor(target):
            from torch.distributed.tensor import distribute_tensor

            full = distribute_tensor(full.to(target.device, target.dtype), target.device_mesh, target.placements,
                                     src_data_rank=None)
        target.copy_(full)


def single_process_group(device_type: str):
    """A process group of this process alone (started here unless one exists): what `engine.fsdp=true` shards over
    with the local engine, and what a one-GPU benchmark of the sharded code path uses."""
    import socket

    import torch.distributed as dist

    from gerl.engine import dist as gdist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        gdist.init_process_group(gdist.backend_map(gpu=device_type == "cuda"), f"127.0.0.1:{port}", 0, 1)
    return dist.group.WORLD


def forget_meshes() -> None:
    """Drop torch's DTensor sharding caches once this process has left its process group (a Ray host kept for the
    next run: gerl/engine/pool.py). They key their answers by DeviceMesh equality, which ignores which rank this
    process is, so a process back as another rank would get its former rank's shard offsets: a sharded checkpoint
    loaded into kept hosts whose ranks had swapped put each rank's half of every weight on the other one."""
    import sys

    if "torch.distributed.tensor" not in sys.modules:  # never sharded anything here
        return
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's (2.13)
    if clear_native is not None:
        clear_native()


def mixed_precision(dtype: torch.dtype, lora: bool):
    """FSDP2's policy: full fine-tuning computes in the model dtype from fp32 masters; a LoRA keeps each parameter's
    own dtype. Gradients are reduced in fp32 either way; inputs are left to the model family."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = None if lora or dtype == torch.float32 else dtype
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def keep_fp32_masters(module: torch.nn.Module) -> None:
    """Trained weights are stored in fp32 (the masters) before the engine takes them."""
    for p in module.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()


def apply_fsdp(module: torch.nn.Module, mesh, mp_policy) -> None:
    """FSDP2: shard each transformer block, then the root (its embedders, norms and output projection). The root is
    resharded after its forward too, so a write into the sharded weights between forwards (the EMA or an anchor
    swapped in, a loaded checkpoint) is what the next forward all-gathers."""
    from torch.distributed.fsdp import fully_shard

    for block in transformer_blocks(module):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=True)
    fully_shard(module, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=True)


def apply_replicate(module: torch.nn.Module, mesh, mp_policy) -> None:
    """FSDP2's replicate (DDP): each transformer block, then the root. Frozen weights stay outside the engine."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    frozen = {p for p in module.parameters() if not p.requires_grad}
    for block in transformer_blocks(module):
        replicate(block, mesh=mesh, mp_policy=mp_policy, ignored_params=frozen)
    replicate(module, mesh=mesh, mp_policy=mp_policy, ignored_params=frozen)


def parallelize(transformer: torch.nn.Module, reference: torch.nn.Module | None, *, group, shard: bool,
                dtype: torch.dtype, lora: bool) -> DataParallel:
    """Apply the data-parallel engine to the trained transformer (and shard the frozen KL reference with it).

    Args:
        transformer: the actor's transformer, its trained parameters marked requires_grad, on its device.
        reference: full fine-tuning's frozen copy for the KL term / DGPO's base, or None.
        group: the actor ranks' process group (world 1 is fine for shards).
        shard: fully_shard (engine.fsdp) instead of replicate.
        dtype: model.dtype as a torch dtype: what forwards compute in.
        lora: whether only a LoRA adapter trains.
    """
    from torch.distributed.device_mesh import DeviceMesh

    device_type = next(transformer.parameters()).device.type
    mesh = DeviceMesh.from_group(group, device_type)
    if not lora:
        keep_fp32_masters(transformer)
    mp_policy = mixed_precision(dtype, lora)
    if shard:
        apply_fsdp(transformer, mesh, mp_policy)
        if reference is not None:  # frozen, in the model dtype: sharded to save its memory, nothing else
            apply_fsdp(reference, mesh, mixed_precision(dtype, lora=True))
    else:
        apply_replicate(transformer, mesh, mp_policy)
    transformer.gerl_compute_dtype = dtype  # read by gerl.models.family.compute_dtype
    return DataParallel(group, mesh, shard, transformer, dtype)

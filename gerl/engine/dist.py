"""torch.distributed for the Ray hosts: which backend carries which device's tensors, and the group set-up.

A GPU run starts every process group with a per-device backend map, as GeRL and verl do: `cpu:gloo,cuda:nccl`.
NCCL has no CPU backend, so a CPU tensor (the data-parallel ranks' "was my loss finite?" flag) needs gloo beside it;
a pure "nccl" group fails on it at the first optimizer step. Two cases swap NCCL for gloo on CUDA tensors:

- hosts that share one GPU (engine.gpus_per_worker < 1): NCCL cannot put two ranks on one device; gloo copies
  CUDA tensors through the host, slower but correct (a smoke-test layout, not a production one);
- a rehearsal (engine.rehearse=true): the GPU run's map with only NCCL replaced, so that a CPU tensor sent on a
  group that has no CPU entry still fails exactly as it would on the GPUs.
"""

from __future__ import annotations

from datetime import timedelta

GPU_BACKENDS = "cpu:gloo,cuda:nccl"  # the map a GPU run starts its process groups with
CPU_BACKENDS = "gloo"  # a CPU run: gloo for everything


def parse_backends(spec: str) -> dict[str, str]:
    """"cpu:gloo,cuda:nccl" → {"cpu": "gloo", "cuda": "nccl"}; a bare backend covers the devices it supports, as
    torch.distributed reads it ("nccl" → cuda only, "gloo" → cpu and cuda)."""
    if ":" not in spec:
        return {"nccl": {"cuda": "nccl"}, "gloo": {"cpu": "gloo", "cuda": "gloo"}}[spec]
    return dict(item.split(":", 1) for item in spec.split(","))


def format_backends(backends: dict[str, str]) -> str:
    return ",".join(f"{d}:{b}" for d, b in backends.items())


def rehearsal_backends(spec: str) -> str:
    """The GPU map with every NCCL entry replaced by gloo on the same device, nothing else added."""
    return format_backends({d: "gloo" if b == "nccl" else b for d, b in parse_backends(spec).items()})


def backend_map(gpu: bool, rehearse: bool = False, shared_gpu: bool = False) -> str:
    """The backend map a host starts its process group with (see the module docstring)."""
    if not gpu:
        return CPU_BACKENDS
    if rehearse:
        return rehearsal_backends(GPU_BACKENDS)
    if shared_gpu:
        return format_backends({d: "gloo" for d in parse_backends(GPU_BACKENDS)})
    return GPU_BACKENDS


def init_process_group(backends: str, addr: str | None, rank: int, world: int, timeout_s: float = 1800.0) -> None:
    """Join the default group at tcp://addr, or (addr None) where a launcher's MASTER_ADDR/MASTER_PORT say."""
    import torch.distributed as dist

    dist.init_process_group(backends, init_method=f"tcp://{addr}" if addr else "env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def new_group(ranks: list[int], backends: str):
    """A subgroup with the same per-device map (every process must call this for every group, in the same order)."""
    import torch.distributed as dist

    return dist.new_group(ranks, backend=backends)

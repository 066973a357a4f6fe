"""The per-device backend map of the Ray hosts' process groups, and why it matters: a CPU tensor on a group whose
map has no CPU entry fails (as a pure "nccl" group does on the GPUs), which a rehearsal reproduces on CPU."""

import pytest
import torch
import torch.distributed as dist

from gerl.engine import dist as gdist


def test_backend_maps():
    assert gdist.parse_backends("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert gdist.parse_backends("nccl") == {"cuda": "nccl"}  # torch reads a bare "nccl" as CUDA only
    assert gdist.backend_map(gpu=True) == "cpu:gloo,cuda:nccl"  # GeRL's and verl's
    assert gdist.backend_map(gpu=False) == "gloo"
    assert gdist.backend_map(gpu=True, rehearse=True) == "cpu:gloo,cuda:gloo"
    assert gdist.backend_map(gpu=True, shared_gpu=True) == "cpu:gloo,cuda:gloo"  # NCCL cannot join ranks on one GPU
    # only NCCL is replaced: a CUDA-only map stays CUDA-only, so a CPU tensor still has no backend
    assert gdist.rehearsal_backends("nccl") == "cuda:gloo"
    assert gdist.rehearsal_backends("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:gloo"


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("cpu:gloo,cuda:gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_cpu_flag_fails_on_the_rehearsed_pure_nccl_group_and_passes_on_the_gpu_map(world_of_one):
    """The reviewer's crash (`No backend type associated with device type cpu`), reproduced without a GPU."""
    pure_nccl = dist.new_group([0], backend=gdist.rehearsal_backends("nccl"))
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.tensor([1.0]), group=pure_nccl)
    mapped = gdist.new_group([0], gdist.backend_map(gpu=True, rehearse=True))
    flag = torch.tensor([1.0])
    dist.all_reduce(flag, group=mapped)
    assert flag.item() == 1.0

"""The per-device backend map of the Ray hosts' process groups, and why it matters: a CPU tensor on a group whose
map has no CPU entry fails (as a pure "nccl" group does on the GPUs), which a rehearsal reproduces on CPU.

The maps are read by torch.distributed's own parser (BackendConfig), and the groups are formed by two real
processes, so that an all-reduce has something to reduce."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.distributed_c10d import Backend, BackendConfig

from gerl.engine import dist as gdist


def torch_reads(spec: str) -> dict[str, str]:
    """The device → backend map torch.distributed builds from a backend string."""
    return {d: str(b) for d, b in BackendConfig(Backend(spec)).get_device_backend_map().items()}


@pytest.mark.parametrize("spec", ["nccl", "gloo", "cpu:gloo,cuda:nccl", "cuda:nccl", "cpu:gloo,cuda:gloo", "cuda:gloo"])
def test_parse_backends_reads_a_spec_as_torch_does(spec):
    assert gdist.parse_backends(spec) == torch_reads(spec)


def test_each_map_gives_the_devices_the_backends_they_need():
    gpu = torch_reads(gdist.backend_map(gpu=True))
    # a GPU run: NCCL for CUDA tensors (the gradients, the weight broadcast) and gloo for the CPU flag
    assert gpu == {"cpu": "gloo", "cuda": "nccl"}
    assert torch_reads(gdist.backend_map(gpu=False)) == {"cpu": "gloo", "cuda": "gloo"}  # gloo for everything
    # the rehearsal: the GPU map with NCCL played by gloo and nothing else changed, so a missing CPU entry stays missing
    assert torch_reads(gdist.backend_map(gpu=True, rehearse=True)) == {
        d: "gloo" if b == "nccl" else b for d, b in gpu.items()}
    assert torch_reads(gdist.rehearsal_backends("nccl")) == {"cuda": "gloo"}
    assert torch_reads(gdist.rehearsal_backends("cpu:gloo,cuda:nccl")) == {"cpu": "gloo", "cuda": "gloo"}
    # hosts sharing one GPU: NCCL cannot put two ranks on one device, so every device of the GPU map gets gloo
    assert torch_reads(gdist.backend_map(gpu=True, shared_gpu=True)) == {d: "gloo" for d in gpu}


def _rank(rank: int, store: str, out: str) -> None:
    """One of two data-parallel ranks: the rehearsed pure-NCCL group refuses the CPU flag; the mapped group carries
    it (DataParallel.agree, as the actor's optimizer step calls it once the engine has reduced the gradients)."""
    from gerl.engine.parallel import DataParallel

    dist.init_process_group(gdist.backend_map(gpu=True, rehearse=True), init_method=f"file://{store}", rank=rank,
                            world_size=2)
    try:
        pure_nccl = dist.new_group([0, 1], backend=gdist.rehearsal_backends("nccl"))
        try:
            dist.all_reduce(torch.tensor([1.0]), group=pure_nccl)
            refused = ""
        except RuntimeError as e:
            refused = str(e)
        group = gdist.new_group([0, 1], gdist.backend_map(gpu=True, rehearse=True))
        dp = DataParallel(group=group, mesh=None, sharded=False, module=None, compute_dtype=torch.float32)
        # rank 0: finite loss, rank 1: non-finite loss; rank 1 alone saw a non-finite gradient in its shard
        loss_ok, grads_ok = dp.agree([], loss_ok=rank == 0, grads_ok=rank == 0)
        stats = dp.mean_stats({"policy_loss": 1.0 + rank, **({"kl": 4.0} if rank else {})}, count=1 + rank)
        with open(f"{out}/{rank}.json", "w") as f:
            json.dump({"refused": refused, "loss_ok": loss_ok, "grads_ok": grads_ok, "stats": stats,
                       "max": dp.max(float(rank))}, f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_refuse_the_cpu_flag_on_pure_nccl_and_agree_on_the_gpu_map(tmp_path):
    """The reviewer's crash (`No backend type associated with device type cpu`) reproduced without a GPU, and the
    fix at work between two processes: both skip the step rank 1 could not take, and log the means over both
    ranks' micro-batches (rank 0's one micro-batch sums to policy_loss 1, rank 1's two to 2 and to kl 4)."""
    # fork: the ranks inherit the imported torch instead of importing it again (seconds on a busy machine); they
    # touch only tiny CPU tensors and leave through os._exit, so nothing of this process (Ray, atexit) runs in them
    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="fork")
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    for g in got:
        assert "No backend type associated with device type cpu" in g["refused"]
        assert g["loss_ok"] is False and g["grads_ok"] is False  # one rank's bad loss or gradient stops both
        assert g["stats"] == {"policy_loss": 1.0, "kl": 4.0 / 3} and g["max"] == 1.0  # (1 + 2) / 3; 4 / 3

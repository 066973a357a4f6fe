"""train.deterministic: what a process that trains or generates sets so that a GPU run repeats bit for bit.

On the CPU a run already repeats exactly (every random draw comes from a generator seeded by the run's seed, and the
CPU kernels are deterministic for a fixed thread count), which is what the resume tests check. On a GPU some
kernels are not: cuBLAS picks reduction splits by workspace, atomics-based kernels (scatter/index_add, attention
backward) add in arrival order, cuDNN autotunes its algorithms. `apply` switches all of that to the deterministic
choices, as verl-omni's and miles' deterministic modes do; the trainer calls it before it loads a model (the local
engine's process) and every Ray host first thing in its process, before CUDA starts there.
"""

from __future__ import annotations

import hashlib
import os
import random

import numpy as np
import torch

CUBLAS_WORKSPACE = ":4096:8"  # 8 buffers of 4 MiB per stream: deterministic, and not workspace-starved (":16:8" is too)


def apply(seed: int, who: str) -> dict:
    """Deterministic algorithms in this process, and its global RNGs seeded from (seed, who). Returns what it set,
    for the run's placement record. cuBLAS reads CUBLAS_WORKSPACE_CONFIG when this process first uses it, so a
    process whose CUDA has already started cannot be made deterministic: that raises."""
    if torch.cuda.is_initialized() and not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
        raise RuntimeError("train.deterministic needs CUBLAS_WORKSPACE_CONFIG set before CUDA starts, and CUDA has "
                           f"already started in this process ({who}); set CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE}")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # a value the user chose wins
    torch.use_deterministic_algorithms(True)  # warn_only=False: with it, SDPA's backward takes its deterministic path
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # gerl itself draws nothing from the global generators; a library that does now draws the same in every run
    s = process_seed(seed, who)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)  # CPU and every CUDA device (queued until CUDA starts)
    return state()


def state() -> dict:
    """This process's determinism settings as the placement record shows them."""
    return {"deterministic": torch.are_deterministic_algorithms_enabled(),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark}


def process_seed(seed: int, who: str) -> int:
    """The global RNG seed of process `who` (e.g. "driver", "actor0"): distinct per process, fixed per run."""
    return point_seed(seed, "process", who)


def point_seed(*parts: int | str) -> int:
    """A reproducible 63-bit seed for a tuple such as (seed, step, rank, epoch, "sample", i): a hash, so that no two
    tuples share a seed (a linear mix would give step 1 / sample 0 the seed of step 0 / sample 65537)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)

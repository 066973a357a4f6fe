"""Shared fixtures: the tiny random SD3 (built once per session) and a saved copy of it on disk.

`tiny_pipe` is shared by every test in the session: a test that changes the transformer (LoRA, training) must
work on `copy.deepcopy(tiny_pipe.transformer)` — use the `lora_transformer` factory — never on the session one.
"""

from __future__ import annotations

import copy
import os

# The tiny model's ops are too small to gain from intra-op threads, and on a shared 2-core box two threads per
# process make the suite several times slower: one thread here, and (through the environment, before torch is
# imported) in every process a test starts — CLI runs, benchmarks, Ray workers. OpenMP threads spin while they wait,
# so 2-thread subprocesses beside the other test process burned CPU for nothing (measured: the suite took 10:20
# without this and 9:39 with it, same machine). A test that wants more threads sets them itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Where a process still runs several threads (a Ray host given 2 cores, a test that asks for more), its idle OpenMP
# threads sleep instead of spinning: on 2 cores shared by 3 test processes a spinning thread takes a core from a
# process with work.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Inductor compiles in this process instead of starting a pool of compile workers (each imports torch): on 2 busy
# cores the pool only adds CPU — the cold inductor test took 60.6 core-s with 2 compile threads, 53.2 with 1.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


# The slow tier (marker `slow`): real Ray clusters, real servers, processes of their own (a gloo group, a training
# run, the CLI and benchmarks), the learning test and every other single check of 10 s or more in a fresh-clone
# suite. CI runs every tier; while working, `bash scripts/test.sh -m "not slow"` runs the rest (2:43 in a fresh clone).
SLOW = ("tests/engine/", "tests/train/test_learning.py", "tests/train/test_interrupt.py", "tests/train/test_faults.py",
        "tests/scripts/", "tests/rewards/test_vlm.py", "tests/test_plan.py::test_cli_", "tests/logging/test_metrics.py",
        "tests/rewards/test_preference.py::test_ray_", "tests/test_plan_shards.py::test_a_ranks_shards",
        "tests/workers/test_reward_exec.py::test_training_survives", "tests/models/test_ocr_mini.py::test_pretraining",
        "tests/test_plan.py::test_training_peak_matches_the_cpu_allocator_on_two_real_width_blocks",
        "tests/models/test_compile.py::test_a_training_run_compiles")


# Started first, in this order: the longest modules, so that no process is left alone with one of them at the
# end. Measured on 2 cores: the learning test ~135 s (two training processes), the Ray modules 45–120 s each, the
# real-width fp16 and launcher checks ~65 s together, the FLUX schedules ~80 s.
FIRST = ("tests/train/test_learning.py", "tests/engine/test_ray_engine.py", "tests/engine/test_stream.py",
         "tests/engine/test_rehearsal.py", "tests/scripts/test_bench_gpu.py", "tests/engine/test_algorithms.py",
         "tests/engine/test_families.py", "tests/engine/test_rehearsal_two_nodes.py")


def pytest_collection_modifyitems(config, items):
    """scripts/test.sh runs the suite in 3 processes, a module at a time each (pytest-xdist --dist loadfile
    --no-loadscope-reorder): a module's tests share its module-scoped fixtures (a Ray cluster starts once per
    module); three modules run side by side, each Ray its own."""
    def module(item) -> str:
        return item.nodeid.split("::")[0]

    items.sort(key=lambda item: FIRST.index(module(item)) if module(item) in FIRST else len(FIRST))  # stable
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_pipe():
    """The tiny SD3 pipeline (seed 0, fp32, CPU, eval mode) with its progress bar off. Do not mutate."""
    from gerl.models.tiny import build_tiny_sd3

    pipe = build_tiny_sd3(0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A diffusers directory holding the tiny SD3 (seed 0), loadable with from_pretrained / model.path."""
    from gerl.models.tiny import save_tiny_sd3

    path = tmp_path_factory.mktemp("tiny_sd3")
    save_tiny_sd3(path, 0)
    return path


@pytest.fixture
def lora_transformer(tiny_pipe):
    """Factory: a deep copy of the tiny transformer with a LoRA adapter attached.

    With `randomize=True` the (zero-initialised) lora_B weights are filled with seeded noise so that the adapter
    changes the model's output: a test of adapter-aware code passes trivially on an identity adapter. `dtype`: the
    base weights' (the adapter stays fp32, as add_lora keeps it).
    """

    def make(rank: int = 4, alpha: float = 8.0, randomize: bool = False, seed: int = 0, scale: float = 0.05,
             dtype: torch.dtype = torch.float32):
        from gerl.models.loader import add_lora

        tr = copy.deepcopy(tiny_pipe.transformer).to(dtype)
        add_lora(tr, rank, alpha, ["to_q", "to_k", "to_v", "to_out.0"])
        if randomize:
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, p in tr.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=g) * scale)
        return tr

    return make


@pytest.fixture(scope="session")
def tiny_embedder(tiny_pipe):
    """TextEmbedder over the session pipe (T5 length = the tiny model's TOKEN_LENGTH); read-only, cache shared."""
    from gerl.models.loader import TextEmbedder
    from gerl.models.tiny import TOKEN_LENGTH

    return TextEmbedder(tiny_pipe, TOKEN_LENGTH)


@pytest.fixture
def make_rollout(tiny_pipe, tiny_embedder):
    """Factory: a RolloutWorker over `transformer` (default: the session one) with the session VAE and scheduler.

    Only the transformer is swapped in, so a test can roll out a LoRA copy without touching the session pipe.
    """
    from types import SimpleNamespace

    from gerl.models.tiny import RESOLUTION
    from gerl.workers.rollout import RolloutWorker

    def make(sampling, transformer=None, seed: int = 0):
        pipe = SimpleNamespace(transformer=transformer if transformer is not None else tiny_pipe.transformer,
                               vae=tiny_pipe.vae, scheduler=tiny_pipe.scheduler)
        return RolloutWorker(pipe, tiny_embedder, sampling, RESOLUTION, seed)

    return make

"""train.deterministic (gerl/determinism.py): the switches a GPU run needs to repeat bit for bit, set in every process
that trains or generates. Here the process-wide part on CPU; tests/engine/test_algorithms.py checks that Ray hosts
apply it (their placement record)."""

import os
import random

import numpy as np
import pytest
import torch

from gerl import determinism
from tests.train.helpers import small_config


@pytest.fixture
def restored(monkeypatch):
    """Leave this process as it was: the switches are process-wide."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark, torch.random.get_rng_state(), random.getstate(), np.random.get_state())
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]
    torch.random.set_rng_state(before[3])
    random.setstate(before[4])
    np.random.set_state(before[5])


def _draws():
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_apply_sets_every_switch_and_seeds_each_process_apart(restored, monkeypatch):
    assert not torch.are_deterministic_algorithms_enabled()
    st = determinism.apply(7, "actor0")
    assert st == {"deterministic": True, "cublas_workspace_config": ":4096:8", "cudnn_deterministic": True,
                  "cudnn_benchmark": False}
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and torch.are_deterministic_algorithms_enabled()
    first = _draws()
    determinism.apply(7, "actor0")
    assert _draws() == first  # the same process of the same run draws the same
    determinism.apply(7, "rollout0")
    other = _draws()
    assert all(a != b for a, b in zip(other, first))  # another process (or seed) draws its own
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the other deterministic setting, chosen by the user: kept
    assert determinism.apply(7, "actor0")["cublas_workspace_config"] == ":16:8"


def test_a_process_whose_cuda_has_started_is_refused(restored, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUBLAS_WORKSPACE_CONFIG"):
        determinism.apply(0, "driver")


@pytest.mark.parametrize("on", [True, False])
def test_the_local_engine_process_is_deterministic_before_its_model_loads(on, tmp_path, restored, monkeypatch):
    """The local engine trains and generates in the `gerl train` process: prepare() applies train.deterministic
    before it builds the pipeline (and leaves the process alone when it is off)."""
    import gerl.engine.roles as roles
    from gerl.trainer import prepare

    seen = {}
    monkeypatch.setattr(roles, "build_pipeline", lambda cfg, *a, **k: seen.update(determinism.state()))
    prepare(small_config(tmp_path, f"train.deterministic={str(on).lower()}"))
    assert seen == {"deterministic": on, "cublas_workspace_config": ":4096:8" if on else None,
                    "cudnn_deterministic": on, "cudnn_benchmark": False}

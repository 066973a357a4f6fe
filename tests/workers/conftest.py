"""Fixtures shared by the matching-family update tests (nft/awm in test_matching_update.py, dgpo in
test_dgpo_update.py)."""

import pytest
import torch

from gerl.config import SamplingConfig

# Two groups of four: what group-wise advantages (and DGPO's whole-group mini-batches) need.
PROMPTS = ["a red cat"] * 4 + ["hello 42"] * 4
SAMPLING = SamplingConfig(sampler="cps", num_steps=10, micro_batch_size=8)


@pytest.fixture
def clean_batch(make_rollout, lora_transformer):
    """(transformer with a live adapter, batch): 8 clean samples of a plain ODE, two groups of 4 — what an
    nft/awm/dgpo rollout records (no SDE steps)."""
    base = lora_transformer(randomize=True)
    worker = make_rollout(SAMPLING, base)
    worker.record_sde = False
    return base, worker.generate(PROMPTS, [{}] * 8, torch.tensor([0] * 4 + [1] * 4), step=3)

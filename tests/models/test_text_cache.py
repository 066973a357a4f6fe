"""The prompt-embedding cache on disk (gerl prepare, model.text_cache; gerl/models/text_cache.py): its rows are the
ones a rollout encodes on the fly, bit for bit, for each family (the tiny SD3's and Qwen-Image's encoders round
differently with the batch's shape, so both sides encode a prompt alone); a rollout host that reads it loads no text
encoder, generates the same micro-batch from the same embeddings and logs the encoders' size; a cache whose prompt
file or model changed is refused in one line."""

import pytest
import torch

from gerl.config import load_config
from gerl.engine.roles import RolloutRole
from gerl.errors import UserError
from gerl.models import text_cache
from gerl.models.loader import TextEmbedder, load_pipeline
from tests.train.helpers import REPO

PROMPTS = ['a sign that says "open"', 'a mug with "tea" on it', 'a poster reading "sale 50%" in red letters',
           'the word "library" carved in stone']


def _config(tmp_path, model: str, *extra: str):
    (tmp_path / "train.txt").write_text("\n".join(PROMPTS[:3]) + "\n")
    (tmp_path / "test.txt").write_text(PROMPTS[3] + "\n")
    return load_config(str(REPO / "recipes" / "tiny_cpu.yaml"), [
        f"model.path={model}", f"data.train_prompts={tmp_path / 'train.txt'}", f"data.test_prompts={tmp_path / 'test.txt'}",
        f"model.text_cache={tmp_path / 'cache'}", "model.device=cpu", "data.prompts_per_step=1", "data.group_size=4",
        "sampling.micro_batch_size=4", "train.mini_batch_size=4", "train.micro_batch_size=4", *extra])


@pytest.mark.parametrize("model", ["tiny", "tiny-flux", "tiny-qwenimage"])
def test_cached_rows_equal_the_rows_encoded_on_the_fly(tmp_path, model):
    cfg = _config(tmp_path, model)
    d, n, gib = text_cache.prepare(cfg)
    assert n == len(PROMPTS) + 1 and gib > 0  # every prompt once, and the negative prompt
    pipe = load_pipeline(model, "fp32", "cpu", 0)
    batch = [PROMPTS[2], PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[1]]  # a micro-batch: repeats, mixed lengths
    live = TextEmbedder(pipe, cfg.model.max_sequence_length)(batch, with_negative=True)
    cached = TextEmbedder(pipe, cfg.model.max_sequence_length, disk=text_cache.DiskTextCache(cfg))
    read = cached(batch, with_negative=True)
    assert cached.misses == 0, "every row came from the disk"
    for field in read.FIELDS:
        a, b = getattr(live, field), getattr(read, field)
        assert (a is None) == (b is None) and (a is None or (a.dtype == b.dtype and torch.equal(a, b))), field


def test_a_rollout_host_reading_the_cache_loads_no_text_encoder_and_generates_the_same(tmp_path):
    cfg = _config(tmp_path, "tiny", "sampling.num_steps=3", "sampling.sde_window_size=1",
                  "sampling.sde_window_range=[0, 2]")
    text_cache.prepare(cfg)
    reading = RolloutRole(cfg, reward_fns=[lambda images, prompts, metadata: [0.0] * len(images)], device="cpu")
    assert all(getattr(reading.pipe, c, None) is None for c in ("text_encoder", "text_encoder_2", "text_encoder_3"))
    encoding = RolloutRole(_config(tmp_path, "tiny", "sampling.num_steps=3", "sampling.sde_window_size=1",
                                   "sampling.sde_window_range=[0, 2]", "model.text_cache="),
                           reward_fns=[lambda images, prompts, metadata: [0.0] * len(images)], device="cpu")
    args = ([PROMPTS[0]] * 4, [{}] * 4, torch.zeros(4, dtype=torch.long), 1)
    (b1, _), (b2, _) = reading.generate(*args), encoding.generate(*args)
    assert torch.equal(b1.embeds.prompt, b2.embeds.prompt) and torch.equal(b1.traj.log_probs, b2.traj.log_probs)
    encoders = sum(p.numel() * 4 for c in ("text_encoder", "text_encoder_2", "text_encoder_3")
                   for p in getattr(encoding.pipe, c).parameters())
    assert b1.timings["text_encoders_freed_gib"] == pytest.approx(encoders / 2**30, rel=0.01)
    assert "text_encoders_freed_gib" not in b2.timings


def test_a_stale_cache_is_refused_in_one_line(tmp_path):
    cfg = _config(tmp_path, "tiny")
    with pytest.raises(UserError, match="holds no prompt embeddings"):
        text_cache.check(cfg)
    text_cache.prepare(cfg)
    text_cache.check(cfg)  # as written
    with pytest.raises(UserError, match="is stale: model.path changed") as e:
        text_cache.check(_config(tmp_path, "tiny", "model.tiny_seed=1"))
    assert "\n" not in str(e.value)
    (tmp_path / "train.txt").write_text(PROMPTS[0] + "\n")
    with pytest.raises(UserError, match=r"is stale: data.train_prompts \(.*train.txt\): its prompts changed; rerun "
                                        "`gerl prepare`") as e:
        text_cache.check(cfg)
    assert "\n" not in str(e.value)


def test_gerl_plan_leaves_the_text_encoders_out_when_the_cache_serves_the_prompts(tmp_path):
    from gerl.plan.family import family_for
    from gerl.plan.planner import _loaded

    cfg = _config(tmp_path, "tiny")
    fam = family_for(cfg.model)
    assert _loaded(cfg, fam, "hybrid") == ("transformer", "vae")
    assert set(_loaded(_config(tmp_path, "tiny", "model.text_cache="), fam, "rollout")) >= {"text_encoder_3", "vae"}

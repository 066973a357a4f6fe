"""PickScore, CLIPScore and the LAION aesthetic reward on tiny random CLIPs saved to disk (same architectures as the
real checkpoints): scores equal transformers' own CLIP forward, are deterministic and batch-independent, pickle
without their model, and run in thread, process and Ray pools and through `gerl score`. HPS v2 and ImageReward
are checked only for their missing-package error (their packages need torchvision, which CI cannot install)."""

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gerl.cli import main
from gerl.config import RewardComponent, load_config, reward_components
from gerl.errors import UserError
from gerl.workers.reward import RewardExecutor, RewardSet
from rewards import build_reward, call_reward, validate_reward_inputs
from rewards.clip_models import AestheticHead, clip_similarity
from rewards.preference import AestheticReward
from tests.rewards.tiny_clip import build_tiny_clip, save_aesthetic_head, save_tiny_clip

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["a red cat", "a dog on a sofa", "a red cat", 'a sign that says "OPEN"', "x"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("tiny_clip") / "clip", seed=0)


@pytest.fixture(scope="module")
def head_path(tmp_path_factory):
    return save_aesthetic_head(tmp_path_factory.mktemp("aesthetic") / "aesthetic-model.pth", seed=0)


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(0)
    # mixed sizes and modes: the processor resizes and center-crops, and images are converted to RGB
    sizes = [(64, 48), (40, 40), (64, 64), (80, 32), (33, 57)]
    ims = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    ims[4] = ims[4].convert("L")
    return ims


def kwargs_for(name, clip_dir, head_path) -> dict:
    kw = {"model": str(clip_dir), "processor": "", "batch_size": 2}
    return {**kw, "head": str(head_path)} if name == "aesthetic" else kw


NAMES = ["pickscore", "clipscore", "aesthetic"]


# ---- the math ----------------------------------------------------------------------------------------------------

def test_clip_similarity_is_scaled_cosine_in_fp32():
    a = torch.tensor([[1.0, 0.0], [3.0, 4.0], [1.0, 1.0]], dtype=torch.float16)
    b = torch.tensor([[2.0, 0.0], [-3.0, -4.0], [1.0, -1.0]], dtype=torch.float16)
    logits, cosine = clip_similarity(a, b, torch.tensor(np.log(100.0)))
    assert logits.dtype == cosine.dtype == torch.float32
    assert cosine.tolist() == pytest.approx([1.0, -1.0, 0.0], abs=1e-6)
    assert logits.tolist() == pytest.approx([100.0, -100.0, 0.0], abs=1e-4)


def test_aesthetic_head_is_the_laion_mlp_on_the_unit_embedding():
    head = AestheticHead(768)
    assert [k for k in head.state_dict()] == [f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias")]
    linears = [m for m in head.layers if isinstance(m, torch.nn.Linear)]
    shapes = [(m.in_features, m.out_features) for m in linears]
    assert shapes == [(768, 1024), (1024, 128), (128, 64), (64, 16), (16, 1)]
    assert not any(isinstance(m, (torch.nn.ReLU, torch.nn.GELU)) for m in head.layers)
    head.eval()
    x = torch.randn(4, 768)
    assert head(x).shape == (4,)
    torch.testing.assert_close(head(7.0 * x), head(x))  # only the direction of the embedding matters


# ---- the rewards on tiny CLIPs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_deterministic_batch_independent_and_shaped(name, clip_dir, head_path, images):
    reward = build_reward(name, kwargs_for(name, clip_dir, head_path))
    meta = [{}] * len(images)
    scores, extras = call_reward(reward, images, PROMPTS, meta)
    assert len(scores) == len(images) and all(isinstance(s, float) and np.isfinite(s) for s in scores)
    assert len(set(np.round(scores, 6))) > 2, "different images must get different scores"
    again, _ = call_reward(build_reward(name, kwargs_for(name, clip_dir, head_path)), images, PROMPTS, meta)
    assert again == scores  # a fresh load scores bit for bit the same
    singles = [call_reward(reward, [im], [p], [{}])[0][0] for im, p in zip(images, PROMPTS)]
    np.testing.assert_allclose(singles, scores, rtol=1e-5, atol=1e-5)  # batch size 2 vs 1: only float order differs
    reversed_scores, _ = call_reward(reward, images[::-1], PROMPTS[::-1], meta)
    np.testing.assert_allclose(reversed_scores[::-1], scores, rtol=1e-5, atol=1e-5)
    if name == "aesthetic":
        assert extras == {}
        assert all(0.0 < s < 10.0 for s in scores)  # the tiny head's last bias is 5 (see tiny_clip)
    else:
        scale = float(reward.model()[0].logit_scale.exp())
        assert set(extras) == {"cosine"} and all(-1.0 <= c <= 1.0 for c in extras["cosine"])
        np.testing.assert_allclose(scores, [scale * c for c in extras["cosine"]], rtol=1e-5)


@pytest.mark.parametrize("name", ["pickscore", "clipscore"])
def test_similarity_equals_transformers_clip_forward(name, clip_dir, images):
    """The reference: CLIPModel's own logits_per_image diagonal (what flow_grpo's clipscore divides by 30)."""
    scores, _ = call_reward(build_reward(name, {"model": str(clip_dir), "processor": ""}), images, PROMPTS,
                            [{}] * len(images))
    model, processor = build_tiny_clip(seed=0)
    inputs = processor(text=PROMPTS, images=[im.convert("RGB") for im in images], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = model(**inputs).logits_per_image.diagonal()
    np.testing.assert_allclose(scores, expected.tolist(), rtol=1e-5, atol=1e-5)


def test_aesthetic_equals_head_on_normalised_image_features(clip_dir, head_path, images):
    scores, _ = call_reward(build_reward("aesthetic", kwargs_for("aesthetic", clip_dir, head_path)), images, PROMPTS,
                            [{}] * len(images))
    model, processor = build_tiny_clip(seed=0)
    head = AestheticHead(model.config.projection_dim)
    head.load_state_dict(torch.load(head_path, weights_only=True))
    head.eval()
    with torch.no_grad():
        pixels = processor(images=[im.convert("RGB") for im in images], return_tensors="pt")["pixel_values"]
        feats = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
        expected = head.layers(feats / feats.norm(dim=-1, keepdim=True)).squeeze(-1)
    np.testing.assert_allclose(scores, expected.tolist(), rtol=1e-5, atol=1e-5)
    # the prompt plays no part
    other, _ = call_reward(build_reward("aesthetic", kwargs_for("aesthetic", clip_dir, head_path)), images,
                           [""] * len(images), [{}] * len(images))
    assert other == scores


def test_safetensors_head_and_head_directory(clip_dir, head_path, tmp_path, images):
    st = save_aesthetic_head(tmp_path / "head.safetensors", seed=0)
    base = {"model": str(clip_dir), "processor": ""}
    a = call_reward(build_reward("aesthetic", {**base, "head": str(head_path)}), images, PROMPTS, [{}] * 5)[0]
    b = call_reward(build_reward("aesthetic", {**base, "head": str(st)}), images, PROMPTS, [{}] * 5)[0]
    c = call_reward(build_reward("aesthetic", {**base, "head": str(head_path.parent)}), images, PROMPTS, [{}] * 5)[0]
    assert a == b == c  # the directory is searched for the default file name, aesthetic-model.pth


def test_a_shared_instance_loads_its_model_once_across_threads(clip_dir, head_path, images):
    builds = []

    class Counting(AestheticReward):
        def _build(self, device, dtype):
            builds.append(threading.get_ident())
            return super()._build(device, dtype)

    reward = Counting(str(clip_dir), "", str(head_path), "aesthetic-model.pth", "auto", "auto", 4)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: reward(images, PROMPTS, [{}] * 5)[0], range(4)))
    assert len(builds) == 1 and all(r == results[0] for r in results)


@pytest.mark.parametrize("name", NAMES)
def test_pickles_without_the_model_and_scores_the_same(name, clip_dir, head_path, images):
    reward = build_reward(name, kwargs_for(name, clip_dir, head_path))
    fresh = pickle.loads(pickle.dumps(reward))  # before loading: what the pools ship
    scores = reward(images, PROMPTS, [{}] * 5)[0]
    clone = pickle.loads(pickle.dumps(reward))  # after loading: the model stays behind
    assert clone._model is None and reward._model is not None
    assert fresh(images, PROMPTS, [{}] * 5)[0] == clone(images, PROMPTS, [{}] * 5)[0] == scores


def test_process_pool_scores_like_in_process(clip_dir, head_path, images):
    """Real forkserver workers: each unpickles the reward and loads its own model."""
    reward = build_reward("pickscore", kwargs_for("pickscore", clip_dir, head_path))
    expected = call_reward(reward, images, PROMPTS, [{}] * 5)
    ex = RewardExecutor(reward, "process", workers=1, timeout_s=120, retries=0)
    try:
        futures = [ex.submit(images[:3], PROMPTS[:3], [{}] * 3), ex.submit(images[3:], PROMPTS[3:], [{}] * 2)]
        results = [ex.result(f) for f in futures]
    finally:
        ex.close()
    assert all(not any(r.failed) for r in results), [r.last_error for r in results]
    # 3 + 2 images in the pool vs 5 here: other batch splits (batch_size 2), so only float order differs
    np.testing.assert_allclose([s for r in results for s in r.scores], expected[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose([c for r in results for c in r.extras["cosine"]], expected[1]["cosine"], atol=1e-6)


def test_ray_replica_scores_like_in_process(clip_dir, head_path, images):
    ray = pytest.importorskip("ray")  # a dev dependency
    from gerl.engine.resources import own_ray_env

    own_ray_env()
    reward = build_reward("aesthetic", kwargs_for("aesthetic", clip_dir, head_path))
    expected = call_reward(reward, images, PROMPTS, [{}] * 5)[0]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ex = RewardExecutor(reward, "ray", workers=1, timeout_s=120, retries=0, num_cpus=1)
        r = ex.result(ex.submit(images, PROMPTS, [{}] * 5))
        ex.close()
    finally:
        ray.shutdown()
    assert not any(r.failed), r.last_error
    np.testing.assert_allclose(r.scores, expected, rtol=1e-6)


def test_components_keep_their_raw_scores_next_to_the_weighted_total(clip_dir, head_path, images):
    """OCR 0.8 + PickScore 0.2 (scaled by 1/26 as flow_grpo does): the total mixes, the components stay raw."""
    pick = build_reward("pickscore", kwargs_for("pickscore", clip_dir, head_path))
    aes = build_reward("aesthetic", kwargs_for("aesthetic", clip_dir, head_path))
    specs = [RewardComponent(name="pickscore", weight=0.2, normalize="scale", scale=1 / 26),
             RewardComponent(name="aesthetic", weight=0.8)]
    rs = RewardSet(specs, [pick, aes], 120.0, 0, 0.0)
    try:
        res = rs.score_now(images, PROMPTS, [{}] * 5, micro_batch_size=2)
    finally:
        rs.close()
    raw_pick = call_reward(pick, images, PROMPTS, [{}] * 5)[0]
    raw_aes = call_reward(aes, images, PROMPTS, [{}] * 5)[0]
    np.testing.assert_allclose(res.components["pickscore"].tolist(), raw_pick, rtol=1e-5)
    np.testing.assert_allclose(res.components["aesthetic"].tolist(), raw_aes, rtol=1e-5)
    np.testing.assert_allclose(res.total.tolist(), [0.2 * p / 26 + 0.8 * a for p, a in zip(raw_pick, raw_aes)],
                               rtol=1e-5)
    assert len(res.extras["pickscore/cosine"]) == 5


# ---- gerl score ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_gerl_score_with_each_reward(name, clip_dir, head_path, images, tmp_path, capsys):
    paths = []
    for i, im in enumerate(images[:3]):
        paths.append(str(tmp_path / f"{i}.png"))
        im.save(paths[-1])
    kw = kwargs_for(name, clip_dir, head_path)
    assert main(["score", name, *paths, "--prompt", "a red cat", "--kwargs", json.dumps(kw)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["image"] for r in rows] == paths and all(r["prompt"] == "a red cat" for r in rows)
    loaded = [Image.open(p).convert("RGB") for p in paths]
    expected = call_reward(build_reward(name, kw), loaded, ["a red cat"] * 3, [{}] * 3)[0]
    assert [r["score"] for r in rows] == pytest.approx(expected, rel=1e-6)
    assert ("cosine" in rows[0]) == (name != "aesthetic")


def test_gerl_score_without_a_prompt_is_one_line(clip_dir, tmp_path, capsys, images):
    images[0].save(tmp_path / "a.png")
    code = main(["score", "clipscore", str(tmp_path / "a.png"), "--kwargs", json.dumps({"model": str(clip_dir)})])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "prompts are empty" in err[0] and "--prompt" in err[0], err


def test_uncached_hub_model_offline_is_one_line_before_loading_as_a_real_process(tmp_path, images):
    images[0].save(tmp_path / "a.png")
    exe = Path(sys.executable).parent / "gerl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([str(exe), "score", "pickscore", str(tmp_path / "a.png"), "--prompt", "x", "--kwargs",
                        json.dumps({"model": "gerl-test/no-such-model", "processor": "gerl-test/no-such-model"})],
                       capture_output=True, text=True, timeout=120, env=env)
    err = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("gerl: error:")]
    assert r.returncode == 2 and len(err) == 1, r.stderr[-2000:]
    assert "pickscore model 'gerl-test/no-such-model' is not in the Hugging Face cache" in err[0], err[0]
    assert "hf download" in err[0] and "Traceback" not in r.stderr


def test_a_model_that_fails_to_load_is_one_line(tmp_path, images):
    """Past the start-up check (a directory with a config.json but no weights): the load error names the model."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    reward = build_reward("clipscore", {"model": str(broken)})
    with pytest.raises(UserError, match=r"cannot load CLIP model '.*broken'.*pass a local directory"):
        reward(images[:1], ["x"], [{}])


def test_start_up_check_names_a_directory_without_the_model(tmp_path, clip_dir):
    with pytest.raises(UserError, match=r"clipscore model directory .* holds no config.json"):
        validate_reward_inputs(build_reward("clipscore", {"model": str(tmp_path)}), ["x"], [{}])
    with pytest.raises(UserError, match=r"aesthetic head directory .* holds no aesthetic-model.pth"):
        validate_reward_inputs(build_reward("aesthetic", {"model": str(clip_dir), "head": str(tmp_path)}), [""], [{}])


# ---- bad settings ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, kwargs, match", [
    ("pickscore", {"model": "/no/such/dir"}, "does not exist"),
    ("clipscore", {"dtype": "fp8"}, "dtype must be"),
    ("clipscore", {"batch_size": 0}, "batch_size"),
    ("aesthetic", {"device": "gpu"}, "device must be"),
    ("aesthetic", {"head": "./missing-head.pth"}, "does not exist"),
    ("pickscore", {"modle": "x/y"}, "unknown kwargs"),
])
def test_bad_settings_are_user_errors_at_build_time(name, kwargs, match):
    with pytest.raises(UserError, match=match):
        build_reward(name, kwargs)


def test_head_that_does_not_fit_the_clip_is_named(clip_dir, tmp_path, images):
    wrong = save_aesthetic_head(tmp_path / "wide.pth", in_dim=768)
    reward = build_reward("aesthetic", {"model": str(clip_dir), "head": str(wrong)})
    with pytest.raises(UserError, match=r"768-wide embeddings but the CLIP model makes 16-wide"):
        reward(images[:1], ["x"], [{}])
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(UserError, match="holds no aesthetic-model.pth"):
        build_reward("aesthetic", {"model": str(clip_dir), "head": str(empty_dir)})(images[:1], ["x"], [{}])


def test_validate_accepts_prompts_and_rejects_blank_ones(clip_dir):
    reward = build_reward("pickscore", {"model": str(clip_dir), "processor": ""})
    validate_reward_inputs(reward, ["a", "b"], [{}, {}])
    with pytest.raises(UserError, match=r"1 of 2 prompts are empty \(first is #2\)"):
        validate_reward_inputs(reward, ["a", "  "], [{}, {}])


@pytest.mark.parametrize("name, module, extra", [("hpsv2", "hpsv2", "hpsv2"),
                                                 ("imagereward", "ImageReward", "imagereward")])
def test_packaged_rewards_say_what_to_install(name, module, extra):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    with pytest.raises(UserError, match=rf"needs the '{module}' package: pip install 'gerl\[{extra}\]'"):
        build_reward(name, {})


def test_shipped_multi_reward_recipe_builds_its_rewards():
    """Building is lazy (no model loads), so this checks names and kwargs of every component offline."""
    cfg = load_config(str(REPO / "recipes" / "sd3_fast_ocr_pickscore_1gpu.yaml"))
    comps = reward_components(cfg.reward)
    assert [c.name for c in comps] == ["ocr", "pickscore"]
    assert [c.weight for c in comps] == [0.8, 0.2]
    for c in comps:
        build_reward(c.name, c.kwargs)


@pytest.mark.parametrize("name", ["pickscore", "clipscore", "aesthetic"])
def test_clip_rewards_default_to_fp32_even_on_cuda(name):
    """The references (flow_grpo's scorers) run these models in fp32; fp16 is opt-in. Nothing loads here: the
    factory only records its settings, and a CUDA device is resolved without one."""
    import torch

    from rewards.clip_models import resolve_dtype
    from rewards.registry import build_reward

    reward = build_reward(name, {})
    assert reward.dtype == "fp32" and resolve_dtype(reward.dtype, torch.device("cuda")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.float16  # "auto" still means fp16 on a GPU


def test_imagereward_on_transformers_5_stops_in_one_line(monkeypatch):
    """gerl's venv has transformers 5, on which image-reward 1.5 cannot run; image-reward itself lives in the venv of
    scripts/packaged_rewards_env.sh (test_packaged_run.py), so here its presence is stubbed, the version is real."""
    import rewards.packaged as packaged

    if packaged.transformers_major() < 5:
        pytest.skip("transformers < 5 here")
    monkeypatch.setattr(packaged, "require_package", lambda *a: None)
    with pytest.raises(UserError) as err:
        build_reward("imagereward", {})
    assert "transformers<5" in str(err.value) and "\n" not in str(err.value)


def test_imagereward_start_up_check_offline(tmp_path, monkeypatch):
    """image-reward is not installed in gerl's venv (it runs in scripts/packaged_rewards_env.sh's, with
    transformers<5), so the package and version checks are stubbed — the mocks in this file, at that edge; the
    start-up check itself is gerl's code."""
    import rewards.packaged as packaged
    from gerl.errors import UserError
    from huggingface_hub import constants

    monkeypatch.setattr(packaged, "require_package", lambda *a: None)
    monkeypatch.setattr(packaged, "transformers_major", lambda: 4)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    reward = packaged.imagereward(download_root=str(tmp_path))
    with pytest.raises(UserError, match=r"ImageReward.pt, med_config.json not in .* HF_HUB_OFFLINE is set"):
        reward.validate(["a cat"], [{}])
    (tmp_path / "ImageReward.pt").write_bytes(b"x")
    (tmp_path / "med_config.json").write_text("{}")
    reward.validate(["a cat"], [{}])  # both files cached: nothing to say
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    (tmp_path / "ImageReward.pt").unlink()
    packaged.imagereward(download_root=str(tmp_path)).validate(["a cat"], [{}])  # online: the package fetches it
    with pytest.raises(UserError, match="med_config .* is not a file"):
        packaged.imagereward(med_config=str(tmp_path / "missing.json"))

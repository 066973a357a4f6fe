"""The model-family layer (gerl/models/family.py): a model's family comes from its model_index.json before anything
loads (a directory gerl cannot train is one clear error, on every path that reaches the loader), and for every
family (SD3, FLUX.1-dev, FLUX.1-schnell, Qwen-Image) and every algorithm the first update starts where the rollout
left off: ratio = 1 for Flow-GRPO and Flow-GRPO-Fast, the policy's velocity = the anchor's for NFT (fp32, ≤ 1e-6), for
AWM the same first gradient whether its denominator comes from the training forward or the batched no-grad pass, and
for DGPO whether its group margins come from per-sample forwards or batched ones (ratio 1 to the anchor)."""

import copy
import json
from types import SimpleNamespace

import pytest
import torch

from gerl.config import AlgoConfig, ModelConfig, SamplingConfig, TrainConfig
from gerl.errors import UserError
from gerl.models.family import TINY_MODELS, families, family_for_path, family_of
from gerl.models.loader import TextEmbedder, add_lora, load_pipeline, model_family
from gerl.models.tiny import RESOLUTION, TOKEN_LENGTH
from gerl.sampling.loop import predict_velocity
from gerl.workers.actor import ActorWorker
from gerl.workers.matching import matching_update
from gerl.workers.rollout import RolloutWorker

PROMPTS = ["a red cat", "a red cat", "hello 42", "hello 42"]
GROUPS = torch.tensor([0, 0, 1, 1])


def _index(directory, text: str):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model_index.json").write_text(text)
    return directory


def test_each_tiny_model_and_saved_directory_is_its_familys(tiny_dir, tmp_path):
    from gerl.models.tiny import save_tiny_flux

    assert {name: family_for_path(name).name for name in TINY_MODELS} == {
        "tiny": "sd3", "tiny-flux": "flux", "tiny-flux-schnell": "flux", "tiny-qwenimage": "qwenimage",
        "tiny-flux-kontext": "flux_kontext", "tiny-qwenimage-edit": "qwenimage_edit", "tiny-flux2-klein": "flux2",
        "tiny-zimage": "zimage"}
    assert family_for_path(str(tiny_dir)).name == "sd3"
    save_tiny_flux(tmp_path / "flux", 0)
    assert model_family(str(tmp_path / "flux")).name == "flux"
    assert model_family("ocr-mini").name == "sd3"  # a shipped model by name
    pipe = load_pipeline(str(tmp_path / "flux"), components=("transformer",))
    assert family_of(pipe) is families()["flux"] and pipe.vae is None and pipe.text_encoder_2 is None


@pytest.mark.parametrize("content, expected", [
    (json.dumps({"_class_name": "StableDiffusionXLPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}),
     "holds a StableDiffusionXLPipeline, which gerl cannot train; it trains StableDiffusion3Pipeline (SD3 / SD3.5), "
     "FluxPipeline (FLUX.1-dev / FLUX.1-schnell), QwenImagePipeline (Qwen-Image)"),
    ("{not json", "model_index.json is not readable JSON"),
    ("[1, 2]", "model_index.json is not a JSON object"),
    (json.dumps({"unet": ["diffusers", "UNet2DConditionModel"]}), "holds a pipeline without a _class_name"),
])
def test_a_directory_gerl_cannot_train_is_named_with_the_supported_families(tmp_path, content, expected):
    d = _index(tmp_path / "model", content)
    with pytest.raises(UserError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        model_family(str(d))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no model_index.json"):
        model_family(str(tmp_path / "empty"))
    (tmp_path / "f.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="is a file"):
        model_family(str(tmp_path / "f.bin"))
    with pytest.raises(UserError, match="neither a tiny model"):
        model_family("no-such-model")


@pytest.mark.parametrize("kind", ["local", "ray"])
def test_prepare_refuses_such_a_directory_before_anything_loads(tmp_path, kind, monkeypatch):
    """prepare() is where `gerl train` and the Ray driver check every input: the family check is there, before the
    reward is built or any weights load."""
    from gerl.engine import roles
    from gerl.trainer import prepare
    from tests.train.helpers import small_config

    d = _index(tmp_path / "sdxl", json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    monkeypatch.setattr(roles, "build_pipeline", lambda *a, **k: pytest.fail("the model started loading"))
    cfg = small_config(tmp_path / "run", f"model.path={d}", f"engine.kind={kind}", "engine.device=cpu")
    with pytest.raises(UserError, match="StableDiffusionXLPipeline"):
        prepare(cfg)


# ------------------------------------------------------------------ ratio = 1 before the first update

@pytest.fixture(scope="module", params=list(TINY_MODELS))
def model(request):
    return load_pipeline(request.param)


@pytest.fixture(scope="module")
def edit_images(tmp_path_factory):
    """Conditioning images for the editing families, one per group, of two aspects: at model.condition_resolution=64
    their references have different latent grids, so a rollout micro-batch holds both."""
    from tests.models.test_flux_kontext import picture

    d = tmp_path_factory.mktemp("family_images")
    for i, size in enumerate([(64, 64), (80, 48)]):
        picture(*size, 20 + i).save(d / f"{i}.png")
    return [str(d / f"{i}.png") for i in (0, 0, 1, 1)]


ALGOS = {  # sampling window, algorithm
    "flow_grpo": (0, "flow_grpo"), "fast": (2, "flow_grpo"), "awm": (0, "awm"), "nft": (0, "nft"), "dgpo": (0, "dgpo"),
}


@pytest.mark.parametrize("algo", list(ALGOS))
def test_the_first_update_starts_where_the_rollout_left_off(model, algo, edit_images):
    """Rollout micro-batches of 4, training micro-batches of 1 in a shuffled order: a velocity that depended on
    its batch neighbours (a packing that mixed samples, a text mask not applied while prompts of different lengths
    share a padded batch) or on anything but its inputs would show here. SD3 runs classifier-free guidance (a
    doubled batch), FLUX.1-dev its guidance embedding, schnell none, Qwen-Image true CFG (a second pass on the
    negative prompt " ", norm-rescaled); the editing families (FLUX.1-Kontext, Qwen-Image-Edit-Plus) theirs with a
    conditioning image per group, two reference sizes in one rollout micro-batch (one transformer call per size)."""
    window, name = ALGOS[algo]
    family = family_of(model)
    guidance = 3.0 if family.name == "sd3" else 3.5
    tr = copy.deepcopy(model.transformer)
    add_lora(tr, 4, 8.0, [], seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a live adapter: B = 0 would hide an adapter the replay did not apply
        for n, p in tr.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    sampling = SamplingConfig(sampler="cps", num_steps=4, guidance_scale=guidance, sde_window_size=window,
                              sde_window_range=[0, 3], micro_batch_size=4)
    pipe = SimpleNamespace(transformer=tr, vae=model.vae, scheduler=model.scheduler)
    rollout = RolloutWorker(pipe, TextEmbedder(model, TOKEN_LENGTH, condition_resolution=64), sampling, RESOLUTION,
                            seed=0, record_sde=name == "flow_grpo")
    meta = [{"image": p} for p in edit_images] if family.conditioned else [{}] * 4
    batch = rollout.generate(PROMPTS, meta, GROUPS, step=1)
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    actor = ActorWorker(tr, TrainConfig(micro_batch_size=1, learning_rate=1e-3), ModelConfig(lora=True), sampling,
                        max_steps=1, images_per_step=4, seed=0, algo=AlgoConfig(name=name, train_timesteps=2))
    if name == "nft":  # no ratio: the implicit policy starts at the anchor, v_θ = v_old at the training points
        x0, t = batch.traj.final_latents, batch.schedule.timesteps[[1, 2, 1, 2]]
        sigma = batch.schedule.sigmas[[1, 2, 1, 2]].view(-1, 1, 1, 1)
        x_t = (1 - sigma) * x0 + sigma * torch.randn(x0.shape, generator=g)
        with torch.no_grad(), actor.anchor_swapped():
            tr.eval()
            v_old = predict_velocity(tr, x_t, t, batch.embeds, guidance)
        tr.train()  # as in the update: the same micro-batch through the trained weights, with grad
        v = predict_velocity(tr, x_t, t, batch.embeds, guidance)
        assert (v.detach() - v_old).abs().max() <= 1e-6
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    if name == "awm":
        # AWM's denominator before the first optimizer step is the training forward itself (ratio 1 by
        # construction); the control takes it from the no-grad pass instead, and runs everything in micro-batches of
        # 4 where the update runs 1. Equal gradients (their norm: Adam's first step hides a scale) say the batched
        # velocity equals the per-sample one.
        twin = ActorWorker(copy.deepcopy(tr), TrainConfig(micro_batch_size=4, learning_rate=1e-3),
                           ModelConfig(lora=True), sampling, max_steps=1, images_per_step=4, seed=0,
                           algo=AlgoConfig(name=name, train_timesteps=2))
        control = matching_update(twin, batch, adv, step=1, reuse_training_forward=False)
    if name == "dgpo":
        # micro-batches of 1 split each group: its margins come from the no-grad pass; the control's micro-batch
        # of 4 holds both groups and takes them from its training forwards. The anchor is the starting weights.
        twin = ActorWorker(copy.deepcopy(tr), TrainConfig(micro_batch_size=4, learning_rate=1e-3),
                           ModelConfig(lora=True), sampling, max_steps=1, images_per_step=4, seed=0,
                           algo=AlgoConfig(name=name, train_timesteps=2))
        control = matching_update(twin, batch, adv, step=1)
    metrics = actor.update(batch, adv, step=1)
    assert metrics["grad_norm"] > 0
    if name == "flow_grpo":
        assert metrics["ratio_max_dev_before_update"] <= 1e-6
    if name in ("awm", "dgpo"):
        assert abs(control["grad_norm"] - metrics["grad_norm"]) <= 1e-6 * metrics["grad_norm"]
    if name == "dgpo":  # the live adapter is not the base: margins ≠ 0; the anchor is the weights: ratio 1
        assert metrics["margin_mean"] != 0 and abs(metrics["ratio_mean"] - 1) <= 1e-6 and metrics["clipfrac"] == 0


# ------------------------------------------------------------------ the import-race guard

GUARD_CHECK = r"""
import importlib, json, sys
from gerl.models import arch
from gerl.models.family import by_pipeline_class, families

missing = {}
for folder in arch.shipped():
    d = arch.CONFIGS / folder
    index = json.loads((d / "model_index.json").read_text()) if (d / "model_index.json").is_file() else {}
    want = {("diffusers", index["_class_name"])} if index else set()
    want |= {tuple(v) for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[0] is not None}
    for c in arch.components(folder):
        cfg = arch.load_config(folder, c)
        want.add(("diffusers", cfg["_class_name"]) if "_class_name" in cfg else ("transformers", cfg["architectures"][0]))
    tr = arch.load_config(folder, "transformer")["_class_name"]
    fam = (by_pipeline_class(index["_class_name"], folder) if index else
           next(f for f in families().values() if f.transformer_class == tr))
    fam.resolve_lazy_classes()  # this family's guard, checked before the next family's runs
    gone = [f"{lib}.{n}" for lib, n in sorted(want) if n not in vars(importlib.import_module(lib))]
    if gone:
        missing[folder] = gone
print(json.dumps(missing))
"""


def test_the_import_guard_resolves_every_class_a_shipped_model_names_for_each_family():
    """gerl.trainer.MemoryPlanner plans on a thread while the main thread loads the model; both reach diffusers' and
    transformers' lazy modules, so the main thread resolves the run's family's classes first
    (`Family.resolve_lazy_classes`). In a fresh process, each shipped model's published classes (its component
    configs, its model_index.json where shipped) are plain attributes of their library right after its family's
    guard ran. (Broken on purpose: a guard that resolved SD3's classes alone left FLUX.1's FluxPipeline and
    CLIPTextModel, and Qwen-Image's classes, unresolved.)"""
    import os
    import subprocess
    import sys

    from tests.train.helpers import REPO

    out = subprocess.run([sys.executable, "-c", GUARD_CHECK], capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_every_family_has_a_flops_model_of_its_own():
    """The FLOPs model (gerl/logging/flops.py) counts every family, the editing ones with their reference tokens
    (tests/logging/test_flops.py holds each to torch's FlopCounterMode): FLUX.1-Kontext's and Qwen-Image-Edit-Plus's
    transformers are FLUX.1's and Qwen-Image's classes, but the tracker keeps their own family (Kontext's LoRA targets
    add proj_mlp); a transformer class the FLOPs model does not know is refused by its name, not taken for FLUX.1 by a
    key it shares, and a family's config without its class is told by its own keys."""
    from gerl.logging.flops import family_of_config
    from gerl.logging.throughput import model_configs

    for name, family in (("tiny-flux-kontext", "flux_kontext"), ("tiny-qwenimage-edit", "qwenimage_edit"),
                         ("tiny-flux", "flux"), ("tiny-flux2-klein", "flux2"), ("tiny-zimage", "zimage")):
        assert model_configs(name, load_pipeline(name)).family == family
    with pytest.raises(ValueError, match="no FLOPs model .* Flux2KVTransformer"):
        family_of_config({"_class_name": "Flux2KVTransformer", "num_single_layers": 20})
    assert family_of_config({"num_single_layers": 20, "timestep_guidance_channels": 256}) == "flux2"
    assert family_of_config({"n_layers": 30, "cap_feat_dim": 2560}) == "zimage"


def test_the_editing_models_configs_ship_and_plan_offline():
    """FLUX.1-Kontext-dev and Qwen-Image-Edit-2509 share their transformer's class with FLUX.1 and Qwen-Image: their
    shipped model_index.json (assets/configs) names the family offline, and `gerl plan` takes the editing plan
    (its reference image's tokens counted: gerl/plan/edit.py; checked against the CPU allocator in
    tests/test_plan_families.py)."""
    from gerl.config import ModelConfig
    from gerl.plan.edit import FluxKontextPlan, QwenImageEditPlan
    from gerl.plan.family import family_for

    for hub, name, plan in (("black-forest-labs/FLUX.1-Kontext-dev", "flux_kontext", FluxKontextPlan),
                            ("Qwen/Qwen-Image-Edit-2509", "qwenimage_edit", QwenImageEditPlan)):
        assert family_for_path(hub).name == name
        fam = family_for(ModelConfig(path=hub, condition_resolution=512))
        assert type(fam) is plan and "512² reference image (1024 tokens)" in fam.describe()
    assert family_for_path("black-forest-labs/FLUX.1-dev").name == "flux"  # its model_index.json ships too

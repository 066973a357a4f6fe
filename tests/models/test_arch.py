"""gerl.models.arch: the released architectures from the configs in assets/configs, built on the meta device (sizes
only, nothing allocated) — FLUX.1-dev's and -schnell's exact parameter counts against the published sizes, the
configs against diffusers' constructor defaults and the FLUX family's own conventions — and `random_module`, the
fast random init the GPU benchmark builds the 12 B transformer with, against the classes' own build."""

from __future__ import annotations

import json

import pytest
import torch

from gerl.errors import UserError
from gerl.models import arch

# Exact counts on the meta device, kept as regression values. The public figures they match:
FLUX_DEV = {
    # "a 12 billion parameter rectified flow transformer" (model card); the bf16 checkpoint is 23.8 GB
    "transformer": 11_901_408_320,
    "vae": 83_819_683,  # the 16-channel VAE, ~84 M: the same architecture as SD3's (its count in test_sd35_arch)
    "text_encoder": 123_060_480,  # CLIP ViT-L/14 text tower, 123.06 M (FLUX reads its pooled output: no projection)
    "text_encoder_2": 4_762_310_656,  # T5 v1.1 XXL encoder, 4.76 B (SD3.5's text_encoder_3, the same count)
}
GUIDANCE_EMBEDDER = 256 * 3072 + 3072 + 3072 * 3072 + 3072  # dev's guidance MLP: sinusoid 256 → 3072 → 3072
FILES = ("model_index.json", "scheduler/scheduler_config.json", "text_encoder/config.json",
         "text_encoder_2/config.json", "transformer/config.json", "vae/config.json")


@pytest.fixture(scope="module")
def dev_on_meta():
    with torch.device("meta"):
        return arch.build("black-forest-labs/FLUX.1-dev", dtype=torch.bfloat16)


def test_flux_dev_parameter_counts_match_the_published_sizes(dev_on_meta):
    assert arch.param_counts(dev_on_meta) == FLUX_DEV
    assert FLUX_DEV["transformer"] * 2 == pytest.approx(23.8e9, rel=1e-3)  # bf16 bytes of the 12 B checkpoint
    assert {p.device.type for m in dev_on_meta.values() for p in m.parameters()} == {"meta"}
    assert {p.dtype for m in dev_on_meta.values() for p in m.parameters()} == {torch.bfloat16}


def test_schnell_is_dev_without_the_guidance_embedding():
    with torch.device("meta"):
        schnell = arch.build("flux.1-schnell")
    assert arch.param_counts(schnell) == {**FLUX_DEV, "transformer": FLUX_DEV["transformer"] - GUIDANCE_EMBEDDER}
    differ = {f for f in FILES if (arch.CONFIGS / "flux.1-dev" / f).read_text()
              != (arch.CONFIGS / "flux.1-schnell" / f).read_text()}
    assert differ == {"transformer/config.json", "scheduler/scheduler_config.json"}
    dev_t, schnell_t = arch.load_config("flux.1-dev", "transformer"), arch.load_config("flux.1-schnell", "transformer")
    assert (dev_t.pop("guidance_embeds"), schnell_t.pop("guidance_embeds")) == (True, False) and dev_t == schnell_t


def test_flux_configs_are_diffusers_defaults_and_the_family_s_conventions(dev_on_meta):
    """The published transformer config is FluxTransformer2DModel's constructor defaults but for dev's guidance
    embedding; the VAE factors, the scheduler configs and the pipeline class are what gerl's FLUX family and its
    tiny models were written against (gerl/models/flux.py, gerl.models.tiny)."""
    from diffusers import FluxTransformer2DModel

    from gerl.models.family import by_pipeline_class, families, pipeline_class_in
    from gerl.models.tiny import FLUX_SCHEDULERS, FLUX_VAE_KWARGS

    public = lambda c: {k: v for k, v in json.loads(json.dumps(dict(c))).items() if not k.startswith("_")}  # noqa: E731
    with torch.device("meta"):
        defaults = FluxTransformer2DModel()
    assert public(dev_on_meta["transformer"].config) == {**public(defaults.config), "guidance_embeds": True}
    vae = arch.load_config("flux.1-dev", "vae")
    assert (vae["scaling_factor"], vae["shift_factor"]) == (FLUX_VAE_KWARGS["scaling_factor"],
                                                          FLUX_VAE_KWARGS["shift_factor"]) == (0.3611, 0.1159)
    for variant in ("dev", "schnell"):
        sched = arch.load_config(f"flux.1-{variant}", "scheduler")
        assert {k: v for k, v in sched.items() if k in FLUX_SCHEDULERS[variant]} == FLUX_SCHEDULERS[variant]
        folder = arch.config_dir(f"flux.1-{variant}")
        assert by_pipeline_class(pipeline_class_in(folder, "test"), "test") is families()["flux"]
    index = json.loads((arch.config_dir("flux.1-dev") / "model_index.json").read_text())
    for name, module in dev_on_meta.items():
        assert type(module).__name__ == index[name][1], name


def test_components_hub_ids_and_errors():
    assert arch.components("flux.1-dev") == ("transformer", "vae", "text_encoder", "text_encoder_2")
    assert arch.components("stabilityai/stable-diffusion-3.5-medium") == (
        "transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
    assert {"flux.1-dev", "flux.1-schnell", "sd3.5-medium"} <= set(arch.shipped())
    with pytest.raises(UserError, match="unknown flux.1-dev component 'text_encoder_3'; known: transformer, vae, "
                                        "text_encoder, text_encoder_2, scheduler"):
        arch.load_config("flux.1-dev", "text_encoder_3")
    with pytest.raises(UserError, match="no shipped configs for 'flux.2'; shipped: .*flux.1-dev"):
        arch.config_dir("flux.2")


# ------------------------------------------------------------------ random_module (the GPU benchmark's fast init)

def _tiny_configs():
    from gerl.models.tiny import FLUX_TRANSFORMER_KWARGS, FLUX_VAE_KWARGS

    t5 = dict(arch.load_config("flux.1-dev", "text_encoder_2"), num_layers=1, d_model=32, d_ff=64, num_heads=2, d_kv=16,
              vocab_size=100)
    clip = dict(arch.load_config("flux.1-dev", "text_encoder"), hidden_size=32, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=2)
    transformer = {"_class_name": "FluxTransformer2DModel", **FLUX_TRANSFORMER_KWARGS, "guidance_embeds": True}
    return {"transformer": transformer,
            "vae": {"_class_name": "AutoencoderKL", **FLUX_VAE_KWARGS}, "text_encoder": clip, "text_encoder_2": t5}


@pytest.mark.parametrize("component", ["transformer", "vae", "text_encoder", "text_encoder_2"])
def test_random_module_has_the_class_build_s_structure_buffers_and_ties(component):
    cfg = _tiny_configs()[component]
    ref = arch.module_from_config(cfg)
    got = arch.random_module(cfg, "cpu", torch.bfloat16, seed=0)
    assert type(got) is type(ref) and not got.training
    assert [(n, p.shape) for n, p in got.named_parameters()] == [(n, p.shape) for n, p in ref.named_parameters()]
    assert {(p.device.type, p.dtype) for p in got.parameters()} == {("cpu", torch.bfloat16)}
    for (name, b), (_, want) in zip(got.named_buffers(), ref.named_buffers(), strict=True):  # CLIP's position ids
        assert torch.equal(b, want.to(b.dtype)), name
    if component == "text_encoder_2":  # T5's input embedding is one tensor under two names, as in the class build
        assert ref.shared.weight is ref.encoder.embed_tokens.weight
        assert got.shared.weight is got.encoder.embed_tokens.weight


def test_random_module_fill_is_seeded_and_scaled():
    cfg = _tiny_configs()["transformer"]
    a, b = (arch.random_module(cfg, "cpu", torch.float32, seed=0) for _ in range(2))
    c = arch.random_module(cfg, "cpu", torch.float32, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.proj_out.weight, c.proj_out.weight)
    big = arch.random_module({"_class_name": "FluxTransformer2DModel", "num_layers": 1, "num_single_layers": 0,
                              "attention_head_dim": 64, "num_attention_heads": 4, "joint_attention_dim": 64,
                              "pooled_projection_dim": 32, "axes_dims_rope": (16, 24, 24)}, "cpu", torch.float32)
    w = big.transformer_blocks[0].ff.net[0].proj.weight  # (1024, 256): N(0, 1/256)
    assert float(w.mean()) == pytest.approx(0.0, abs=2e-3) and float(w.std()) == pytest.approx(256**-0.5, rel=0.02)
    assert bool((big.transformer_blocks[0].ff.net[0].proj.bias == 0).all())
    assert bool((big.transformer_blocks[0].attn.norm_q.weight == 1).all())  # an RMSNorm's scale


def test_random_module_of_the_12b_transformer_on_meta_allocates_nothing():
    """The GPU benchmark's path at full size: on meta (here) only the sizes; the count is the class build's."""
    tr = arch.random_module(arch.load_config("flux.1-dev", "transformer"), "meta", torch.bfloat16)
    assert sum(p.numel() for p in tr.parameters()) == FLUX_DEV["transformer"]
    assert {(p.device.type, p.dtype) for p in tr.parameters()} == {("meta", torch.bfloat16)}

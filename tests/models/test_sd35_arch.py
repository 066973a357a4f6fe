"""SD3.5-Medium's real architecture from the configs in assets/configs/sd3.5-medium, built on the meta device
(sizes only, nothing allocated): exact parameter counts against the published sizes, and config round-trips."""

from __future__ import annotations

import json

import pytest
import torch

from gerl.errors import UserError
from gerl.models.sd35_arch import COMPONENTS, build_component, build_sd35_medium, load_config, param_counts

# Exact counts, kept as regression values. The public figures they match:
EXPECTED = {
    # model card: "MMDiT-X, 2.5 B parameters"; that figure includes the 226,492,416-value positional-embedding
    # buffer (384² positions × 1536), which is no parameter: 2,469,663,936 in all = the 4.94 GB bf16 checkpoint.
    "transformer": 2_243_171_520,
    "vae": 83_819_683,  # the SD3 16-channel VAE, ~84 M (168 MB in fp16)
    "text_encoder": 123_650_304,  # CLIP ViT-L/14 text tower 123.06 M + 768×768 projection (247 MB in fp16)
    "text_encoder_2": 694_659_840,  # OpenCLIP ViT-bigG/14 text tower: 694.7 M, projection 1280×1280 included
    "text_encoder_3": 4_762_310_656,  # T5 v1.1 XXL encoder, 4.76 B (two shards, 9.52 GB in bf16)
}
POS_EMBED_VALUES = 384 * 384 * 1536


@pytest.fixture(scope="module")
def meta_modules():
    with torch.device("meta"):
        return build_sd35_medium(dtype=torch.bfloat16)


def test_parameter_counts_match_the_published_sizes(meta_modules):
    assert param_counts(meta_modules) == EXPECTED
    pos_embed = meta_modules["transformer"].pos_embed.pos_embed
    assert pos_embed.numel() == POS_EMBED_VALUES
    assert EXPECTED["transformer"] + POS_EMBED_VALUES == pytest.approx(2.47e9, rel=1e-3)


def test_modules_are_on_meta_with_the_requested_dtype(meta_modules):
    for name, module in meta_modules.items():
        params = list(module.parameters())
        assert {p.device.type for p in params} == {"meta"}, name
        assert {p.dtype for p in params} == {torch.bfloat16}, name


def test_transformer_config_round_trips(meta_modules):
    from diffusers import SD3Transformer2DModel

    published = load_config("transformer")
    built = json.loads(json.dumps(dict(meta_modules["transformer"].config)))  # tuples → lists, as in the file
    assert {k: built[k] for k in published if not k.startswith("_")} == {
        k: v for k, v in published.items() if not k.startswith("_")}
    with torch.device("meta"):
        again = SD3Transformer2DModel.from_config(meta_modules["transformer"].config)
    assert dict(again.config) == dict(meta_modules["transformer"].config)


def test_text_encoder_configs_keep_the_published_sizes(meta_modules):
    keys = {"text_encoder": ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                             "projection_dim", "hidden_act"),
            "text_encoder_3": ("d_model", "d_ff", "d_kv", "num_heads", "num_layers", "vocab_size",
                               "feed_forward_proj", "relative_attention_num_buckets")}
    keys["text_encoder_2"] = keys["text_encoder"]
    for name, fields in keys.items():
        published, config = load_config(name), meta_modules[name].config
        assert {f: getattr(config, f) for f in fields} == {f: published[f] for f in fields}, name


def test_scheduler_config_builds_the_sd3_schedule():
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler.from_config(load_config("scheduler"))
    assert sched.config.shift == 3.0 and not sched.config.use_dynamic_shifting
    public = lambda c: {k: v for k, v in c.items() if not k.startswith("_")}  # noqa: E731
    assert public(sched.config) == public(FlowMatchEulerDiscreteScheduler(shift=3.0).config)  # what bench_gpu had


def test_text_encoders_build_without_diffusers(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` now raises ImportError
    with torch.device("meta"):
        clip = build_component("text_encoder")
        with pytest.raises(ImportError):
            build_component("vae")
    assert sum(p.numel() for p in clip.parameters()) == EXPECTED["text_encoder"]


def test_unknown_component_lists_the_known_ones():
    with pytest.raises(UserError, match="known: " + ", ".join(COMPONENTS)):
        load_config("unet")


def test_encoding_token_ids_matches_the_sd3_pipelines_encode_prompt(tiny_pipe):
    from gerl.models.sd35_arch import encode_token_ids

    prompts = ['a sign that says "open"', "x"]

    def ids(tokenizer):
        return tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                         return_tensors="pt").input_ids

    p = tiny_pipe
    prompt, pooled = encode_token_ids((p.text_encoder, p.text_encoder_2, p.text_encoder_3),
                                      (ids(p.tokenizer), ids(p.tokenizer_2), ids(p.tokenizer_3)))
    with torch.no_grad():  # as encode_token_ids runs: T5 under autograd rounds differently (~1e-6)
        want, _, want_pooled, _ = p.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device="cpu",
                                                  do_classifier_free_guidance=False,
                                                  max_sequence_length=p.tokenizer_3.model_max_length)
    torch.testing.assert_close(prompt, want, rtol=0, atol=0)
    torch.testing.assert_close(pooled, want_pooled, rtol=0, atol=0)


def test_random_token_embedder_gives_sd35_shapes_on_meta(meta_modules):
    from gerl.models.sd35_arch import RandomTokenEmbedder

    encoders = [meta_modules[n] for n in ("text_encoder", "text_encoder_2", "text_encoder_3")]
    embeds = RandomTokenEmbedder(encoders, (77, 77, 256), torch.device("meta"))(["a", "b", "a"])
    assert embeds.prompt.shape == (3, 77 + 256, 4096) and embeds.pooled.shape == (3, 768 + 1280)
    assert embeds.prompt.dtype == torch.bfloat16
    cpu = RandomTokenEmbedder(encoders, (77, 77, 256), torch.device("cpu"))
    a, b = cpu.token_ids("a"), cpu.token_ids("a")
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # one prompt, one set of ids
    assert [int(t.max()) < v for t, v in zip(a, (49408, 49408, 32128))] == [True] * 3

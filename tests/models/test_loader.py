"""The LoRA files gerl writes load with PEFT too, files that are not a LoRA are refused with one line, and a fresh
adapter is the seed's whatever the global generator holds."""

import copy

import pytest
import torch
from safetensors.torch import save_file

from gerl.errors import UserError
from gerl.models.loader import LORA_WEIGHT_NAME, add_lora, load_pipeline, lora_file, save_lora


def _forward(transformer, seed: int = 0) -> torch.Tensor:
    cfg = transformer.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, cfg.in_channels, 8, 8, generator=g)
    text = torch.randn(2, 5, cfg.joint_attention_dim, generator=g)
    pooled = torch.randn(2, cfg.pooled_projection_dim, generator=g)
    with torch.no_grad():
        return transformer(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled,
                           timestep=torch.tensor([500.0, 100.0]), return_dict=False)[0]


def test_saved_lora_loads_with_peft_from_pretrained(tiny_pipe, lora_transformer, tmp_path):
    from peft import PeftModel

    trained = lora_transformer(rank=4, alpha=16.0, randomize=True)  # alpha ≠ rank: the scaling must come through
    save_lora(trained, tmp_path)
    assert {"adapter_config.json", "adapter_model.safetensors", LORA_WEIGHT_NAME} <= {p.name for p in tmp_path.iterdir()}

    base = copy.deepcopy(tiny_pipe.transformer)
    plain = _forward(base)
    loaded = PeftModel.from_pretrained(base, str(tmp_path))
    out = _forward(loaded)
    assert (plain - _forward(trained)).abs().max() > 1e-3, "the adapter must change the output for this to mean anything"
    torch.testing.assert_close(out, _forward(trained), rtol=0, atol=1e-5)


def test_lora_file_refuses_what_is_not_a_lora(lora_transformer, tmp_path):
    save_lora(lora_transformer(), tmp_path / "ckpt")
    assert lora_file(tmp_path / "ckpt") == tmp_path / "ckpt" / LORA_WEIGHT_NAME
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        lora_file(tmp_path / "notes.txt")
    save_file({"transformer_blocks.0.attn.to_q.weight": torch.zeros(2, 2)}, str(tmp_path / "full.safetensors"))
    with pytest.raises(UserError, match="holds no LoRA weights"):
        lora_file(tmp_path / "full.safetensors")
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes((tmp_path / "ckpt" / LORA_WEIGHT_NAME).read_bytes()[:-100])
    with pytest.raises(UserError, match="not a readable safetensors file"):
        lora_file(truncated)


def test_each_role_loads_only_what_it_uses_and_the_vae_stays_fp32(tiny_dir):
    """The actor trains the transformer and reads nothing else (SD3.5-M's text encoders and VAE are 10.55 GiB in
    fp16); the VAE decodes in fp32 whatever model.dtype says (in fp16 it overflows to NaN: black images)."""
    import torch

    from gerl.config import load_config
    from gerl.engine.roles import build_pipeline

    cfg = load_config(None, [f"model.path={tiny_dir}", "model.dtype=fp16"])
    actor = build_pipeline(cfg, roles=("actor",))
    assert actor.transformer is not None and actor.transformer.dtype == torch.float16
    assert all(getattr(actor, name) is None for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3",
                                                          "tokenizer", "tokenizer_2", "tokenizer_3"))
    assert {p.dtype for n, p in actor.transformer.named_parameters() if "lora_" in n} == {torch.float32}
    rollout = build_pipeline(cfg, roles=("rollout",))
    assert rollout.vae.dtype == torch.float32 and rollout.text_encoder_3.dtype == torch.float16
    tiny = build_pipeline(load_config(None, ["model.dtype=bf16"]), roles=("actor",))  # the in-code tiny model
    assert tiny.vae is None and tiny.text_encoder is None and tiny.transformer.dtype == torch.bfloat16


@pytest.mark.parametrize("init", ["default", "gaussian"])
def test_a_fresh_adapter_is_the_seeds_for_a_model_loaded_from_disk(tiny_dir, init):
    """A model loaded from a directory (as SD3.5-M is) seeds nothing: peft draws A from the global generator, so
    before the fix every run, and every data-parallel rank, began from another A (the tiny builder seeds the global
    generator, which hid it). A must depend on the seed alone, and add_lora must leave the caller's generator as
    it found it."""
    def adapter_a(seed: int, global_seed: int) -> dict[str, torch.Tensor]:
        tr = load_pipeline(str(tiny_dir), components=("transformer",)).transformer
        torch.manual_seed(global_seed)
        before = torch.get_rng_state()
        add_lora(tr, 4, 8.0, ["to_q", "to_k", "to_v", "to_out.0"], init, seed=seed)
        assert torch.equal(torch.get_rng_state(), before), "add_lora consumed the caller's generator"
        a = {n: p.detach().clone() for n, p in tr.named_parameters() if "lora_A" in n}
        assert a and all(p.dtype == torch.float32 and p.abs().sum() > 0 for p in a.values())
        return a

    with torch.random.fork_rng():
        first, other_global, other_seed = adapter_a(0, 1), adapter_a(0, 2), adapter_a(1, 1)
    assert all(torch.equal(first[n], other_global[n]) for n in first)
    assert not any(torch.equal(first[n], other_seed[n]) for n in first)


def test_the_tiny_size_limit_is_read_without_building_or_importing_diffusers(tiny_pipe):
    """check_resolution reads tiny's limit from the constructor arguments the builder uses (a `gerl` process that
    stops on a bad resolution no longer pays ~4 s of diffusers/transformers imports); those arguments are the
    built model's, and the limit is the one diffusers itself enforces (pos_embed_max_size × patch × VAE factor)."""
    import subprocess
    import sys
    from pathlib import Path

    from gerl.models.tiny import TRANSFORMER_KWARGS, VAE_KWARGS

    for kwargs, module in ((TRANSFORMER_KWARGS, tiny_pipe.transformer), (VAE_KWARGS, tiny_pipe.vae)):
        for key, value in kwargs.items():
            got = module.config[key]
            assert (list(got) if isinstance(got, (list, tuple)) else got) == \
                (list(value) if isinstance(value, tuple) else value), key
    code = ("import sys\n"
            "from gerl.errors import UserError\n"
            "from gerl.plan.arch import check_resolution\n"
            "check_resolution('tiny', 256, 'ok')\n"
            "try:\n"
            "    check_resolution('tiny', 264, 'model.resolution=264')\n"
            "except UserError as e:\n"
            "    print(e)\n"
            "print(sorted(m for m in ('diffusers', 'transformers') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr[-2000:]
    error, imported = r.stdout.strip().splitlines()
    assert "larger than the 256 px that tiny can generate" in error and imported == "[]", r.stdout
    # 256 px is the edge diffusers enforces: 32 × 2 × 4 generates, one latent patch more does not
    with pytest.raises(ValueError, match="pos_embed_max_size"):
        x = torch.zeros(1, 16, (256 + 8) // 4, (256 + 8) // 4)
        tiny_pipe.transformer.pos_embed(x)
    assert tiny_pipe.transformer.pos_embed(torch.zeros(1, 16, 64, 64)).shape[1] == (64 // 2) ** 2

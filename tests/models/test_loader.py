"""The LoRA files gerl writes load with PEFT too, and files that are not a LoRA are refused with one line."""

import copy

import pytest
import torch
from safetensors.torch import save_file

from gerl.errors import UserError
from gerl.models.loader import LORA_WEIGHT_NAME, lora_file, save_lora


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

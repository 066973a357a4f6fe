"""Tiny random-init CLIP models and an aesthetic head, built offline and saved like the real checkpoints (test helper).

    save_tiny_clip(dir)          # a CLIPModel + CLIPProcessor directory, like clip-vit-large-patch14
    save_aesthetic_head(path)    # the LAION MLP's state dict for that CLIP's projection width

Same architectures as the real models at toy sizes: a 2-layer ViT on 32 px images and a 2-layer text transformer.
The tokenizer is gerl's tiny CLIP BPE (one token per character), the image processor CLIP's PIL backend (no
torchvision), so everything runs on CPU with no download.
"""

from __future__ import annotations

from pathlib import Path

IMAGE_SIZE = 32  # pixels: the processor resizes the short side to this and center-crops a square
PROJECTION = 16  # CLIP embedding width (768 for ViT-L/14); the aesthetic head's input width
MAX_TOKENS = 77  # as the real CLIP tokenizers


def build_tiny_clip(seed: int = 0):
    """(CLIPModel, CLIPProcessor), deterministic for a given seed."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    from gerl.models.tiny import build_clip_tokenizer

    tok = build_clip_tokenizer()
    tok.model_max_length = MAX_TOKENS
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=MAX_TOKENS, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=8)
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=PROJECTION)).eval()
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return model, CLIPProcessor(image_processor=image_processor, tokenizer=tok)


def save_tiny_clip(path, seed: int = 0) -> Path:
    """Write the tiny CLIP (safetensors) and its processor to `path`; return the path."""
    model, processor = build_tiny_clip(seed)
    model.save_pretrained(str(path), safe_serialization=True)
    processor.save_pretrained(str(path))
    return Path(path)


def save_aesthetic_head(path, seed: int = 0, in_dim: int = PROJECTION) -> Path:
    """Write a random LAION aesthetic MLP head (.pth or .safetensors by the suffix of `path`); return the path."""
    import torch

    from rewards.clip_models import AestheticHead

    torch.manual_seed(seed)
    head = AestheticHead(in_dim)
    # Random init gives ratings near 0; shift the last bias so the tiny head rates like the real one (~5).
    with torch.no_grad():
        head.layers[-1].bias.fill_(5.0)
    state = {k: v.contiguous() for k, v in head.state_dict().items()}
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path))
    else:
        torch.save(state, str(path))
    return path

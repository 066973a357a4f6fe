"""The torch side of the CLIP preference rewards: score math, the aesthetic head, and model loading.

Imported only when a reward first scores, so `import rewards` stays free of torch and transformers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gerl.errors import UserError


def clip_similarity(image_embeds: torch.Tensor, text_embeds: torch.Tensor, logit_scale: torch.Tensor):
    """CLIP's matched-pair logit and cosine.

    Args:
        image_embeds: (N, D) projected image embeddings (any float dtype).
        text_embeds: (N, D) projected text embeddings, row i is image i's prompt.
        logit_scale: scalar, CLIP's learned log temperature.

    Returns:
        logits: (N,) fp32, exp(logit_scale) · cos(image_i, text_i); cosine: (N,) fp32.
    """
    # fp32: fp16 norms of 1024-wide embeddings lose ~3 significant digits, visible in a reward's group std
    image = torch.nn.functional.normalize(image_embeds.float(), dim=-1)
    text = torch.nn.functional.normalize(text_embeds.float(), dim=-1)
    cosine = (image * text).sum(-1)
    return logit_scale.float().exp() * cosine, cosine


class AestheticHead(torch.nn.Module):
    """The LAION improved-aesthetic-predictor MLP: linear layers only (its training left the ReLUs commented out).

    Args:
        in_dim: CLIP projection width (768 for ViT-L/14). State-dict keys: layers.{0,2,4,6,7}.{weight,bias}.
    """

    def __init__(self, in_dim: int = 768):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(in_dim, 1024),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(1024, 128),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(128, 64),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(64, 16),
            torch.nn.Linear(16, 1),
        )

    def forward(self, image_embeds: torch.Tensor) -> torch.Tensor:
        """(N, D) raw CLIP image embeddings → (N,) ratings; the embedding is L2-normalised first, as in training."""
        return self.layers(torch.nn.functional.normalize(image_embeds, dim=-1)).squeeze(-1)


# ---------------------------------------------------------------------------------------------- loading


def resolve_device(device: str) -> torch.device:
    """"auto" → the process's first visible CUDA device if any, else CPU; anything else is taken as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """"auto" → fp16 on CUDA, fp32 on CPU (CPU fp16 matmuls are slow and inexact)."""
    if dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]


def _load_error(what: str, spec: str, e: Exception) -> UserError:
    reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return UserError(f"cannot load {what} {spec!r} ({reason}); pass a local directory, or download it first where "
                     f"there is network (`hf download {spec}`) so the Hugging Face cache holds it")


def load_clip(model: str, processor: str, device: torch.device, dtype: torch.dtype):
    """(CLIPModel in eval mode on `device`/`dtype`, CLIPProcessor). Only the PIL image processor is needed."""
    from transformers import CLIPModel, CLIPProcessor

    try:
        clip = CLIPModel.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise _load_error("CLIP model", model, e) from None
    try:
        proc = CLIPProcessor.from_pretrained(processor)
    except (OSError, ValueError) as e:
        raise _load_error("CLIP processor", processor, e) from None
    return clip.to(device=device, dtype=dtype).eval().requires_grad_(False), proc


def load_aesthetic_head(spec: str, filename: str, in_dim: int) -> AestheticHead:
    """The LAION MLP from a local file / directory or hub repo; UserError if it does not fit `in_dim` (CLIP's width)."""
    state = load_state_dict(resolve_file(spec, filename, "aesthetic head"))
    weight = state.get("layers.0.weight")
    if weight is None:
        raise UserError(f"aesthetic head {spec} has no layers.0.weight (keys: {sorted(state)[:4]}...); "
                        "give the improved-aesthetic-predictor MLP's state dict")
    if weight.shape[1] != in_dim:
        raise UserError(f"aesthetic head {spec} takes {weight.shape[1]}-wide embeddings but the CLIP model makes "
                        f"{in_dim}-wide ones; pair the head with the CLIP it was trained on (ViT-L/14: 768)")
    head = AestheticHead(in_dim)
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[0]
        raise UserError(f"aesthetic head {spec} does not fit the LAION MLP ({reason})") from None
    return head.eval().requires_grad_(False)


def load_state_dict(path: str) -> dict:
    """A .safetensors or torch (.pth / .pt, loaded with weights_only) state dict from a file."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def resolve_file(spec: str, filename: str, what: str) -> str:
    """A local file, `filename` inside a local directory, or `filename` from the hub repo `spec` (cache first)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return str(path)
    if path.is_dir():
        if not (path / filename).is_file():
            raise UserError(f"{what} directory {spec} holds no {filename}; set the file name or point at the file")
        return str(path / filename)
    try:
        from huggingface_hub import hf_hub_download

        return hf_hub_download(spec, filename)
    except Exception as e:  # noqa: BLE001 — offline, missing repo or file: one line that says what to do
        raise _load_error(what, f"{spec}/{filename}", e) from None


def pixels(processor, images, clip) -> torch.Tensor:
    """(N, 3, H, W) pixels for `clip` (its device and dtype) from PIL images via the CLIP image processor."""
    batch = processor.image_processor(images=[im.convert("RGB") for im in images], return_tensors="pt")
    return batch["pixel_values"].to(device=clip.device, dtype=clip.dtype)


def image_embeds(clip, pixel_values: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) → (N, projection_dim). Spelled out: `get_image_features` returns a tensor in transformers 4
    and an output object in 5."""
    return clip.visual_projection(clip.vision_model(pixel_values=pixel_values).pooler_output)


def text_embeds(clip, tokenizer, prompts: list[str]) -> torch.Tensor:
    """Unique prompts → (U, projection_dim). Padding cannot change a prompt's embedding (causal attention, pooled
    at its end token), so batching prompts of different lengths together is exact."""
    max_len = min(tokenizer.model_max_length, clip.config.text_config.max_position_embeddings)
    tok = tokenizer(prompts, padding=True, truncation=True, max_length=max_len, return_tensors="pt").to(clip.device)
    out = clip.text_model(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])
    return clip.text_projection(out.pooler_output)


def score_similarity(clip, processor, images: list, prompts: list[str]):
    """(N,) logits and (N,) cosines of N images against their N prompts (see `clip_similarity`)."""
    unique = list(dict.fromkeys(prompts))  # a GRPO micro-batch repeats each prompt group_size times: encode it once
    text = text_embeds(clip, processor.tokenizer, unique)
    text = text[torch.tensor([unique.index(p) for p in prompts], device=clip.device)]  # (N, D)
    return clip_similarity(image_embeds(clip, pixels(processor, images, clip)), text, clip.logit_scale)

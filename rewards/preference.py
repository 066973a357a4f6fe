"""Image–text preference rewards built on CLIP (transformers): PickScore, CLIPScore and the LAION aesthetic predictor.

Every score is the model's own raw number, never rescaled behind the user's back (rescale with a component's
`normalize: scale`, see docs/rewards.md, which also maps each reward to its flow_grpo / Flow-Factory form):

- `pickscore`: exp(logit_scale) · cos(image, prompt) of the PickScore CLIP-H model, ~18–24 on real images
  (flow_grpo divides it by 26).
- `clipscore`: the same similarity logit for OpenAI CLIP ViT-L/14, exp(logit_scale) = 100, so 100 · cos, ~15–35
  (flow_grpo divides it by 30; Flow-Factory's `clip` is the cosine itself).
- `aesthetic`: the LAION improved-aesthetic-predictor: an MLP (768 → 1024 → 128 → 64 → 16 → 1, no activations)
  on the L2-normalised CLIP ViT-L/14 image embedding, a 1–10 rating, ~4–7 on generated images. Ignores the prompt.

Models load lazily, once per process, on the first call (the reward objects pickle without them, so every pool
works: thread, process, or a Ray replica on its own GPU), on CUDA when there is a GPU, else on CPU, in fp32 by
default as flow_grpo's scorers (`dtype: fp16` halves the model's memory on CUDA; how far its scores move from fp32's
has not been measured here, so it is opt-in; `auto` = fp16 on CUDA, fp32 on CPU).

Resizing: each reward feeds its CLIP processor from transformers (PIL images, bicubic resize of the short side to
224, centre crop). flow_grpo's CLIPScore scorer resizes torch tensors with torchvision's bilinear interpolation
instead, so gerl's `clipscore` of the same image differs slightly from flow_grpo's (compare gains, not raw numbers,
across the two codebases).
A model is a hub id (from the local Hugging Face cache, downloaded if online) or a local directory. The torch side
(score math, the aesthetic head, loading) is rewards/clip_models.py, imported on the first call.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

from gerl.errors import UserError
from rewards.registry import register

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"  # PickScore_v1 ships no processor files
CLIP_MODEL = "openai/clip-vit-large-patch14"
AESTHETIC_HEAD = "trl-lib/ddpo-aesthetic-predictor"  # the sac+logos+ava1-l14-linearMSE weights, as TRL's DDPO uses
AESTHETIC_HEAD_FILE = "aesthetic-model.pth"


def model_source(spec: str, what: str) -> str:
    """`spec` as given when it is an existing path or looks like a hub id; UserError for a missing local path."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"{what} must be a hub id (org/name) or a local directory, got {spec!r}")
    path = Path(spec).expanduser()
    if path.exists():
        return str(path)
    if spec.startswith(("/", ".", "~")) or spec.count("/") > 1:
        raise UserError(f"{what} {spec!r} does not exist; pass an existing local directory or a hub id (org/name)")
    return spec


def check_available(spec: str, filename: str, what: str) -> None:
    """Start-up check, without loading: a local directory must hold `filename`; with HF_HUB_OFFLINE set, a hub id
    must be in the Hugging Face cache (offline, a missing model would otherwise only fail at the first reward call)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return
    if path.is_dir():
        if not (path / filename).is_file():
            raise UserError(f"{what} directory {spec} holds no {filename}; point it at a saved model directory")
        return
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(spec, filename), str):
        raise UserError(f"{what} {spec!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; download it "
                        f"first where there is network (`hf download {spec}`) or pass a local directory")


class LazyModelReward:
    """Base of the model rewards: holds settings; the first call in each process loads the model (under a lock).

    Subclasses implement `_build(device, dtype) -> object` and `_score(images, prompts) -> (scores, extras)`.
    """

    name = "model_reward"

    def __init__(self, device: str, dtype: str, batch_size: int):
        if dtype not in ("auto", "fp32", "fp16", "bf16"):
            raise UserError(f"{self.name}: dtype must be auto, fp32, fp16 or bf16, got {dtype!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise UserError(f"{self.name}: batch_size must be an int ≥ 1 (images per forward pass), "
                            f"got {batch_size!r}")
        if not isinstance(device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
            raise UserError(f"{self.name}: device must be auto, cpu, cuda or cuda:N, got {device!r}")
        self.device, self.dtype, self.batch_size = device, dtype, batch_size
        self._model = None
        self._lock = threading.Lock()  # reward threads may share one instance; load the model once

    # Models and locks do not pickle; a copy shipped to a worker process or Ray replica reloads lazily there.
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_model", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _model=None, _lock=threading.Lock())

    def model(self):
        if self._model is None:
            with self._lock:
                if self._model is None:
                    from rewards.clip_models import resolve_device, resolve_dtype

                    device = resolve_device(self.device)
                    self._model = self._build(device, resolve_dtype(self.dtype, device))
        return self._model

    def __call__(self, images, prompts, metadata):
        """Score in chunks of `batch_size` images; returns (scores, extras) with one entry per image."""
        import torch

        scores: list[float] = []
        extras: dict[str, list] = {}
        with torch.inference_mode():
            for s in range(0, len(images), self.batch_size):
                chunk, chunk_extras = self._score(images[s:s + self.batch_size], prompts[s:s + self.batch_size])
                scores += chunk
                for k, v in chunk_extras.items():
                    extras.setdefault(k, []).extend(v)
        return scores, extras

    def _build(self, device, dtype):
        raise NotImplementedError

    def _score(self, images, prompts) -> tuple[list[float], dict[str, list]]:
        raise NotImplementedError


class ClipSimilarityReward(LazyModelReward):
    """exp(logit_scale) · cos(image, prompt) of a CLIP model: PickScore and CLIPScore (see the module docstring).

    Args:
        model: hub id or local directory of a transformers CLIPModel.
        processor: hub id or local directory of its CLIPProcessor (tokenizer + image processor); "" = `model`.
        device: "auto" (CUDA if visible, else CPU), "cpu", "cuda", "cuda:N".
        dtype: "fp32" (the factories' default, as the references), "fp16", "bf16", or "auto" (fp16 on CUDA, fp32
            on CPU). Scores are computed in fp32.
        batch_size: images per forward pass.
    """

    def __init__(self, name: str, model: str, processor: str, device: str, dtype: str, batch_size: int):
        self.name = name
        super().__init__(device, dtype, batch_size)
        self.model_id = model_source(model, f"{name} model")
        self.processor_id = model_source(processor or model, f"{name} processor")

    def __repr__(self) -> str:
        return f"ClipSimilarityReward({self.name!r}, model={self.model_id!r}, processor={self.processor_id!r})"

    def _build(self, device, dtype):
        from rewards.clip_models import load_clip

        return load_clip(self.model_id, self.processor_id, device, dtype)

    def _score(self, images, prompts):
        """Returns (logits, {"cosine": cos}), one per image."""
        from rewards.clip_models import score_similarity

        logits, cosine = score_similarity(*self.model(), images, prompts)
        return logits.tolist(), {"cosine": cosine.tolist()}

    def validate(self, prompts: list[str], metadata: list[dict]) -> None:
        """Every image needs a prompt to be compared with; the model must be findable (see `check_available`)."""
        empty = [i for i, p in enumerate(prompts) if not str(p).strip()]
        if empty:
            raise UserError(f"{self.name}: {len(empty)} of {len(prompts)} prompts are empty (first is "
                            f"#{empty[0] + 1}); it scores image–prompt agreement, so give every image its prompt "
                            f"(gerl score: --prompt)")
        check_available(self.model_id, "config.json", f"{self.name} model")
        check_available(self.processor_id, "tokenizer_config.json", f"{self.name} processor")


class AestheticReward(LazyModelReward):
    """LAION aesthetic rating (≈1–10) of each image from CLIP image embeddings; the prompt is not used.

    Args:
        model: hub id or local directory of the CLIPModel the head was trained on (ViT-L/14).
        processor: its CLIPProcessor; "" = `model`.
        head: the MLP head's weights: a local .pth / .safetensors file, a local directory, or a hub repo id.
        head_file: the file name inside a `head` directory or hub repo.
        device, dtype, batch_size: as for `ClipSimilarityReward`.
    """

    name = "aesthetic"

    def __init__(self, model: str, processor: str, head: str, head_file: str, device: str, dtype: str,
                 batch_size: int):
        super().__init__(device, dtype, batch_size)
        self.model_id = model_source(model, "aesthetic model")
        self.processor_id = model_source(processor or model, "aesthetic processor")
        self.head_id = model_source(head, "aesthetic head")
        self.head_file = head_file

    def __repr__(self) -> str:
        return f"AestheticReward(model={self.model_id!r}, head={self.head_id!r}, head_file={self.head_file!r})"

    def validate(self, prompts: list[str], metadata: list[dict]) -> None:
        """The CLIP model and the head must be findable (see `check_available`); prompts are not used."""
        check_available(self.model_id, "config.json", "aesthetic model")
        check_available(self.processor_id, "tokenizer_config.json", "aesthetic processor")
        check_available(self.head_id, self.head_file, "aesthetic head")

    def _build(self, device, dtype):
        from rewards.clip_models import load_aesthetic_head, load_clip

        clip, proc = load_clip(self.model_id, self.processor_id, device, dtype)
        head = load_aesthetic_head(self.head_id, self.head_file, clip.config.projection_dim)
        return clip, proc, head.to(device)

    def _score(self, images, prompts):
        from rewards.clip_models import image_embeds, pixels

        clip, proc, head = self.model()
        # the head stays fp32: it is 1 M parameters, and fp16 would round the rating to ~0.01
        return head(image_embeds(clip, pixels(proc, images, clip)).float()).tolist(), {}


@register("pickscore")
def pickscore(model: str = PICKSCORE_MODEL, processor: str = PICKSCORE_PROCESSOR, device: str = "auto",
              dtype: str = "fp32", batch_size: int = 32) -> ClipSimilarityReward:
    """PickScore (Kirstain et al. 2023): exp(logit_scale) · cos of the PickScore_v1 CLIP-H, ~18–24 on real images.

    Args: see `ClipSimilarityReward`; defaults are the model and processor flow_grpo and Flow-Factory use.
    """
    return ClipSimilarityReward("pickscore", model, processor, device, dtype, batch_size)


@register("clipscore")
def clipscore(model: str = CLIP_MODEL, processor: str = "", device: str = "auto", dtype: str = "fp32",
              batch_size: int = 32) -> ClipSimilarityReward:
    """CLIPScore: exp(logit_scale) · cos of OpenAI CLIP ViT-L/14, i.e. 100 · cos, ~15–35 on real images.

    Args: see `ClipSimilarityReward`.
    """
    return ClipSimilarityReward("clipscore", model, processor, device, dtype, batch_size)


@register("aesthetic")
def aesthetic(model: str = CLIP_MODEL, processor: str = "", head: str = AESTHETIC_HEAD,
              head_file: str = AESTHETIC_HEAD_FILE, device: str = "auto", dtype: str = "fp32",
              batch_size: int = 32) -> AestheticReward:
    """LAION improved-aesthetic-predictor on CLIP ViT-L/14 (DDPO's aesthetic reward), ≈1–10.

    Args: see `AestheticReward`.
    """
    return AestheticReward(model, processor, head, head_file, device, dtype, batch_size)

"""Preference rewards whose models come with their own PyPI packages: HPS v2 (`hpsv2`) and ImageReward (`image-reward`).

Both are optional extras (`pip install 'gerl[hpsv2]'`, `pip install 'gerl[imagereward]'`) and both need
torchvision (hpsv2 directly, image-reward through timm and its BLIP transforms). Without the package, building the
reward stops with one line saying what to install; nothing is imported until then.

Not exercised by gerl's CI: torchvision has no CPU wheel on the CI machines, so these two wrappers are written
against the packages' published APIs (hpsv2 1.2, image-reward 1.5) and tested only for their missing-package error.

- `hpsv2`: HPS v2 / v2.1 (Wu et al. 2023): a fine-tuned OpenCLIP ViT-H/14; score = cos(image, prompt), ~0.2–0.35.
  flow_grpo and verl-omni use it raw.
- `imagereward`: ImageReward v1.0 (Xu et al. 2023): BLIP + MLP, standardised by the package to mean 0 / std 1 on
  its human-preference data, so ~−2..2.
"""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from pathlib import Path

from gerl.errors import UserError
from rewards.preference import LazyModelReward, check_available, model_source
from rewards.registry import register

HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}


def require_package(module: str, extra: str, who: str) -> None:
    """UserError naming the pip command when `module` is not importable (checked at build time, not import time)."""
    if importlib.util.find_spec(module) is None:
        raise UserError(f"reward {who!r} needs the {module!r} package: pip install 'gerl[{extra}]' "
                        f"(it needs torchvision, which must match your torch)")


class HpsV2Reward(LazyModelReward):
    """HPS v2.x score: cosine of the HPS-tuned OpenCLIP ViT-H/14 image and prompt embeddings.

    Args:
        version: "v2.1" (default, what flow_grpo and verl-omni use) or "v2.0".
        checkpoint: a local HPS checkpoint file (.pt with a "state_dict"), a directory holding it, or a hub repo id
            (default xswu/HPSv2) from which HPS_v2.1_compressed.pt / HPS_v2_compressed.pt is taken.
        device, dtype, batch_size: as for the CLIP rewards; on CUDA the fp32 model runs under fp16 autocast by
            default (what hpsv2 itself does).
    """

    name = "hpsv2"

    def __init__(self, version: str, checkpoint: str, device: str, dtype: str, batch_size: int):
        require_package("hpsv2", "hpsv2", "hpsv2")
        if importlib.util.find_spec("_tkinter") is None:  # hpsv2 1.2's open_clip/factory.py does `from turtle import`
            raise UserError("reward 'hpsv2': the hpsv2 package imports turtle, which needs Tk; install it "
                            "(apt-get install python3-tk) — see github.com/tgxs002/HPSv2/issues/48")
        if version not in HPS_FILES:
            raise UserError(f"hpsv2: version must be one of {sorted(HPS_FILES)}, got {version!r}")
        super().__init__(device, dtype, batch_size)
        self.version = version
        self.checkpoint = model_source(checkpoint, "hpsv2 checkpoint")

    def validate(self, prompts: list[str], metadata: list[dict]) -> None:
        """The HPS checkpoint must be findable (see `rewards.preference.check_available`)."""
        check_available(self.checkpoint, HPS_FILES[self.version], "hpsv2 checkpoint")

    def _build(self, device, dtype):
        import torch
        from hpsv2.src.open_clip import create_model_and_transforms, get_tokenizer

        from rewards.clip_models import resolve_file

        # pretrained=None: the HPS checkpoint holds every weight, so the OpenCLIP base weights are not downloaded
        model, _, preprocess = create_model_and_transforms(
            "ViT-H-14", None, precision="fp32", device="cpu", jit=False, output_dict=True, light_augmentation=True)
        path = resolve_file(self.checkpoint, HPS_FILES[self.version], "hpsv2 checkpoint")
        state = torch.load(path, map_location="cpu", weights_only=True)  # {"state_dict": ...}
        model.load_state_dict(state.get("state_dict", state))
        # fp32 weights under autocast, as hpsv2's own `precision="amp"`: the ViT-H LayerNorms are not cast to fp16
        return model.to(device).eval().requires_grad_(False), preprocess, get_tokenizer("ViT-H-14"), device, dtype

    def _score(self, images, prompts):
        import torch

        model, preprocess, tokenizer, device, dtype = self.model()
        pixels = torch.stack([preprocess(im.convert("RGB")) for im in images]).to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            out = model(pixels, tokenizer(list(prompts)).to(device))
        cosine = (out["image_features"].float() * out["text_features"].float()).sum(-1)  # both unit-norm already
        return cosine.tolist(), {}


class ImageRewardReward(LazyModelReward):
    """ImageReward v1.0 score (the package's standardised output).

    Args:
        model: "ImageReward-v1.0" (downloaded by the package into `download_root`) or a local ImageReward.pt file.
        med_config: a local med_config.json (BLIP's text-encoder config); "" = let the package fetch it.
        download_root: where the package caches its files ("" = ~/.cache/ImageReward).
        device: as for the CLIP rewards. The package runs in fp32 and scores one image at a time.
    """

    name = "imagereward"

    def __init__(self, model: str, med_config: str, download_root: str, device: str):
        require_package("ImageReward", "imagereward", "imagereward")
        super().__init__(device, "fp32", 1)
        self.model_id = model if model == "ImageReward-v1.0" else model_source(model, "imagereward model")
        self.med_config = med_config or None
        self.download_root = download_root or None
        if self.med_config is not None and not Path(self.med_config).expanduser().is_file():
            raise UserError(f"imagereward: med_config {med_config} is not a file; pass BLIP's med_config.json or "
                            "leave it empty to let the package fetch it")

    def validate(self, prompts: list[str], metadata: list[dict]) -> None:
        """Start-up check, without loading: ImageReward-v1.0 is fetched by the package into download_root on the
        first call; offline (HF_HUB_OFFLINE set) it must already be there, or the first reward call would fail."""
        if self.model_id != "ImageReward-v1.0":
            return  # a local file, checked by model_source
        from huggingface_hub import constants

        root = Path(self.download_root or "~/.cache/ImageReward").expanduser()
        missing = [f for f in ("ImageReward.pt", "med_config.json")
                   if not (root / f).is_file() and not (f == "med_config.json" and self.med_config)]
        if constants.HF_HUB_OFFLINE and missing:
            raise UserError(f"imagereward: {', '.join(missing)} not in {root} and HF_HUB_OFFLINE is set; run it once "
                            "where there is network (the package downloads THUDM/ImageReward there), or pass "
                            "model=/path/to/ImageReward.pt and med_config=/path/to/med_config.json")

    def _build(self, device, dtype):
        import ImageReward as RM

        return RM.load(self.model_id, device=str(device), download_root=self.download_root,
                       med_config=self.med_config)

    def __call__(self, images, prompts, metadata):
        """One package call per distinct prompt (a GRPO group shares its prompt); returns one score per image."""
        import torch

        model = self.model()
        by_prompt: dict[str, list[int]] = defaultdict(list)
        for i, p in enumerate(prompts):
            by_prompt[p].append(i)
        scores: list[float] = [0.0] * len(images)
        with torch.inference_mode():
            for prompt, idx in by_prompt.items():
                out = model.score(prompt, [images[i].convert("RGB") for i in idx])
                for i, s in zip(idx, out if isinstance(out, list) else [out]):
                    scores[i] = float(s)
        return scores


@register("hpsv2")
def hpsv2(version: str = "v2.1", checkpoint: str = HPS_REPO, device: str = "auto", dtype: str = "auto",
          batch_size: int = 32) -> HpsV2Reward:
    """HPS v2.x (needs `pip install 'gerl[hpsv2]'`); see `HpsV2Reward`."""
    return HpsV2Reward(version, checkpoint, device, dtype, batch_size)


@register("imagereward")
def imagereward(model: str = "ImageReward-v1.0", med_config: str = "", download_root: str = "",
                device: str = "auto") -> ImageRewardReward:
    """ImageReward v1.0 (needs `pip install 'gerl[imagereward]'`); see `ImageRewardReward`."""
    return ImageRewardReward(model, med_config, download_root, device)

"""Preference rewards whose models come with their own PyPI packages: HPS v2 (`hpsv2`) and ImageReward (`image-reward`).

Both are optional extras (`pip install 'gerl[hpsv2]'`, `pip install 'gerl[imagereward]'`) and both need
torchvision (hpsv2 directly, image-reward through timm and its BLIP transforms). Without the package, building the
reward stops with one line saying what to install; nothing is imported until then.

Both run here on CPU (tests/rewards/test_packaged_run.py, `pytest -m packaged`, in the venv that
scripts/packaged_rewards_env.sh builds) on tiny random weights, through the packages' own model code, after three
fixes gerl applies or names:
- PyPI's only torchvision for torch 2.13 is a CUDA build whose compiled ops cannot load on the CPU torch, which
  stops `import torchvision` outright; both packages use only its pure-Python transforms, so `_build` arms
  gerl/torchvision_ops.py first (it declares the op schemas only when torchvision's own `_C.so` fails to load);
- image-reward 1.5 imports three helpers that transformers moved to `transformers.pytorch_utils`; `_build` puts
  them back where it looks. It also needs transformers < 5 (its BLIP tokenizer reads `additional_special_tokens_ids`,
  gone in 5.0): with transformers 5 the factory stops with one line saying so;
- hpsv2 1.2.0's wheel lacks its tokenizer's `bpe_simple_vocab_16e6.txt.gz`: the factory stops with one line
  saying where to copy it from (open_clip_torch ships the same file).

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


def package_dir(module: str) -> Path:
    return Path(list(importlib.util.find_spec(module).submodule_search_locations)[0])


def transformers_major() -> int:
    from importlib.metadata import version

    return int(version("transformers").split(".")[0])


def restore_moved_transformers_helpers() -> None:
    """image-reward 1.5's BLIP imports apply_chunking_to_forward, prune_linear_layer and
    find_pruneable_heads_and_indices from transformers.modeling_utils; transformers 4.x moved them to
    transformers.pytorch_utils (the last one is gone since). Put them back where it looks, unchanged."""
    import torch
    import transformers.modeling_utils as modeling_utils
    from transformers import pytorch_utils

    def find_pruneable_heads_and_indices(heads, n_heads, head_size, already_pruned_heads):
        # transformers 4.3x's own helper, verbatim in effect: the heads left to prune and the kept channel indices
        mask = torch.ones(n_heads, head_size)
        heads = set(heads) - already_pruned_heads
        for head in heads:
            mask[head - sum(1 if h < head else 0 for h in already_pruned_heads)] = 0
        mask = mask.view(-1).contiguous().eq(1)
        return heads, torch.arange(len(mask))[mask].long()

    for name, fn in (("apply_chunking_to_forward", pytorch_utils.apply_chunking_to_forward),
                     ("prune_linear_layer", pytorch_utils.prune_linear_layer),
                     ("find_pruneable_heads_and_indices", find_pruneable_heads_and_indices)):
        if not hasattr(modeling_utils, name):
            setattr(modeling_utils, name, fn)


class HpsV2Reward(LazyModelReward):
    """HPS v2.x score: cosine of the HPS-tuned OpenCLIP ViT-H/14 image and prompt embeddings.

    Args:
        version: "v2.1" (default, what flow_grpo and verl-omni use) or "v2.0".
        architecture: the OpenCLIP architecture the checkpoint holds: "ViT-H-14" (HPS v2's), another name hpsv2's
            bundled OpenCLIP knows, or the path of an OpenCLIP model-config .json (registered with the package's
            own `add_model_config`; the tests use a tiny one).
        checkpoint: a local HPS checkpoint file (.pt with a "state_dict"), a directory holding it, or a hub repo id
            (default xswu/HPSv2) from which HPS_v2.1_compressed.pt / HPS_v2_compressed.pt is taken.
        device, dtype, batch_size: as for the CLIP rewards; on CUDA the fp32 model runs under fp16 autocast by
            default (what hpsv2 itself does).
    """

    name = "hpsv2"

    def __init__(self, version: str, checkpoint: str, device: str, dtype: str, batch_size: int,
                 architecture: str = "ViT-H-14"):
        require_package("hpsv2", "hpsv2", "hpsv2")
        vocab = package_dir("hpsv2") / "src" / "open_clip" / "bpe_simple_vocab_16e6.txt.gz"
        if not vocab.is_file():  # hpsv2 1.2.0's wheel ships without it; its tokenizer opens it at import
            raise UserError(f"reward 'hpsv2': the hpsv2 package lacks {vocab} (its 1.2.0 wheel ships without it); "
                            "copy open_clip/bpe_simple_vocab_16e6.txt.gz from open_clip_torch there (pip download "
                            "--no-deps open-clip-torch; scripts/packaged_rewards_env.sh does it)")
        if importlib.util.find_spec("_tkinter") is None:  # hpsv2 1.2's open_clip/factory.py does `from turtle import`
            raise UserError("reward 'hpsv2': the hpsv2 package imports turtle, which needs Tk; install it "
                            "(apt-get install python3-tk) — see github.com/tgxs002/HPSv2/issues/48")
        if version not in HPS_FILES:
            raise UserError(f"hpsv2: version must be one of {sorted(HPS_FILES)}, got {version!r}")
        if architecture.endswith(".json") and not Path(architecture).expanduser().is_file():
            raise UserError(f"hpsv2: architecture {architecture} is not a file; give an OpenCLIP model name "
                            "(ViT-H-14) or an OpenCLIP model-config .json")
        super().__init__(device, dtype, batch_size)
        self.version = version
        self.architecture = architecture
        self.checkpoint = model_source(checkpoint, "hpsv2 checkpoint")

    def validate(self, prompts: list[str], metadata: list[dict]) -> None:
        """The HPS checkpoint must be findable (see `rewards.preference.check_available`)."""
        check_available(self.checkpoint, HPS_FILES[self.version], "hpsv2 checkpoint")

    def _build(self, device, dtype):
        import torch

        from gerl import torchvision_ops

        torchvision_ops.install()  # a CUDA torchvision beside a CPU torch: its pure-Python transforms still import
        from hpsv2.src.open_clip import add_model_config, create_model_and_transforms, get_tokenizer

        from rewards.clip_models import resolve_file

        arch = self.architecture
        if arch.endswith(".json"):
            add_model_config(Path(arch).expanduser())
            arch = Path(arch).stem
        # pretrained=None: the HPS checkpoint holds every weight, so the OpenCLIP base weights are not downloaded
        model, _, preprocess = create_model_and_transforms(
            arch, None, precision="fp32", device="cpu", jit=False, output_dict=True, light_augmentation=True)
        path = resolve_file(self.checkpoint, HPS_FILES[self.version], "hpsv2 checkpoint")
        state = torch.load(path, map_location="cpu", weights_only=True)  # {"state_dict": ...}
        model.load_state_dict(state.get("state_dict", state))
        # fp32 weights under autocast, as hpsv2's own `precision="amp"`: the ViT-H LayerNorms are not cast to fp16
        return model.to(device).eval().requires_grad_(False), preprocess, get_tokenizer(arch), device, dtype

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
        if transformers_major() >= 5:
            from importlib.metadata import version

            raise UserError(f"reward 'imagereward': image-reward 1.5 does not run on transformers "
                            f"{version('transformers')} (its BLIP tokenizer reads additional_special_tokens_ids, "
                            "removed in transformers 5); run it where transformers<5 is installed "
                            "(scripts/packaged_rewards_env.sh builds one)")
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
        from gerl import torchvision_ops

        torchvision_ops.install()  # as for hpsv2: only torchvision's pure-Python transforms are used
        restore_moved_transformers_helpers()
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
          batch_size: int = 32, architecture: str = "ViT-H-14") -> HpsV2Reward:
    """HPS v2.x (needs `pip install 'gerl[hpsv2]'`); see `HpsV2Reward`."""
    return HpsV2Reward(version, checkpoint, device, dtype, batch_size, architecture)


@register("imagereward")
def imagereward(model: str = "ImageReward-v1.0", med_config: str = "", download_root: str = "",
                device: str = "auto") -> ImageRewardReward:
    """ImageReward v1.0 (needs `pip install 'gerl[imagereward]'`); see `ImageRewardReward`."""
    return ImageRewardReward(model, med_config, download_root, device)

"""Model families: what differs between SD3/SD3.5, FLUX.1, Qwen-Image, the image-editing FLUX.1-Kontext and
Qwen-Image-Edit-Plus, FLUX.2-klein and Z-Image lives behind one small interface.

Everything above the velocity call is architecture-free (the SDE/CPS step and its log-prob, Flow-GRPO / Fast / NFT /
AWM, the engine and its schedules, rewards, checkpoints). A family answers the few questions that are not: how its
pipeline is loaded, how prompts become embeddings, the latent layout, the velocity call, the σ schedule, decoding,
and the default LoRA targets. One file per family (gerl/models/sd3.py, flux.py, qwenimage.py, flux_kontext.py,
qwenimage_edit.py, flux2.py, zimage.py) subclasses `Family`;
the trainer, the algorithms and the workers never ask which family they hold — a worker looks its family up once
(`family_of(pipe)`) and calls its methods, and `gerl.sampling.loop.predict_velocity` dispatches on the transformer.

Conventions every family keeps, so that the shared code stays shared:
- The canonical latent is *unpacked*, (B, C, h, w) fp32: noise is drawn in it, the SDE steps and their log-probs
  (means over every latent element, which packing would not change) run on it, the trajectory records it. A family
  that packs 2×2 patches into tokens (FLUX, Qwen-Image) packs inside `velocity` and unpacks its output.
- `Schedule.timesteps` are the scheduler's own (σ·1000); `velocity` converts to what its transformer reads.
- `guidance` is the family's one guidance number (sampling.guidance_scale): SD3's classifier-free scale, FLUX.1-dev's
  distilled guidance embedding, Qwen-Image's true_cfg_scale. `uses_negative(guidance)` says whether `velocity` then
  needs the negative embeddings (which the text cache computes from `negative_prompt`).

This module imports nothing heavy: the config layer and the rehearsal read TINY_MODELS without torch or diffusers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from gerl.errors import UserError

if TYPE_CHECKING:  # this module imports nothing heavy at run time
    import torch

# Offline tiny models by name (model.path=NAME): family name and the variant its builder takes.
TINY_MODELS = {
    "tiny": ("sd3", ""),  # gerl.models.tiny.build_tiny_sd3
    "tiny-flux": ("flux", "dev"),  # gerl.models.tiny.build_tiny_flux: guidance embedding, dynamic shift
    "tiny-flux-schnell": ("flux", "schnell"),  # no guidance embedding, no shift (as FLUX.1-schnell's configs)
    "tiny-qwenimage": ("qwenimage", ""),  # gerl.models.tiny_qwenimage.build_tiny_qwenimage: Qwen-Image's scheduler
    "tiny-flux-kontext": ("flux_kontext", ""),  # gerl.models.tiny.build_tiny_flux_kontext: tiny-flux's parts, editing
    "tiny-qwenimage-edit": ("qwenimage_edit", ""),  # gerl.models.tiny_qwenimage.build_tiny_qwenimage_edit_plus
    "tiny-flux2-klein": ("flux2", ""),  # gerl.models.tiny_qwen3.build_tiny_flux2_klein: the base (CFG) model's layout
    "tiny-zimage": ("zimage", ""),  # gerl.models.tiny_qwen3.build_tiny_zimage: Z-Image-Turbo's scheduler
}
# each registers its family on import; a family sharing its transformer class with another comes after it
_MODULES = ("gerl.models.sd3", "gerl.models.flux", "gerl.models.qwenimage", "gerl.models.flux_kontext",
            "gerl.models.qwenimage_edit", "gerl.models.flux2", "gerl.models.zimage")
_REGISTRY: dict[str, "Family"] = {}


class Family:
    """One model family. Subclasses set the class attributes and implement the methods; shapes are per batch.

    Attributes:
        name: short name ("sd3", "flux").
        title: what a user calls it, for messages ("SD3 / SD3.5", "FLUX.1-dev / -schnell").
        pipeline_classes: the diffusers pipeline class names (model_index.json `_class_name`) this family loads.
        transformer_class: the diffusers transformer class name; `family_of` recognises a transformer by it.
        components: the pipeline's weighted parts; text encoders map to their tokenizers in `tokenizers`.
        negative_prompt: the text of the unconditional branch when `uses_negative` (the stock pipelines' default).
        lora_targets: the default LoRA target modules (model.lora_targets = []), as the peers train this family.
        block_lists: the transformer's attributes holding its repeated blocks, in call order: what model.compile
            compiles, one block at a time (gerl/models/compile.py), and the units the data-parallel layer shards or
            replicates one by one (gerl/engine/parallel.py).
        compile_refusal: why model.compile cannot keep this family's shapes fixed ("" = it can).
        attention_mask: whether the transformer passes an attention mask to its attention (a backend must take one).
        conditioned: whether each prompt comes with a conditioning image (image editing: FLUX.1-Kontext,
            Qwen-Image-Edit-Plus). Such a family subclasses the text-to-image family whose transformer it shares, whose
            `velocity` appends the conditioning tokens (`Embeds.cond`) when they are there.
        unloaded: pipeline parts gerl never loads (passed as None to `from_pretrained`): Qwen-Image-Edit-Plus's
            processor, which transformers cannot build without torchvision and the family does not need.
        extra_classes: (library, class) pairs a published model_index.json names that the pipeline's signature does
            not (T5TokenizerFast where the signature says T5Tokenizer): resolved by `resolve_lazy_classes` too.
    """

    name: str = ""
    title: str = ""
    pipeline_classes: tuple[str, ...] = ()
    transformer_class: str = ""
    components: tuple[str, ...] = ()
    tokenizers: dict[str, str] = {}
    negative_prompt: str = ""
    lora_targets: tuple[str, ...] = ()
    block_lists: tuple[str, ...] = ("transformer_blocks",)
    compile_refusal: str = ""
    attention_mask: bool = False
    extra_classes: tuple[tuple[str, str], ...] = ()
    conditioned: bool = False
    unloaded: tuple[str, ...] = ()

    def pipeline_cls(self):
        """The diffusers pipeline class (from_pretrained, save_lora_weights)."""
        import diffusers

        return getattr(diffusers, self.pipeline_classes[0])

    def lazy_classes(self) -> set[tuple[str, str]]:
        """Every (library, class name) that loading this family's pipeline or planning it reaches through diffusers'
        and transformers' lazy top-level modules: the pipeline classes, the classes their constructors name for
        each component (the ones a model_index.json lists), and `extra_classes`."""
        import inspect
        import typing

        def named(annotation) -> list[tuple[str, str]]:
            if typing.get_args(annotation):  # X | None, Union[...]
                return [n for a in typing.get_args(annotation) for n in named(a)]
            lib = str(getattr(annotation, "__module__", "")).split(".")[0]
            return [(lib, annotation.__name__)] if lib in ("diffusers", "transformers") else []

        names = {("diffusers", c) for c in self.pipeline_classes} | {("diffusers", self.transformer_class)}
        names |= set(self.extra_classes) | {("transformers", "AutoConfig")}
        import diffusers

        for c in self.pipeline_classes:
            for p in inspect.signature(getattr(diffusers, c).__init__).parameters.values():
                names.update(named(p.annotation))
        return names

    def resolve_lazy_classes(self) -> None:
        """Resolve `lazy_classes` on the calling thread. diffusers and transformers import their classes lazily, and
        two threads resolving the same lazy name at once can fail (gerl.trainer.MemoryPlanner plans on a thread while
        the main thread loads): resolved once here, each name is a plain module attribute after."""
        import importlib

        for lib, name in sorted(self.lazy_classes()):
            getattr(importlib.import_module(lib), name, None)  # a name the library does not export is never looked up

    def build_tiny(self, seed: int, variant: str):
        """The offline tiny pipeline of this family (fp32, CPU, random weights from `seed`)."""
        raise NotImplementedError

    def encode_prompts(self, pipe, prompts: list[str], max_sequence_length: int, images=None,
                       condition_resolution: int = 0):
        """Prompts → `Embeds` (batch B = len(prompts), no negatives), on the text encoders' device, no grad.
        The text cache (gerl.models.loader.TextEmbedder) stores each prompt's row: a family whose prompts have
        different lengths sets `Embeds.mask` (B, L) and the cache pads rows to the longest.
        An image-conditioned family also takes `images` (B PIL images, RGB) and sets `Embeds.cond` / `cond_hw`: the
        images' VAE latents packed into tokens, each image sized as its stock pipeline sizes it
        (`condition_resolution` = model.condition_resolution; 0 = the stock pipeline's own size)."""
        raise NotImplementedError

    def condition_tokens(self, h: int, w: int) -> int:
        """The tokens of a conditioning latent grid (h, w): (h/2)·(w/2) for the families that pack 2×2 patches."""
        return (h // 2) * (w // 2)

    def uses_negative(self, guidance: float) -> bool:
        """Whether `velocity` at this guidance reads the negative embeddings (a second, unconditional pass)."""
        raise NotImplementedError

    def forward_rows(self, batch: int, guidance: float) -> int:
        """The batch rows of each transformer call `velocity` makes for `batch` samples at `guidance` (SD3 doubles
        the batch for classifier-free guidance): the shapes a compiled block sees (gerl/models/compile.py)."""
        return batch

    def use_attention_dispatch(self, transformer) -> None:
        """Make every attention of `transformer` call diffusers' attention dispatcher (`dispatch_attention_fn`), so
        that `set_attention_backend` reaches it. FLUX's and Qwen-Image's processors already do."""

    def latent_shape(self, pipe, resolution: int) -> tuple[int, int, int]:
        """The canonical (unpacked) latent of one image, (C, h, w), at `resolution` pixels."""
        raise NotImplementedError

    def schedule(self, scheduler_config, num_steps: int, latent_shape: tuple[int, ...]):
        """The `Schedule` (σ from 1 to 0 and the transformer timesteps) that the stock pipeline uses for
        `num_steps` steps of an image whose latent is `latent_shape`."""
        raise NotImplementedError

    def velocity(self, transformer, x, timestep, embeds, guidance: float):
        """The velocity (B, C, h, w) fp32 at canonical latents x (B, C, h, w) and scheduler timesteps (B,), with
        this family's guidance. Rollout and training both call it: it must be a function of its inputs alone."""
        raise NotImplementedError

    def decode(self, vae, latents):
        """Canonical latents (B, C, h, w) → the VAE's images (B, 3, H, W) float in [-1, 1] (before clamping)."""
        raise NotImplementedError


def compute_dtype(transformer):
    """The dtype a transformer computes in, which a family casts its inputs to: its weights' own, or the model dtype
    that the data-parallel layer casts its fp32 master weights to for each forward (gerl/engine/parallel.py)."""
    return getattr(transformer, "gerl_compute_dtype", None) or next(transformer.parameters()).dtype


def register(cls: type[Family]) -> type[Family]:
    _REGISTRY[cls.name] = cls()
    return cls


def families() -> dict[str, Family]:
    """Every registered family by name (importing the family modules on the first call), in `_MODULES` order
    whatever order they were imported in, so that messages listing them read the same in every process."""
    import importlib

    for m in _MODULES:
        importlib.import_module(m)
    rank = {m: i for i, m in enumerate(_MODULES)}
    return dict(sorted(_REGISTRY.items(), key=lambda kv: rank.get(type(kv[1]).__module__, len(rank))))


def supported() -> str:
    """The pipeline classes gerl trains, for messages: "StableDiffusion3Pipeline (SD3 / SD3.5), FluxPipeline (...)"."""
    return ", ".join(f"{'/'.join(f.pipeline_classes)} ({f.title})" for f in families().values())


def family_of(obj) -> Family:
    """The family of a pipeline (or anything with a `.transformer`) or of a transformer itself. A pipeline's own class
    decides first (FluxKontextPipeline and FluxPipeline share FluxTransformer2DModel); otherwise the transformer's
    class, where a LoRA attached through diffusers' peft integration or a deep copy keeps it, gives the first family
    registered for it — the text-to-image one, whose `velocity` serves its image-conditioned subclass too."""
    tr = getattr(obj, "transformer", obj)
    if tr is not obj:
        for f in families().values():
            if type(obj).__name__ in f.pipeline_classes:
                return f
    names = {c.__name__ for c in type(tr).__mro__}
    for f in families().values():
        if f.transformer_class in names:
            return f
    raise ValueError(f"{type(tr).__name__} belongs to no model family gerl knows; supported: {supported()}")


def check_conditioning(family: Family, metadata: list[dict], where: str) -> None:
    """Prompts whose metadata carries an "image" (a conditioning image) against the family: an image-editing family
    needs one for every prompt, a text-to-image family takes none. A UserError names the first prompt that does not
    fit, before anything loads."""
    has = [isinstance(m, dict) and m.get("image") is not None for m in metadata]
    if family.conditioned and not all(has):
        raise UserError(f"{where}: {family.title} edits an image, and prompt {has.index(False) + 1} has none; give "
                        'every prompt one (.jsonl lines {"prompt": ..., "image": PATH}, PATH relative to the file)')
    if not family.conditioned and any(has):
        editing = ", ".join(f.title for f in families().values() if f.conditioned)
        raise UserError(f"{where}: prompt {has.index(True) + 1} has an \"image\", which {family.title} (text to "
                        f"image) does not take; use an image-editing model ({editing}) or drop the images")


def condition_groups(embeds) -> list[tuple[torch.Tensor | None, tuple[int, int] | None]]:
    """The rows of a batch that share one conditioning grid, for a transformer that takes one image layout per call:
    [(row indices (n,) long, (h, w))], or [(None, None)] when the batch has no conditioning image or one grid only
    (the whole batch in one call)."""
    if embeds.cond_hw is None:
        return [(None, None)]
    grids = [tuple(hw) for hw in embeds.cond_hw.tolist()]
    if len(set(grids)) == 1:
        return [(None, grids[0])]
    import torch

    out = []
    for g in dict.fromkeys(grids):
        out.append((torch.tensor([i for i, x in enumerate(grids) if x == g], dtype=torch.long), g))
    return out


def by_pipeline_class(class_name: str, where: str) -> Family:
    """The family that loads pipeline `class_name`, or a UserError naming it and what gerl supports."""
    for f in families().values():
        if class_name in f.pipeline_classes:
            return f
    raise UserError(f"{where} holds a {class_name or 'pipeline without a _class_name'}, which gerl cannot train; "
                    f"it trains {supported()}")


def pipeline_class_in(directory: Path, where: str) -> str:
    """`_class_name` of a diffusers directory's model_index.json; a UserError when it is missing or not JSON."""
    index = directory / "model_index.json"
    if not index.is_file():
        raise UserError(f"{where} is not a diffusers pipeline directory (no model_index.json); pass the folder that "
                        "`save_pretrained` wrote, or a hub id")
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{where}: {index} is not readable JSON ({str(e).splitlines()[0][:120]}); re-save the "
                        "pipeline with `save_pretrained`") from None
    if not isinstance(data, dict):
        raise UserError(f"{where}: {index} is not a JSON object; re-save the pipeline with `save_pretrained`")
    return str(data.get("_class_name") or "")


def calculate_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5,
                    max_shift: float = 1.15) -> float:
    """`mu` of the resolution-dependent (dynamic) shift: the straight line through (base_seq_len, base_shift) and
    (max_seq_len, max_shift) at the image's token count, in the operation order of the stock pipelines'
    `calculate_shift` (FluxPipeline, QwenImagePipeline, StableDiffusion3Pipeline), so that it is bit-equal."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


def resolution_shift(image_seq_len: int, config, default_max_shift: float) -> float:
    """`calculate_shift` with the scheduler config's keys (base_image_seq_len, max_image_seq_len, base_shift,
    max_shift) and the stock pipelines' fallbacks for a missing key: 256 → 0.5, 4096 → `default_max_shift`, which is
    1.15 in FluxPipeline and QwenImagePipeline and 1.16 in StableDiffusion3Pipeline. Shared by every family whose
    stock pipeline shifts σ by the image's size (FLUX.1, Qwen-Image, and SD3 when its scheduler config asks for
    dynamic shifting)."""
    get = config.get
    return calculate_shift(image_seq_len, get("base_image_seq_len", 256), get("max_image_seq_len", 4096),
                           get("base_shift", 0.5), get("max_shift", default_max_shift))


HUB_ID = re.compile(r"[\w.\-]+/[\w.\-]+")


def shipped_family(hub_id: str) -> Family | None:
    """The family of a hub id whose published configs ship under assets/configs with their model_index.json
    (gerl.models.arch.HUB_IDS), read offline; None for any other."""
    folder = Path(__file__).resolve().parents[2] / "assets" / "configs"
    import gerl.models.arch as shipped  # lazily: it imports torch

    index = folder / shipped.HUB_IDS.get(hub_id, "-") / "model_index.json"
    if not index.is_file():
        return None
    return by_pipeline_class(pipeline_class_in(index.parent, f"model.path {hub_id}"), f"model.path {hub_id}")


def family_for_path(path: str, local_files_only: bool = True) -> Family | None:
    """The family of model.path, before anything loads: a tiny model's, a directory's by its model_index.json, a hub
    id's from its model_index.json in the local HF cache (or downloaded when `local_files_only` is False).
    None for a hub id not in the cache (the load then downloads it and checks again). A UserError names a
    directory that gerl cannot train (another pipeline class, no or broken model_index.json) or a bad path.
    `path` is resolved already (a shipped model's name → its directory: gerl.models.loader.resolve_model_path)."""
    if path in TINY_MODELS:
        return families()[TINY_MODELS[path][0]]
    p = Path(path)
    if p.is_dir():
        return by_pipeline_class(pipeline_class_in(p, f"model.path {path}"), f"model.path {path}")
    if p.exists():
        raise UserError(f"model.path {path} is a file; pass a diffusers pipeline directory or a hub id")
    if not HUB_ID.fullmatch(path):
        raise UserError(f"model.path {path!r} is neither a tiny model ({', '.join(TINY_MODELS)}), an existing "
                        "directory, nor a hub id like stabilityai/stable-diffusion-3.5-medium")
    try:
        from huggingface_hub import hf_hub_download

        index = hf_hub_download(path, "model_index.json", local_files_only=local_files_only)
    except Exception as e:  # noqa: BLE001 — not cached, gated, offline: the caller decides what that means
        if local_files_only:
            return shipped_family(path)
        raise UserError(f"cannot load {path} from the hub or the local HF cache ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:160] if str(e) else ''}); run `hf download {path}` where there "
                        "is network, or pass a local directory") from None
    return by_pipeline_class(pipeline_class_in(Path(index).parent, f"model.path {path}"), f"model.path {path}")

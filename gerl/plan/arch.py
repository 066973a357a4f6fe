"""The model's architecture from its configs alone: each weighted component built on the meta device.

model.path → where the configs come from:
    a hub id whose configs ship here          → assets/configs/<folder> (gerl.models.arch.HUB_IDS: SD3.5-Medium and
      (or that folder's name)                   -Large, FLUX.1-dev, -schnell, Qwen-Image, ...), no download
    tiny, tiny-flux, tiny-qwenimage, ...      → the family's offline tiny builder (seeded)
    ocr-mini, a local diffusers directory     → its <component>/config.json (assets/configs/flux.1-dev is one)
    another hub id                            → its configs in the local HF cache (local_files_only), else a UserError
Which components are read is the model family's list (gerl.models.family: SD3's five, FLUX's four, Qwen-Image's
three), found from the transformer's class.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gerl.errors import UserError
from gerl.models.loader import resolve_model_path

SD35_MEDIUM = "stabilityai/stable-diffusion-3.5-medium"
DIFFUSERS_COMPONENTS = ("transformer", "vae")


@dataclass
class Architecture:
    source: str  # where the configs came from, in words
    configs: dict[str, Any]  # component → config dict (diffusers/transformers JSON) or a live config object
    classes: dict[str, type] | None = None  # component → class, when the configs are live objects (tiny)

    def build_meta(self, component: str, dtype: torch.dtype) -> torch.nn.Module:
        """`component` on the meta device in `dtype`: shapes and dtypes, no storage."""
        from diffusers.utils import logging as diffusers_logging

        cfg = self.configs[component]
        with torch.device("meta"):
            if self.classes is not None:
                cls = self.classes[component]
                module = cls.from_config(cfg) if component in DIFFUSERS_COMPONENTS else cls(cfg)
            else:
                module = module_from_config(component, cfg)
        level = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()  # its `.to(dtype)` advice is about loading weights: none here
        try:
            return module.to(dtype).eval().requires_grad_(False)
        finally:
            diffusers_logging.set_verbosity(level)

    def clip_tokens(self) -> int:
        """CLIP's prompt length: its position table (77 for SD3's CLIP-L; the pipeline pads to it)."""
        return int(_get(self.configs["text_encoder"], "max_position_embeddings"))

    def vae_factor(self) -> int:
        """Pixels per latent side: 2^(number of VAE blocks − 1), from block_out_channels (8 for SD3)."""
        return 2 ** (len(_get(self.configs["vae"], "block_out_channels")) - 1)

    def latent_channels(self) -> int:
        return int(_get(self.configs["vae"], "latent_channels"))

    def max_resolution(self) -> tuple[int, str]:
        """(the largest image side the transformer's position table covers, in pixels; how it is made up).
        diffusers crops SD3's pos_embed to the latent's patches and refuses a larger one."""
        tf = self.configs["transformer"]
        table, patch = int(_get(tf, "pos_embed_max_size")), int(_get(tf, "patch_size"))
        return table * patch * self.vae_factor(), f"pos_embed_max_size {table} × patch_size {patch} × VAE factor {self.vae_factor()}"


def check_resolution(path: str, resolution: int, what: str, tiny_seed: int = 0) -> None:
    """A UserError naming `what` when `resolution` is beyond what model `path` can generate (read from its configs,
    before any weights load). Silent when the configs cannot be read here: loading the model then says why."""
    from gerl.models.family import TINY_MODELS

    try:
        if path == "tiny":  # its constructor arguments, not the built pipeline: no diffusers import for a size check
            from gerl.models.tiny import TRANSFORMER_KWARGS, VAE_KWARGS

            arch = Architecture("the tiny SD3", {"transformer": TRANSFORMER_KWARGS, "vae": VAE_KWARGS})
        elif path in TINY_MODELS:  # the other tiny models have no position table (RoPE): nothing to check
            return
        else:
            arch = architecture(path, tiny_seed)
        if "transformer" not in arch.configs or "vae" not in arch.configs:
            return
        limit, why = arch.max_resolution()
    except (UserError, KeyError, TypeError, AttributeError):
        return
    if resolution > limit:
        raise UserError(f"{what} is larger than the {limit} px that {path} can generate ({why}); "
                        f"use at most {limit}")


def _get(cfg, key: str):
    return cfg[key] if isinstance(cfg, dict) else getattr(cfg, key)


def module_from_config(component: str, cfg: dict) -> torch.nn.Module:
    """A randomly initialised module from a saved config: diffusers' `_class_name` or transformers' `architectures`
    (as gerl.models.sd35_arch.build_component does for the shipped configs); built on the current device."""
    cfg = dict(cfg)
    if component in DIFFUSERS_COMPONENTS:
        import diffusers

        cls = getattr(diffusers, cfg.get("_class_name", ""), None)
        if cls is None:
            raise UserError(f"{component} config names no diffusers class (_class_name={cfg.get('_class_name')!r})")
        return cls.from_config(cfg)
    import transformers

    archs = cfg.get("architectures") or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None or "model_type" not in cfg:
        raise UserError(f"{component} config names no transformers class (architectures={archs}, "
                        f"model_type={cfg.get('model_type')!r})")
    return cls(transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg))


def _read(f: Path, what: str) -> dict:
    try:
        return json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{what}: cannot read {f} ({str(e).splitlines()[0]})") from None


def _family_components(transformer_cfg: dict, what: str) -> tuple[str, ...]:
    """The weighted components of the family whose transformer the config names (gerl.models.family)."""
    from gerl.models.family import families, supported

    name = str(transformer_cfg.get("_class_name", ""))
    for f in families().values():
        if f.transformer_class == name:
            return f.components
    raise UserError(f"{what}: its transformer is {name or 'unnamed'}, which gerl cannot train; it trains {supported()}")


def _configs_in(directory: Path, what: str) -> dict[str, dict]:
    """Each weighted component's config.json under `directory`: the transformer's first, which names the family and
    so the components to read."""
    def path(c: str) -> Path:
        return directory / c / "config.json"

    if not path("transformer").is_file():
        raise UserError(f"{what}: {path('transformer')} is missing; `gerl plan` reads each component's "
                        "<component>/config.json of a diffusers pipeline directory")
    configs = {"transformer": _read(path("transformer"), what)}
    comps = _family_components(configs["transformer"], what)
    for c in comps[1:] if comps[0] == "transformer" else comps:
        if not path(c).is_file():
            raise UserError(f"{what}: {path(c)} is missing; `gerl plan` reads each of {', '.join(comps)} from "
                            "<component>/config.json")
        configs[c] = _read(path(c), what)
    return configs


def _tiny(path: str, tiny_seed: int) -> Architecture:
    """A tiny offline model's live configs and classes, from its family's builder."""
    from gerl.models.family import TINY_MODELS, families

    fam = families()[TINY_MODELS[path][0]]
    pipe = fam.build_tiny(tiny_seed, TINY_MODELS[path][1])
    mods = {c: getattr(pipe, c) for c in fam.components}
    return Architecture(f"the tiny {fam.title} of model.path={path}", {c: m.config for c, m in mods.items()},
                        {c: type(m) for c, m in mods.items()})


def architecture(path: str, tiny_seed: int = 0) -> Architecture:
    """The configs of model.path (see the module docstring). Errors name the path and what to do."""
    from gerl.models import arch as shipped
    from gerl.models.family import TINY_MODELS

    folder = shipped.HUB_IDS.get(path, path if path in shipped.HUB_IDS.values() else None)
    if folder is not None and (shipped.CONFIGS / folder).is_dir():
        where = (shipped.CONFIGS / folder).relative_to(shipped.CONFIGS.parents[1])
        return Architecture(f"{folder} configs in {where}",
                            {c: shipped.load_config(folder, c) for c in shipped.components(folder)})
    if path in TINY_MODELS:
        return _tiny(path, tiny_seed)
    local = resolve_model_path(path)
    if Path(local).is_dir():
        return Architecture(f"configs in {local}", _configs_in(Path(local), f"model.path {path}"))
    if Path(local).exists():
        raise UserError(f"model.path {path} is a file; pass a diffusers pipeline directory or a hub id")
    if not re.fullmatch(r"[\w.\-]+/[\w.\-]+", path):
        raise UserError(f"model.path {path!r} is neither a tiny model, an existing directory, nor a hub id like "
                        f"{SD35_MEDIUM}")
    try:
        from huggingface_hub import snapshot_download

        snap = snapshot_download(path, allow_patterns=["*/config.json", "model_index.json"], local_files_only=True)
    except Exception as e:  # noqa: BLE001 — any miss (not cached, gated, no hub library) means the same to the user
        raise UserError(f"model.path {path}: its configs are not in the local HF cache ({type(e).__name__}); "
                        f"`gerl plan` never downloads: run `hf download {path} --include '*.json'` where there is "
                        f"network, or pass a local diffusers directory ({SD35_MEDIUM} needs neither)") from None
    return Architecture(f"configs in the HF cache ({snap})", _configs_in(Path(snap), f"model.path {path}"))

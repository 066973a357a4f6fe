"""The one architecture-specific part of `gerl plan`: what the planner asks of a model family.

The phases (gerl/plan/phases.py) and what each algorithm holds and runs (gerl/plan/work.py) are written against
`PlanFamily` alone: which weighted parts a role loads and how each is built on the meta device, the latent a
resolution gives, what a micro-batch carries to the device, the velocity forward, the text encoders' forward and
the VAE decode. A family plugs in by implementing it and registering a builder in FAMILIES under its transformer's
class name (as diffusers' configs spell it in `_class_name`): SD3 / SD3.5 is gerl/plan/sd3.py, FLUX.1
gerl/plan/flux.py, Qwen-Image gerl/plan/qwenimage.py. Each runs its model family's own code (gerl/models/<family>.py:
the velocity with its packing and guidance, the latent shape, the decode) on fake tensors wherever that code is free
of host-side work, and describes by hand only what needs a tokenizer or reads values (the text encoders' inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, ClassVar, Protocol

import torch

from gerl.config import ModelConfig
from gerl.errors import UserError
from gerl.models.loader import ROLE_COMPONENTS
from gerl.models.vae import to_uint8
from gerl.plan.arch import Architecture, architecture


class PlanFamily(Protocol):
    source: str  # where the architecture came from, in words

    def components(self, role: str) -> tuple[str, ...]:
        """The weighted parts a host of `role` ("actor" | "rollout") loads."""

    def label(self, component: str) -> str:
        """A part's name in the table ("T5 encoder")."""

    def build(self, component: str, dtype: torch.dtype) -> torch.nn.Module:
        """`component` on the meta device in `dtype` (the planner passes model.dtype, and the VAE's own dtype for
        the VAE: `gerl.plan.planner.vae_dtype`)."""

    def latent(self, resolution: int, transformer: torch.nn.Module) -> tuple[int, ...]:
        """One sample's latent shape (fp32), or a UserError naming a resolution the model cannot take."""

    def describe(self) -> str:
        """The conditioning in words, for the header ("text 77 CLIP + 256 T5 tokens")."""

    def uses_negative(self, guidance: float) -> bool:
        """Whether the velocity at this guidance runs a negative (unconditional) branch: the model family's answer
        (SD3's CFG and Qwen-Image's true CFG above 1; never FLUX.1, whose guidance is an embedding)."""

    def conditioning(self, b: int, guided: bool, dtype: torch.dtype) -> Any:
        """What a micro-batch of b samples carries to the device besides its latents (cached text embeddings; the
        negative ones too when `guided`), as the workers hold it."""

    def velocity(self, transformer, x: torch.Tensor, t: torch.Tensor, cond: Any, guidance: float) -> torch.Tensor:
        """The velocity (b, *latent) fp32 at x for timesteps t (b,), as the workers compute it (CFG included)."""

    def encode_text(self, encoders: dict[str, torch.nn.Module], b: int) -> None:
        """The text encoders' forward on b prompts (no grad), as the rollout runs it."""

    def decode(self, vae: torch.nn.Module, latents: torch.Tensor) -> None:
        """The VAE decode of latents (b, *latent) to uint8 images (no grad), as the rollout runs it."""


def _sd3(arch: Architecture, model: ModelConfig) -> PlanFamily:
    from gerl.plan.sd3 import SD3Plan

    return SD3Plan(arch, model.max_sequence_length)


def _flux(arch: Architecture, model: ModelConfig) -> PlanFamily:
    from gerl.plan.flux import FluxPlan

    return FluxPlan(arch, model.max_sequence_length)


def _qwenimage(arch: Architecture, model: ModelConfig) -> PlanFamily:
    from gerl.plan.qwenimage import QwenImagePlan

    return QwenImagePlan(arch, model.max_sequence_length)


def _kontext(arch: Architecture, model: ModelConfig) -> PlanFamily:
    from gerl.plan.edit import kontext

    return kontext(arch, model)


def _qwenimage_edit(arch: Architecture, model: ModelConfig) -> PlanFamily:
    from gerl.plan.edit import qwenimage_edit

    return qwenimage_edit(arch, model)


def _flux2(arch: Architecture, model: ModelConfig) -> PlanFamily:
    from gerl.plan.qwen3 import Flux2KleinPlan

    return Flux2KleinPlan(arch, model.max_sequence_length)


def _zimage(arch: Architecture, model: ModelConfig) -> PlanFamily:
    from gerl.plan.qwen3 import ZImagePlan

    return ZImagePlan(arch, model.max_sequence_length)


# transformer class name → builder of its family from the configs and the model's settings
FAMILIES: dict[str, Callable[[Architecture, ModelConfig], PlanFamily]] = {
    "SD3Transformer2DModel": _sd3, "FluxTransformer2DModel": _flux, "QwenImageTransformer2DModel": _qwenimage,
    "Flux2Transformer2DModel": _flux2, "ZImageTransformer2DModel": _zimage}
# the editing families (gerl.models.family names), which share a transformer class above (gerl/plan/edit.py)
EDITING: dict[str, Callable[[Architecture, ModelConfig], PlanFamily]] = {
    "flux_kontext": _kontext, "qwenimage_edit": _qwenimage_edit}


# ------------------------------------------------------------------ helpers the families share

@dataclass
class ArchPlan:
    """What every plan family holds the same way: the published configs (`arch`), a label per component, and each
    component built on the meta device in the dtype the planner asks for."""
    arch: Architecture
    labels: ClassVar[dict[str, str]] = {}

    @property
    def source(self) -> str:
        return self.arch.source

    def label(self, component: str) -> str:
        return self.labels[component]

    def build(self, component: str, dtype: torch.dtype) -> torch.nn.Module:
        return self.arch.build_meta(component, dtype)


@dataclass
class ModelFamilyPlan(ArchPlan):
    """A plan family whose components and latent shape come from its gerl.models family (FLUX.1, Qwen-Image)."""
    model_family: ClassVar[Any] = None

    def components(self, role: str) -> tuple[str, ...]:
        return role_components(self.model_family, role)

    def latent(self, resolution: int, transformer) -> tuple[int, int, int]:
        return self.model_family.latent_shape(pipe_view(self.arch, transformer), resolution)


def role_components(model_family, role: str) -> tuple[str, ...]:
    """What a host of `role` loads (gerl.models.loader.ROLE_COMPONENTS, as gerl/engine/roles.py asks the loader):
    the actor the transformer alone, the rollout every weighted part of its model family."""
    return tuple(c for c in model_family.components if c in ROLE_COMPONENTS[role])


def pipe_view(arch: Architecture, transformer) -> SimpleNamespace:
    """What a model family's `latent_shape(pipe, resolution)` reads of a pipeline — the transformer and the VAE's
    config — without building the VAE."""
    vae = arch.configs["vae"]
    return SimpleNamespace(transformer=transformer,
                           vae=SimpleNamespace(config=SimpleNamespace(**vae) if isinstance(vae, dict) else vae))


def rollout_decode(model_family, vae, latents: torch.Tensor) -> None:
    """gerl.workers.rollout.decode of latents (b, *latent) up to the host copy (no grad): the family's decode, the
    float images, the non-finite check and the uint8 images."""
    with torch.no_grad():
        x = model_family.decode(vae, latents).float()
        (~torch.isfinite(x.flatten(1))).any(1).sum()
        to_uint8(x).contiguous()


def transformer_class(arch: Architecture) -> str:
    if arch.classes is not None:
        return arch.classes["transformer"].__name__
    cfg = arch.configs.get("transformer")
    return str(cfg.get("_class_name", "")) if isinstance(cfg, dict) else ""


def family_for(model: ModelConfig) -> PlanFamily:
    """The plan family of model.path (its configs read as gerl/plan/arch.py says); a UserError names an
    architecture no family counts yet. An editing model shares its transformer's class with a text-to-image family:
    its pipeline class (model_index.json, the tiny model's) picks it first."""
    arch = architecture(model.path, model.tiny_seed)
    from gerl.models.loader import model_family

    try:
        named = model_family(model.path)
    except UserError:  # a directory of component configs without a model_index.json: its transformer decides
        named = None
    edit = EDITING.get(getattr(named, "name", ""))
    if edit is not None:
        return edit(arch, model)
    name = transformer_class(arch)
    if name not in FAMILIES:
        raise UserError(f"model.path {model.path}: `gerl plan` counts {', '.join(FAMILIES)} transformers; this one "
                        f"is {name or 'unnamed'} ({arch.source})")
    return FAMILIES[name](arch, model)

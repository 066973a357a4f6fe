"""Released architectures with random weights, built from the published configs shipped under assets/configs/.

Each folder there (sd3.5-medium, flux.1-dev, flux.1-schnell, ...) holds one model's component configs as its hub
repository lays them out — `<component>/config.json`, `scheduler/scheduler_config.json` — with a README naming
where they were copied from. No weights are shipped or downloaded. Each config names its own class (`_class_name`
for diffusers, `architectures` for transformers), so this module holds no sizes and builds any family; diffusers is
imported only for diffusers components, so text encoders build on a machine that has transformers alone.

    modules = build("flux.1-dev", device="cuda", dtype=torch.bfloat16)   # {component: nn.Module}, random weights
    with torch.device("meta"):                                           # sizes only, nothing allocated
        print(param_counts(build("black-forest-labs/FLUX.1-dev")))
    tr = random_module(load_config("flux.1-dev", "transformer"), "cuda", torch.bfloat16)   # 12 B in seconds

`build` initialises as the classes do (on the device given; the peak is the fp32 size). `random_module` is the fast
way for benchmarks: parameters are created on the meta device, given uninitialised storage of the target dtype on
the device, then filled with one seeded normal draw each (no fp32 copy, no per-layer init kernels).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from gerl.errors import UserError

CONFIGS = Path(__file__).resolve().parents[2] / "assets" / "configs"
# Hub ids whose configs ship here, to the folder that holds them (a folder name works as well).
HUB_IDS = {
    "stabilityai/stable-diffusion-3.5-medium": "sd3.5-medium",
    "stabilityai/stable-diffusion-3.5-large": "sd3.5-large",
    "black-forest-labs/FLUX.1-dev": "flux.1-dev",
    "black-forest-labs/FLUX.1-schnell": "flux.1-schnell",
    "Qwen/Qwen-Image": "qwen-image",
    "black-forest-labs/FLUX.1-Kontext-dev": "flux.1-kontext-dev",
    "Qwen/Qwen-Image-Edit-2509": "qwen-image-edit-2509",
    "Tongyi-MAI/Z-Image-Turbo": "z-image-turbo",
    "black-forest-labs/FLUX.2-klein-base-4B": "flux.2-klein-base-4b",
}
FIRST = ("transformer", "vae")  # listed first by `components`; the text encoders follow by name


def shipped() -> list[str]:
    """The model folders present under assets/configs."""
    return sorted(p.name for p in CONFIGS.iterdir() if p.is_dir() and any(p.glob("*/config.json")))


def config_dir(model: str) -> Path:
    """The folder of `model` (a folder name under assets/configs or a hub id listed in HUB_IDS)."""
    folder = CONFIGS / HUB_IDS.get(model, model)
    if not folder.is_dir():
        raise UserError(f"no shipped configs for {model!r}; shipped: {', '.join(shipped())} (or their hub ids: "
                        f"{', '.join(h for h, f in HUB_IDS.items() if (CONFIGS / f).is_dir())})")
    return folder


def components(model: str) -> tuple[str, ...]:
    """The weighted components of `model` (the subfolders with a config.json): transformer, vae, text encoders."""
    names = sorted(p.parent.name for p in config_dir(model).glob("*/config.json"))
    return tuple(sorted(names, key=lambda n: (FIRST.index(n) if n in FIRST else len(FIRST), n)))


def load_config(model: str, component: str) -> dict:
    """The published config of one component of `model` ("transformer", "vae", "text_encoder", …, "scheduler")."""
    folder = config_dir(model)
    known = components(model) + ("scheduler",)
    if component not in known:
        raise UserError(f"unknown {folder.name} component {component!r}; known: {', '.join(known)}")
    path = folder / component / ("scheduler_config.json" if component == "scheduler" else "config.json")
    if not path.is_file():
        raise UserError(f"{path} is missing; it ships with the gerl repository (restore it with `git checkout "
                        f"assets/configs`)")
    return json.loads(path.read_text())


def module_from_config(cfg: dict) -> torch.nn.Module:
    """A module of the class the config names, built with the class's own init on the current default device."""
    cfg = dict(cfg)
    if "_class_name" in cfg:
        import diffusers  # lazily: the text encoders need transformers only

        return getattr(diffusers, cfg["_class_name"]).from_config(cfg)
    import transformers

    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    return getattr(transformers, cfg["architectures"][0])(config)


def build_component(model: str, component: str, device: str | torch.device | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """One component as a randomly initialised nn.Module (the class's own init) on `device`, cast to `dtype`.

    device=None builds on the current default device, so that an enclosing `with torch.device("meta"):` holds and
    nothing is allocated. Weights are initialised in fp32 and then cast: the peak is the fp32 size (T5-XXL's
    encoder: 19 GB), so build the large parts on the GPU (or on meta), or use `random_module`.
    """
    cfg = load_config(model, component)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        module = module_from_config(cfg)
    return module.to(dtype).eval()


def build(model: str, names=None, device: str | torch.device | None = None,
          dtype: torch.dtype = torch.float32) -> dict:
    """{component: nn.Module} for `names` (default: every weighted component of `model`), in the order given."""
    return {name: build_component(model, name, device, dtype) for name in (names or components(model))}


def param_counts(modules: dict) -> dict[str, int]:
    """{name: number of parameters}. Shared tensors count once (T5's input embedding is both `shared` and
    `encoder.embed_tokens`); buffers are not parameters."""
    return {name: sum(p.numel() for p in m.parameters()) for name, m in modules.items()}


# ------------------------------------------------------------------ fast random weights for benchmarks

def random_module(cfg: dict, device: str | torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """The module `cfg` names, with random weights of `dtype` on `device`, built without the classes' own init.

    The parameters are created on the meta device (buffers, e.g. CLIP's position ids, are computed as usual on the
    CPU), then get uninitialised storage on `device` directly in `dtype` (T5-XXL or FLUX's 12 B transformer never
    exist in fp32), then `fill_random_`. For speed and memory measurements: the values are not the classes' init.
    """
    with _parameters_on_meta():
        module = module_from_config(cfg)
    memo: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:  # a tied parameter (T5's shared embedding) stays one tensor
                t = torch.empty(p.shape, device=device, dtype=dtype if p.is_floating_point() else p.dtype)
                memo[id(p)] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
            sub._parameters[name] = memo[id(p)]
    for sub in module.modules():  # the buffers (computed on the CPU) follow; their own integer dtypes stay
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = b.to(device, dtype if b.is_floating_point() else b.dtype)
    fill_random_(module, seed)
    return module.eval()


@contextlib.contextmanager
def _parameters_on_meta():
    """Inside, every parameter a module registers is moved to the meta device; buffers are left alone. A parameter
    already on meta is registered as it is, so a tie made by assignment (transformers' tie_weights) stays a tie
    (accelerate's init_empty_weights wraps it anew and unties it)."""
    register = torch.nn.Module.register_parameter

    def on_meta(self, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


@torch.no_grad()
def fill_random_(module: torch.nn.Module, seed: int = 0) -> None:
    """Overwrite every parameter: matrices and kernels ~ N(0, 1/fan_in) (activations keep their scale through a
    layer, so a deep random stack stays finite in bf16), 1-D weights (norm scales) 1, biases 0. One seeded draw per
    tensor on its own device (on meta, sizes only: nothing is drawn)."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in module.named_parameters():
        if p.device.type == "meta":
            continue
        if p.ndim >= 2:
            g = gens.setdefault(p.device, torch.Generator(p.device).manual_seed(seed))
            p.normal_(0.0, float(p[0].numel()) ** -0.5, generator=g)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.fill_(1.0)

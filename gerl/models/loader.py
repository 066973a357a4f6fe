"""Load SD3 / SD3.5 (tiny, a local directory, or a hub id), attach LoRA, and cache prompt embeddings."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from pathlib import Path

import torch

from gerl.errors import UserError
from gerl.sampling.loop import Embeds

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
PEFT_WEIGHT_NAME = "adapter_model.safetensors"  # with adapter_config.json: what PeftModel.from_pretrained reads
# Models shipped inside the repository, selected by name (model.path=ocr-mini); see assets/models/*/README.md.
SHIPPED_MODELS = {"ocr-mini": Path(__file__).resolve().parents[2] / "assets" / "models" / "ocr-mini"}


def resolve_model_path(path: str) -> str:
    """A shipped model's name → its directory; anything else unchanged. A missing shipped model is a UserError."""
    if path in SHIPPED_MODELS:
        d = SHIPPED_MODELS[path]
        if not (d / "model_index.json").is_file():
            raise UserError(f"model.path={path}: {d} is missing; it ships with the gerl repository (reinstall from a "
                            f"clone), or rebuild it with `python scripts/pretrain_ocr_mini.py --out {d}`")
        return str(d)
    return path


SETTINGS_FILE = "gerl_settings.json"  # in a shipped model's directory: the settings gerl's recipes use with it


def shipped_settings(path: str) -> dict:
    """A shipped model's sampling settings for `gerl sample` / `gerl eval` (resolution, max_sequence_length,
    num_steps, guidance), so that a base model is sampled as its runs validate; {} for any other model."""
    d = SHIPPED_MODELS.get(path)
    f = d / SETTINGS_FILE if d is not None else None
    return json.loads(f.read_text()) if f is not None and f.is_file() else {}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(f"model.device={name!r} is not a torch device; use auto, cpu, cuda or cuda:N") from None


# The pipeline's parts that hold weights; a role loads only those it uses (ROLE_COMPONENTS).
WEIGHTED_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
TOKENIZERS = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2", "text_encoder_3": "tokenizer_3"}
# The actor trains the transformer and reads nothing else: its batches carry the text embeddings and latents, so
# the VAE and the three text encoders (10.55 GiB for SD3.5-M in fp16) stay off its device.
ROLE_COMPONENTS = {"actor": ("transformer",), "rollout": WEIGHTED_COMPONENTS}


def load_pipeline(path: str, dtype: str = "fp32", device: str = "auto", tiny_seed: int = 0,
                  components: tuple[str, ...] = WEIGHTED_COMPONENTS):
    """StableDiffusion3Pipeline from "tiny", a shipped model ("ocr-mini"), a local diffusers directory, or a hub id (from the local HF cache
    or downloaded). Errors name the path and what to do.

    components: the weighted parts to load (the rest, and the tokenizers of text encoders left out, are None).
    The transformer and text encoders take `dtype`; the VAE always decodes in fp32 (its config asks for
    force_upcast, and both Flow-GRPO and GeRL keep it there: in fp16 its decoder overflows)."""
    from diffusers import StableDiffusion3Pipeline

    from gerl.logging.quiet import quiet_imported

    quiet_imported()  # its loading bar off, when this process asked for quiet (gerl's CLI and hosts do)
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    path = resolve_model_path(path)
    skipped = {name: None for name in WEIGHTED_COMPONENTS if name not in components}
    skipped.update({TOKENIZERS[name]: None for name in skipped if name in TOKENIZERS})
    if path == "tiny":
        from gerl.models.tiny import build_tiny_sd3

        pipe = build_tiny_sd3(tiny_seed)
        for name in skipped:
            setattr(pipe, name, None)
    elif Path(path).exists():
        if not (Path(path) / "model_index.json").is_file():
            raise UserError(f"model.path {path} is not a diffusers pipeline directory (no model_index.json); "
                            "pass the folder that `save_pretrained` wrote, or a hub id")
        pipe = StableDiffusion3Pipeline.from_pretrained(path, torch_dtype=DTYPES[dtype], **skipped)
    elif re.fullmatch(r"[\w.\-]+/[\w.\-]+", path):
        try:
            pipe = StableDiffusion3Pipeline.from_pretrained(path, torch_dtype=DTYPES[dtype], **skipped)
        except OSError as e:
            raise UserError(f"cannot load {path} from the hub or the local HF cache ({str(e).splitlines()[0]}); "
                            f"run `hf download {path}` where there is network, or pass a local directory") from None
    else:
        raise UserError(f"model.path {path!r} is neither 'tiny', an existing directory, nor a hub id like "
                        "stabilityai/stable-diffusion-3.5-medium")
    pipe.to(resolve_device(device), DTYPES[dtype])
    if pipe.vae is not None:
        pipe.vae.to(torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for m in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        if m is not None:
            m.requires_grad_(False)
            m.eval()
    return pipe


def add_lora(transformer, rank: int, alpha: float, targets: list[str], init: str = "default", seed: int = 0):
    """Attach a fresh LoRA (B = 0, so the policy starts equal to the base model) and keep its weights in fp32.
    init: A's initialisation, peft's default (Kaiming-uniform) or "gaussian".

    seed: A is drawn from torch's CPU generator seeded with it (peft initialises on the CPU before moving the adapter
    to the base layer's device), and the caller's generator state is left as it was. peft itself draws from the
    global generator, which nothing else seeds when a model is loaded from disk: every run of SD3.5-M would start
    from another A, and two data-parallel actors from different adapters. (B = 0 hides it from the first forward;
    A sets the first update's grad B.)"""
    from peft import LoraConfig

    names = [name for name, _ in transformer.named_modules()]
    # peft matches a target against the end of a module's dotted name; check the same way to fail early.
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise UserError(f"model.lora_targets {missing} match no module of the transformer; "
                        "use names like to_q, to_k, to_v, to_out.0, add_q_proj")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                           init_lora_weights="gaussian" if init == "gaussian" else True))
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # fp32 master weights for the adapter even when the base is bf16
    return transformer


def lora_state_dict(transformer) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().float().cpu().contiguous() for k, v in get_peft_model_state_dict(transformer).items()}


def lora_metadata(transformer) -> dict:
    """The adapter config saved beside the weights so loaders apply the right alpha / rank scaling."""
    cfg = transformer.peft_config["default"].to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}


def save_lora(transformer, directory: str | Path) -> None:
    """Write the LoRA twice over, for the two loaders people use:
    `pytorch_lora_weights.safetensors` for StableDiffusion3Pipeline.load_lora_weights, and
    `adapter_config.json` + `adapter_model.safetensors` for peft.PeftModel.from_pretrained(transformer, directory)
    (PEFT's own file names and "base_model.model." keys; the LoRA is small, so the copy costs little)."""
    from diffusers import StableDiffusion3Pipeline
    from safetensors.torch import save_file

    weights = lora_state_dict(transformer)
    StableDiffusion3Pipeline.save_lora_weights(
        str(directory),
        transformer_lora_layers=weights,
        transformer_lora_adapter_metadata=lora_metadata(transformer),
        weight_name=LORA_WEIGHT_NAME,
    )
    transformer.peft_config["default"].save_pretrained(str(directory))
    save_file({f"base_model.model.{k}": v for k, v in weights.items()}, str(Path(directory) / PEFT_WEIGHT_NAME))


def lora_file(path: str | Path) -> Path:
    """A LoRA given as a checkpoint directory or a .safetensors file → the weights file, or a UserError when it is
    missing, not a safetensors file, or holds no LoRA weights (lora_A/lora_B, lora_down/lora_up)."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    f = p / LORA_WEIGHT_NAME if p.is_dir() else p
    if not f.is_file():
        raise UserError(f"LoRA {path} does not exist (expected a checkpoint directory holding {LORA_WEIGHT_NAME} "
                        "or a .safetensors file); check the path, e.g. RUN/checkpoints/step_000010")
    try:
        with safe_open(str(f), framework="pt") as st:
            keys = list(st.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"LoRA {f} is not a readable safetensors file ({str(e).splitlines()[0][:120]}); pass "
                        f"a checkpoint directory or its {LORA_WEIGHT_NAME}") from None
    if not any(m in k for k in keys for m in ("lora_A", "lora_B", "lora_down", "lora_up")):
        raise UserError(f"{f} holds no LoRA weights ({len(keys)} tensors, none named lora_A/lora_B); pass a LoRA "
                        f"such as RUN/checkpoints/step_000010/{LORA_WEIGHT_NAME}")
    return f


def load_lora_into_pipeline(pipe, path: str | Path, adapter_name: str | None = None) -> None:
    f = lora_file(path)
    try:
        pipe.load_lora_weights(str(f.parent), weight_name=f.name, adapter_name=adapter_name)
    except (ValueError, KeyError, RuntimeError) as e:
        raise UserError(f"LoRA {f} does not fit this model ({str(e).splitlines()[0][:200]}); "
                        "was it trained on a different base model?") from None


def read_lora_metadata(path: str | Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(lora_file(path)), framework="pt") as f:
        meta = f.metadata() or {}
    raw = json.loads(meta.get("lora_adapter_metadata") or "{}")
    # diffusers prefixes each key with the component it belongs to ("transformer.r")
    return {k.split(".", 1)[1] if k.startswith("transformer.") else k: v for k, v in raw.items()}


class TextEmbedder:
    """Prompt → SD3 text embeddings, with an LRU cache so the three text encoders run once per distinct prompt."""

    def __init__(self, pipe, max_sequence_length: int, cache_size: int = 4096):
        self.pipe = pipe
        self.max_sequence_length = max_sequence_length
        self.cache_size = cache_size
        self._cache: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.hits = self.misses = 0

    @torch.no_grad()
    def _encode(self, prompts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.pipe.transformer.device,
            do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length,
        )
        # Kept in host memory: one SD3.5 prompt is 333 × 4096 values, so thousands of them do not belong on a GPU.
        return [(embeds[i].cpu(), pooled[i].cpu()) for i in range(len(prompts))]

    def _lookup(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        missing = list(dict.fromkeys(p for p in prompts if p not in self._cache))
        self.misses += len(missing)
        self.hits += len(prompts) - len(missing)
        for p, e in zip(missing, self._encode(missing) if missing else []):
            self._cache[p] = e
        for p in prompts:
            self._cache.move_to_end(p)
        while len(self._cache) > max(self.cache_size, len(set(prompts))):
            self._cache.popitem(last=False)
        device = self.pipe.transformer.device
        return (torch.stack([self._cache[p][0] for p in prompts]).to(device),
                torch.stack([self._cache[p][1] for p in prompts]).to(device))

    def __call__(self, prompts: list[str], with_negative: bool = False) -> Embeds:
        prompt, pooled = self._lookup(prompts)
        if not with_negative:
            return Embeds(prompt, pooled)
        neg, neg_pooled = self._lookup([""] * len(prompts))
        return Embeds(prompt, pooled, neg, neg_pooled)

"""Load a model of any family gerl trains (a tiny offline one, a shipped one, a local directory or a hub id; the
family comes from the directory's model_index.json: gerl/models/family.py), attach LoRA, and cache prompt
embeddings."""

from __future__ import annotations

import json
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


# The pipeline's parts that hold weights, over every family (each family lists its own: Family.components); a
# role loads only those it uses (ROLE_COMPONENTS).
WEIGHTED_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
# The actor trains the transformer and reads nothing else: its batches carry the text embeddings and latents, so
# the VAE and the text encoders (10.55 GiB for SD3.5-M in fp16) stay off its device.
ROLE_COMPONENTS = {"actor": ("transformer",), "rollout": WEIGHTED_COMPONENTS}
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")  # left unloaded with model.text_cache


def model_family(path: str, local_files_only: bool = True):
    """The family of model.path (a tiny or shipped name, a directory, a hub id), read before anything loads; None
    for a hub id that is not in the local HF cache (with local_files_only). A directory gerl cannot train (another
    pipeline class, model_index.json missing or not JSON) is a UserError naming the class and the supported ones."""
    from gerl.models.family import family_for_path

    return family_for_path(resolve_model_path(path), local_files_only)


def load_pipeline(path: str, dtype: str = "fp32", device: str = "auto", tiny_seed: int = 0,
                  components: tuple[str, ...] = WEIGHTED_COMPONENTS, vae_dtype: str = "auto"):
    """The pipeline of model `path`: a tiny offline model ("tiny", "tiny-flux", ...), a shipped model ("ocr-mini"),
    a local diffusers directory, or a hub id (from the local HF cache or downloaded), loaded with its family's
    pipeline class. Errors name the path and what to do.

    components: the weighted parts to load (the rest, and the tokenizers of text encoders left out, are None).
    The transformer and text encoders take `dtype`; the VAE takes `vae_dtype` (model.vae_dtype: auto = bf16 on
    CUDA, fp32 elsewhere; never fp16, whose range its decoder overflows; gerl/models/vae.py)."""
    from gerl.logging.quiet import quiet_imported
    from gerl.models.family import TINY_MODELS

    quiet_imported()  # its loading bar off, when this process asked for quiet (gerl's CLI and hosts do)
    from gerl.models.vae import VAE_DTYPES, prepare_vae, vae_dtype_for

    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if vae_dtype != "auto" and vae_dtype not in VAE_DTYPES:
        raise UserError(f"unknown VAE dtype {vae_dtype!r}; choose auto, {' or '.join(VAE_DTYPES)} (fp16 overflows "
                        "to NaN in the VAE's decoder)")
    family = model_family(path, local_files_only=False)  # the bad-input errors, before any weights load
    path = resolve_model_path(path)
    target = resolve_device(device)
    vae_dt = vae_dtype_for(vae_dtype, target)
    skipped = {name: None for name in family.components if name not in components}
    skipped.update({family.tokenizers[name]: None for name in skipped if name in family.tokenizers})
    skipped.update(dict.fromkeys(family.unloaded))
    if path in TINY_MODELS:
        pipe = family.build_tiny(tiny_seed, TINY_MODELS[path][1])
        for name in skipped:
            setattr(pipe, name, None)
    else:
        try:
            # the VAE loads in its own dtype: read in the model's (fp16) and cast back, its weights would be rounded
            pipe = family.pipeline_cls().from_pretrained(path, torch_dtype={"default": DTYPES[dtype], "vae": vae_dt},
                                                         **skipped)
        except OSError as e:
            raise UserError(f"cannot load {path} ({str(e).splitlines()[0][:200]}); pass a complete diffusers "
                            f"directory, or run `hf download {path}` where there is network") from None
    pipe.to(target)
    pipe.set_progress_bar_config(disable=True)
    for name in family.components:
        m = getattr(pipe, name, None)
        if m is not None:
            if name == "vae":
                prepare_vae(m, vae_dt)
            else:
                m.to(DTYPES[dtype])
            m.requires_grad_(False)
            m.eval()
    return pipe


def add_lora(transformer, rank: int, alpha: float, targets: list[str], init: str = "default", seed: int = 0,
             family=None):
    """Attach a fresh LoRA (B = 0, so the policy starts equal to the base model) and keep its weights in fp32.
    targets: module names (peft matches the end of a dotted name); empty = the model family's default
    (Family.lora_targets; `family` when given, else the transformer's: FLUX.1-Kontext's pipeline knows its family,
    its transformer alone is FLUX.1's class). init: A's initialisation, peft's default (Kaiming-uniform) or "gaussian".

    seed: A is drawn from torch's CPU generator seeded with it (peft initialises on the CPU before moving the adapter
    to the base layer's device), and the caller's generator state is left as it was. peft itself draws from the
    global generator, which nothing else seeds when a model is loaded from disk: every run of SD3.5-M would start
    from another A, and two data-parallel actors from different adapters. (B = 0 hides it from the first forward;
    A sets the first update's grad B.)"""
    from peft import LoraConfig

    from gerl.models.family import family_of

    targets = list(targets) or list((family or family_of(transformer)).lora_targets)
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


def lora_state_dict(transformer, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's names; `state_dict`: the transformer's own tensors by module name to take
    them from (whole ones, where the data-parallel layer holds DTensors)."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().float().cpu().contiguous()
            for k, v in get_peft_model_state_dict(transformer, state_dict=state_dict).items()}


def lora_metadata(transformer) -> dict:
    """The adapter config saved beside the weights so loaders apply the right alpha / rank scaling."""
    cfg = transformer.peft_config["default"].to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}


def save_lora(transformer, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write the LoRA twice over, for the two loaders people use:
    `pytorch_lora_weights.safetensors` for the family's pipeline's load_lora_weights (StableDiffusion3Pipeline,
    FluxPipeline), and
    `adapter_config.json` + `adapter_model.safetensors` for peft.PeftModel.from_pretrained(transformer, directory)
    (PEFT's own file names and "base_model.model." keys; the LoRA is small, so the copy costs little).
    `state_dict`: the adapter's whole tensors by module name (see lora_state_dict)."""
    from safetensors.torch import save_file

    from gerl.models.family import family_of

    weights = lora_state_dict(transformer, state_dict)
    family_of(transformer).pipeline_cls().save_lora_weights(
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


@torch.no_grad()
def encode_rows(family, pipe, prompts: list[str], max_sequence_length: int, images: list | None = None,
                condition_resolution: int = 0) -> list[Embeds]:
    """Each prompt's embeddings (a batch of 1, on the CPU), encoded on its own: batched, the encoders' matrix
    products round differently with the batch's shape, so a prompt's row would depend on which prompts shared its
    micro-batch (the tiny SD3's and Qwen-Image's do, in the last bits) — and the rows `gerl prepare` writes could not
    equal the ones a run encodes. A masked row (a family whose prompts have their own lengths) keeps only its real
    tokens, and a row's conditioning image (`images`: one PIL image per prompt, for an image-conditioned family) its
    own tokens. Kept in host memory: one SD3.5 prompt is 333 × 4096 values, so thousands of them do not belong on a
    GPU."""
    rows = []
    for i, p in enumerate(prompts):
        extra = {} if images is None else {"images": [images[i]], "condition_resolution": condition_resolution}
        row = family.encode_prompts(pipe, [p], max_sequence_length, **extra).to("cpu")
        if row.mask is not None:
            n = int(row.mask.sum())
            row = Embeds(row.prompt[:, :n], row.pooled, mask=row.mask[:, :n], cond=row.cond, cond_hw=row.cond_hw)
        if row.cond is not None:
            row.cond = row.cond[:, :family.condition_tokens(*row.cond_hw[0].tolist())]
        rows.append(row)
    return rows


class TextEmbedder:
    """Prompt (and, for an image-conditioned family, its conditioning image) → conditioning embeddings (the model
    family's `encode_prompts`), with an LRU cache keyed on (prompt, image path) so that the text encoders — and the
    VAE encode of a conditioning image — run once per distinct pair. With `disk` (model.text_cache,
    gerl/models/text_cache.py) a text-to-image family's rows come from the memory-mapped cache `gerl prepare` wrote,
    and the pipeline needs no text encoder.

    condition_resolution: model.condition_resolution, handed to an image-conditioned family (0 = its stock
    pipeline's own conditioning size)."""

    def __init__(self, pipe, max_sequence_length: int, cache_size: int = 4096, condition_resolution: int = 0,
                 disk=None):
        from gerl.models.family import family_of

        self.pipe, self.family = pipe, family_of(pipe)
        self.max_sequence_length = max_sequence_length
        self.condition_resolution = condition_resolution
        self.cache_size = cache_size
        if disk is not None and self.family.conditioned:
            raise UserError(f"model.text_cache serves text-to-image families only: {self.family.title} encodes each "
                            "prompt with its conditioning image; unset model.text_cache")
        self.disk = disk
        # (prompt, image path or None) → its row (batch of 1), on the CPU
        self._cache: OrderedDict[tuple[str, str | None], Embeds] = OrderedDict()
        self.hits = self.misses = 0

    def _encode(self, keys: list[tuple[str, str | None]]) -> list[Embeds]:
        if self.disk is not None:  # every prompt of the run's files is on disk; these are not
            raise UserError(f"{len(keys)} prompt(s) are not in model.text_cache (e.g. {keys[0][0][:80]!r}) and this "
                            "host loaded no text encoder: rerun `gerl prepare` with the prompt files this run uses")
        if not self.family.conditioned:
            return encode_rows(self.family, self.pipe, [p for p, _ in keys], self.max_sequence_length)
        from gerl.data.prompts import open_image

        return encode_rows(self.family, self.pipe, [p for p, _ in keys], self.max_sequence_length,
                           [open_image(path) for _, path in keys], self.condition_resolution)

    def _lookup(self, keys: list[tuple[str, str | None]]) -> Embeds:
        disk = self.disk if self.disk is not None else ()
        on_disk = [path is None and p in disk for p, path in keys]
        missing = list(dict.fromkeys(k for k, d in zip(keys, on_disk) if not d and k not in self._cache))
        self.misses += len(missing)
        self.hits += len(keys) - len(missing)
        for k, e in zip(missing, self._encode(missing) if missing else []):
            self._cache[k] = e
        for k in keys:
            if k in self._cache:
                self._cache.move_to_end(k)
        while len(self._cache) > max(self.cache_size, len(set(keys))):
            self._cache.popitem(last=False)
        rows = [self.disk.row(k[0]) if d else self._cache[k] for k, d in zip(keys, on_disk)]
        return Embeds.cat(rows).to(self.pipe.transformer.device)

    def __call__(self, prompts: list[str], with_negative: bool = False, images: list | None = None) -> Embeds:
        """Embeddings of `prompts`; with_negative adds the family's negative prompt's as the unconditional branch.

        images: one conditioning image path per prompt (the prompt file's "image", resolved), for an
        image-conditioned family — which needs one for every prompt — and None for any other family. The negative
        branch is encoded with the same image (the stock edit pipelines encode the negative prompt with it)."""
        from gerl.errors import UserError

        if self.family.conditioned and (images is None or any(i is None for i in images)):
            raise UserError(f"{self.family.title} edits an image: every prompt needs one (a .jsonl prompt file with "
                            '{"prompt": ..., "image": PATH} lines)')
        if not self.family.conditioned and images is not None and any(i is not None for i in images):
            raise UserError(f"{self.family.title} is a text-to-image family: its prompts take no \"image\"; use an "
                            f"image-editing model ({conditioned_titles()}) or drop the images from the prompt file")
        paths = [None] * len(prompts) if images is None else [None if i is None else str(i) for i in images]
        embeds = self._lookup(list(zip(prompts, paths)))
        if not with_negative:
            return embeds
        return embeds.with_negative(self._lookup([(self.family.negative_prompt, p) for p in paths]))


def conditioned_titles() -> str:
    """The image-conditioned families, for messages."""
    from gerl.models.family import families

    return ", ".join(f.title for f in families().values() if f.conditioned) or "none registered"

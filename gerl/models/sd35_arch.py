"""Stable Diffusion 3.5 Medium's architecture with random weights, built from the configs in the repository.

The configs under assets/configs/sd3.5-medium/ are the published ones (see its README.md); no weights are
downloaded or shipped. The building is gerl.models.arch's (any shipped model); this module keeps SD3.5-M's names and
what runs its three text encoders on token ids. diffusers is imported only for the transformer and the VAE: the
text encoders build on a machine that has transformers alone.

    modules = build_sd35_medium(device="cuda", dtype=torch.bfloat16)   # five nn.Modules, random weights
    with torch.device("meta"):                                          # sizes only, nothing allocated
        print(param_counts(build_sd35_medium()))
"""

from __future__ import annotations

import zlib

import torch

from gerl.errors import UserError
from gerl.models import arch

CONFIG_DIR = arch.CONFIGS / "sd3.5-medium"
DIFFUSERS_COMPONENTS = ("transformer", "vae")
TRANSFORMERS_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3")
COMPONENTS = DIFFUSERS_COMPONENTS + TRANSFORMERS_COMPONENTS


def load_config(component: str) -> dict:
    """The published config of one component ("transformer", "vae", "text_encoder", …, or "scheduler")."""
    if component not in COMPONENTS + ("scheduler",):
        raise UserError(f"unknown SD3.5-Medium component {component!r}; known: {', '.join(COMPONENTS)}, scheduler")
    return arch.load_config(CONFIG_DIR.name, component)


def build_component(component: str, device: str | torch.device | None = None, dtype: torch.dtype = torch.float32):
    """One component as a randomly initialised nn.Module on `device`, cast to `dtype` (gerl.models.arch.
    build_component: device=None builds on the current default device, e.g. inside `with torch.device("meta"):`;
    the peak is the fp32 size, so build the large parts on the GPU or on meta)."""
    load_config(component)  # the SD3.5-M name check
    return arch.build_component(CONFIG_DIR.name, component, device, dtype)


def build_sd35_medium(components=COMPONENTS, device: str | torch.device | None = None,
                      dtype: torch.dtype = torch.float32) -> dict:
    """{name: nn.Module} for the requested components, in the order given."""
    return {name: build_component(name, device, dtype) for name in components}


def param_counts(modules: dict) -> dict[str, int]:
    """{name: number of parameters}. Shared tensors count once (T5's input embedding is both `shared` and
    `encoder.embed_tokens`). Buffers are not parameters: the transformer's 384×384 positional-embedding table
    (226 M values, saved in its checkpoint) is left out."""
    return {name: sum(p.numel() for p in m.parameters()) for name, m in modules.items()}


# ------------------------------------------------------------------ the three text encoders on token ids

def sd3_text_embeds(clip_l: tuple[torch.Tensor, torch.Tensor], clip_g: tuple[torch.Tensor, torch.Tensor],
                    t5: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Join the encoders' outputs the way StableDiffusion3Pipeline.encode_prompt does (clip_skip=None).

    Args:
        clip_l, clip_g: (penultimate hidden states (B, Lc, Dl | Dg), projected pooled output (B, Pl | Pg)).
        t5: (B, Lt, Dt) T5's last hidden state; Dt ≥ Dl + Dg.

    Returns:
        prompt (B, Lc + Lt, Dt): the CLIP features side by side, zero-padded to T5's width, then T5's tokens;
        pooled (B, Pl + Pg).
    """
    clip = torch.cat([clip_l[0], clip_g[0]], dim=-1)
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    return torch.cat([clip, t5], dim=-2), torch.cat([clip_l[1], clip_g[1]], dim=-1)


@torch.no_grad()
def encode_token_ids(encoders, ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
    """(prompt (B, Lc + Lt, Dt), pooled (B, Pl + Pg)) from CLIP-L, CLIP-G and T5 run on token ids (B, L) each."""
    clip_l, clip_g, t5 = encoders

    def clip(encoder, x):
        out = encoder(x, output_hidden_states=True)
        return out.hidden_states[-2], out.text_embeds

    return sd3_text_embeds(clip(clip_l, ids[0]), clip(clip_g, ids[1]), t5(ids[2])[0])


class RandomTokenEmbedder:
    """Prompt → SD3 embeddings by running the three text encoders on seeded random token ids of the real lengths.

    For benchmarks without the tokenizers (offline): the encoders' compute and memory are real, the text is not.
    Each prompt's ids come from a generator seeded by its text, so a prompt always gets the same embedding.
    """

    def __init__(self, encoders, lengths: tuple[int, int, int], device: torch.device):
        self.encoders, self.lengths, self.device = encoders, lengths, device
        self.vocab = [e.config.vocab_size for e in encoders]

    def token_ids(self, prompt: str) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(zlib.crc32(prompt.encode()))
        return [torch.randint(0, v, (n,), generator=g) for v, n in zip(self.vocab, self.lengths)]

    def __call__(self, prompts: list[str], with_negative: bool = False):
        from gerl.sampling.loop import Embeds

        if with_negative:
            raise ValueError("RandomTokenEmbedder has no negative prompt; benchmark with guidance_scale=1.0")
        per_prompt = [self.token_ids(p) for p in prompts]
        ids = tuple(torch.stack([t[i] for t in per_prompt]).to(self.device) for i in range(3))
        return Embeds(*encode_token_ids(self.encoders, ids))

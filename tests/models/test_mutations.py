"""Each family's parity test fails against a family broken on purpose: the "broken once on purpose" checks of
docs/lab_notebook.md, kept in the suite. Every case applies one realistic bug to a family module (monkeypatched, so
the family's own code runs around it) and calls the family's ODE-parity test itself — the same function the suite
runs against the stock pipeline — expecting it to fail:

- shift: the resolution shift computed over the unpacked latent count (h·w instead of (h/2)(w/2) tokens); SD3,
  whose released schedulers do not shift by size, with the scheduler's shift ignored (1.0 instead of 3.0);
- packing: 2×2 patches packed with dy and dx swapped (pack and unpack still inverse to each other);
- guidance: FLUX.1-dev's scale not reaching its embedding; Qwen-Image's true CFG without its per-token norm
  rescale; SD3's classifier-free guidance with the conditional and unconditional branches swapped;
- text mask: Qwen-Image's padded text tokens attended (the mask dropped). SD3 and FLUX.1 pad every prompt to one
  length and pass no mask; SD3 does not pack (its transformer patchifies): those cells do not exist.
The editing families (FLUX.1-Kontext, Qwen-Image-Edit-Plus) run their text-to-image family's code with a reference
image: the same bugs, against their own parity tests. FLUX.2-klein packs without a 2×2 patch (its latents are
patchified already) and pads its text (no mask); Z-Image's transformer patchifies itself, its Turbo schedule has a
static shift, and its guidance scale is offset by one from the stock call's.
"""

from __future__ import annotations

import pytest
import torch

from gerl.models import flux as flux_mod
from gerl.models import flux2 as flux2_mod
from gerl.models import zimage as zimage_mod
from gerl.models import qwenimage as qwen_mod
from gerl.models import qwenimage_math as qm
from gerl.models import sd3 as sd3_mod
from gerl.sampling.loop import Embeds


def swapped_pack(x: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) → tokens with each patch's values ordered (C, dx, dy): the bug."""
    B, C, h, w = x.shape
    return x.reshape(B, C, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 5, 3).reshape(B, (h // 2) * (w // 2), C * 4)


def swapped_unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of `swapped_pack`."""
    B, _, D = tokens.shape
    return tokens.reshape(B, h // 2, w // 2, D // 4, 2, 2).permute(0, 3, 1, 5, 2, 4).reshape(B, D // 4, h, w)


def _sd3_shift(mp):
    real = sd3_mod.make_schedule
    mp.setattr(sd3_mod, "make_schedule", lambda config, n: real({**config, "shift": 1.0}, n))


def _sd3_guidance(mp):
    real = sd3_mod.SD3.velocity

    def swapped(self, transformer, x, t, e: Embeds, guidance):
        return real(self, transformer, x, t, Embeds(e.neg_prompt, e.neg_pooled, e.prompt, e.pooled), guidance)

    mp.setattr(sd3_mod.SD3, "velocity", swapped)


def _flux_shift(mp):
    real = flux_mod.resolution_shift
    mp.setattr(flux_mod, "resolution_shift", lambda tokens, config, default: real(4 * tokens, config, default))


def _flux_packing(mp):
    mp.setattr(flux_mod, "pack", swapped_pack)
    mp.setattr(flux_mod, "unpack", swapped_unpack)


def _flux_guidance(mp):
    real = flux_mod.Flux.velocity
    mp.setattr(flux_mod.Flux, "velocity", lambda self, tr, x, t, e, guidance: real(self, tr, x, t, e, 1.0))


def _qwen_shift(mp):
    real = qm.sigma_schedule
    mp.setattr(qm, "sigma_schedule", lambda n, tokens, config: real(n, 4 * tokens, config))


def _qwen_packing(mp):
    mp.setattr(qm, "pack_latents", swapped_pack)
    mp.setattr(qm, "unpack_latents", lambda tokens, h, w: swapped_unpack(tokens, h, w).unsqueeze(2))


def _qwen_guidance(mp):
    mp.setattr(qm, "true_cfg", lambda cond, neg, scale: neg + scale * (cond - neg))


def _qwen_mask(mp):
    real = qwen_mod._text
    mp.setattr(qwen_mod, "_text", lambda prompt, mask, dtype: (real(prompt, mask, dtype)[0], None))


def _klein_shift(mp):
    real = flux2_mod.Flux2Klein.schedule
    mp.setattr(flux2_mod.Flux2Klein, "schedule",
               lambda self, config, n, shape: real(self, config, n, (shape[0], 2 * shape[1], 2 * shape[2])))


def _klein_packing(mp):
    mp.setattr(flux2_mod, "pack", lambda x: x.transpose(2, 3).reshape(*x.shape[:2], -1).permute(0, 2, 1))
    mp.setattr(flux2_mod, "unpack", lambda t, h, w: t.permute(0, 2, 1).reshape(t.shape[0], -1, w, h).transpose(2, 3))


def _klein_guidance(mp):
    real = flux2_mod.Flux2Klein.velocity
    mp.setattr(flux2_mod.Flux2Klein, "velocity", lambda self, tr, x, t, e, g: real(self, tr, x, t, e, 1.0))


def _zimage_shift(mp):
    real = zimage_mod.ZImage.schedule
    mp.setattr(zimage_mod.ZImage, "schedule", lambda self, config, n, shape: real(self, {**config, "shift": 1.0}, n, shape))


def _zimage_guidance(mp):  # the stock scale g taken for gerl's s = 1 + g
    real = zimage_mod.ZImage.velocity
    mp.setattr(zimage_mod.ZImage, "velocity", lambda self, tr, x, t, e, g: real(self, tr, x, t, e, g + 1 if g > 1 else g))


def _zimage_mask(mp):
    mp.setattr(zimage_mod, "_rows", lambda prompt, mask, dtype: list(prompt.to(dtype).unbind(0)))


class _Pipes(dict):
    """The tiny pipelines and test images, each built the first time a case asks for it."""

    def __init__(self, tmp):
        super().__init__()
        self.tmp = tmp

    def __missing__(self, key):
        from gerl.models.tiny import build_tiny_flux, build_tiny_flux_kontext
        from gerl.models.tiny_qwen3 import build_tiny_flux2_klein, build_tiny_zimage
        from gerl.models.tiny_qwenimage import build_tiny_qwenimage, build_tiny_qwenimage_edit_plus
        from tests.models.test_flux_kontext import picture

        if key.endswith("_images"):  # the editing parity tests' image sizes
            sizes = [(96, 64), (96, 64), (80, 80)] if key == "kontext_images" else [(160, 96), (160, 96)]
            value = []
            for i, (w, h) in enumerate(sizes):
                path = self.tmp / f"{key}{i}.png"
                picture(w, h, 40 + i).save(path)
                value.append(str(path))
        else:
            value = {"flux": build_tiny_flux, "qwenimage": build_tiny_qwenimage, "kontext": build_tiny_flux_kontext,
                     "qwenimage_edit": build_tiny_qwenimage_edit_plus, "flux2": build_tiny_flux2_klein,
                     "zimage": build_tiny_zimage}[key](0)
            value.set_progress_bar_config(disable=True)
        self[key] = value
        return value


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    return _Pipes(tmp_path_factory.mktemp("mutation_images"))


def _sd3_parity(pipes, tiny_pipe):
    from tests.models.test_sd3 import test_each_sd3_generation_samples_as_the_stock_pipeline_with_cfg as parity

    parity(tiny_pipe, dict(qk_norm="rms_norm", dual_attention_layers=(0,)))  # SD3.5-Medium's layout, CFG 3


def _flux_parity(pipes, tiny_pipe):
    from tests.models.test_flux import test_ode_sampling_and_decoding_reproduce_the_stock_flux_pipeline as parity
    from tests.models.test_flux import test_ode_sampling_at_real_token_counts_reproduces_the_stock_pipeline as at

    parity(pipes["flux"], 4)  # dev, guidance 3.5, 128 px
    at(pipes["flux"], 256, 1024)  # the real 512² token count


def _qwen_parity(pipes, tiny_pipe):
    from tests.models.test_qwenimage import test_ode_sampling_and_decoding_reproduce_the_stock_pipeline as parity

    parity(pipes["qwenimage"], 4.0)  # true CFG, prompts of 8 and 14 tokens in one batch


def _kontext_parity(pipes, tiny_pipe):
    from tests.models.test_flux_kontext import test_ode_sampling_reproduces_the_stock_kontext_pipeline as parity

    parity(pipes["kontext"], pipes["kontext_images"])  # guidance 2.5, 256 px (the real 512² token count)


def _edit_parity(pipes, tiny_pipe):
    from tests.models.test_qwenimage_edit import test_ode_sampling_reproduces_the_stock_edit_pipeline as parity

    parity(pipes["qwenimage_edit"], pipes["edit_images"], 4.0)  # true CFG, 512 px, prompts of different lengths


def _klein_parity(pipes, tiny_pipe):
    from tests.models.test_flux2_zimage import test_klein_ode_sampling_reproduces_the_stock_pipeline as parity

    parity(pipes["flux2"], 4.0)  # classifier-free guidance, 256 px (1024 tokens)


def _zimage_parity(pipes, tiny_pipe):
    from tests.models.test_flux2_zimage import test_zimage_ode_sampling_reproduces_the_stock_pipeline as parity

    parity(pipes["zimage"], 3.0)  # the stock g = 3 (gerl's 4), prompts of different lengths, 256 px


CASES = {  # family/bug → (the bug, the family's parity test)
    "sd3-shift": (_sd3_shift, _sd3_parity),
    "sd3-guidance": (_sd3_guidance, _sd3_parity),
    "flux-shift": (_flux_shift, _flux_parity),
    "flux-packing": (_flux_packing, _flux_parity),
    "flux-guidance": (_flux_guidance, _flux_parity),
    "qwenimage-shift": (_qwen_shift, _qwen_parity),
    "qwenimage-packing": (_qwen_packing, _qwen_parity),
    "qwenimage-guidance": (_qwen_guidance, _qwen_parity),
    "qwenimage-mask": (_qwen_mask, _qwen_parity),
    # the editing families share their text-to-image family's code, and their parity tests see its bugs too
    "flux_kontext-shift": (_flux_shift, _kontext_parity),
    "flux_kontext-packing": (_flux_packing, _kontext_parity),
    "flux_kontext-guidance": (_flux_guidance, _kontext_parity),
    "qwenimage_edit-shift": (_qwen_shift, _edit_parity),
    "qwenimage_edit-packing": (_qwen_packing, _edit_parity),
    "qwenimage_edit-guidance": (_qwen_guidance, _edit_parity),
    "qwenimage_edit-mask": (_qwen_mask, _edit_parity),
    "flux2-shift": (_klein_shift, _klein_parity),  # FLUX.2's shift over the unpatchified count
    "flux2-packing": (_klein_packing, _klein_parity),  # tokens column by column
    "flux2-guidance": (_klein_guidance, _klein_parity),  # the scale never reaching the CFG combine
    "zimage-shift": (_zimage_shift, _zimage_parity),  # Turbo's static shift 3 ignored
    "zimage-guidance": (_zimage_guidance, _zimage_parity),  # gerl's s read as the stock g
    "zimage-mask": (_zimage_mask, _zimage_parity),  # padded caption tokens handed to the transformer
}


# The first three families' cases run in the fast tier; the newer families' (whose parity tests cost more: a VL
# encoder at 512 px, 27-layer text encoders) in the slow one.
FAST = ("sd3-", "flux-", "qwenimage-")


@pytest.mark.parametrize("case", [c if c.startswith(FAST) else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_the_family_s_parity_test_fails_against_the_bug(case, pipes, tiny_pipe, monkeypatch):
    bug, parity = CASES[case]
    bug(monkeypatch)
    with pytest.raises(AssertionError, match="not close"):  # a value mismatch, not a shape or a crash
        parity(pipes, tiny_pipe)


CONTROLS = {"sd3": _sd3_parity, "flux": _flux_parity, "qwenimage": _qwen_parity, "flux_kontext": _kontext_parity,
            "qwenimage_edit": _edit_parity, "flux2": _klein_parity, "zimage": _zimage_parity}


@pytest.mark.parametrize("family", [f if f in ("sd3", "flux", "qwenimage") else pytest.param(f, marks=pytest.mark.slow)
                                    for f in CONTROLS])
def test_the_parity_tests_pass_without_a_bug(family, pipes, tiny_pipe):
    """The control: the same calls pass on the families as they are (so a failure above is the bug's)."""
    CONTROLS[family](pipes, tiny_pipe)

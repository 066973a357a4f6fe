"""gerl.models.qwenimage_math against the stock QwenImagePipeline: each piece against the pipeline's own helpers
or a hand-worked value, and an ODE loop built only from those pieces against the pipeline's `__call__`."""

import copy

import numpy as np
import pytest
import torch

from gerl.models import qwenimage_math as qm
from gerl.models.family import calculate_shift as shared_shift
from gerl.models.tiny_qwenimage import RESOLUTION, SCHEDULER_CONFIG, build_tiny_qwenimage

PROMPTS = ["a cat", 'A sign that says "OPEN" hanging on a wooden door']  # different lengths: padding and masks
NEGATIVE = ["blurry", "bad quality, low resolution"]


@pytest.fixture(scope="module")
def pipe():
    p = build_tiny_qwenimage(0)
    p.set_progress_bar_config(disable=True)
    return p


# ------------------------------------------------------------------------------------------ prompt encoding

def test_prompt_encoding_equals_the_pipelines(pipe):
    embeds, mask = qm.encode_prompts(pipe.tokenizer, pipe.text_encoder, PROMPTS)
    ref_embeds, ref_mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=512)
    assert torch.equal(embeds, ref_embeds) and torch.equal(mask, ref_mask)
    assert mask.dtype == torch.long and mask[0].sum() < mask[1].sum() == mask.shape[1]

    one, one_mask = qm.encode_prompts(pipe.tokenizer, pipe.text_encoder, PROMPTS[:1])
    assert one_mask is None  # nothing padded: the pipeline passes no mask at all
    assert torch.equal(one, pipe.encode_prompt(PROMPTS[:1], device="cpu")[0])

    cut, cut_mask = qm.encode_prompts(pipe.tokenizer, pipe.text_encoder, PROMPTS, max_sequence_length=4)
    ref_cut, ref_cut_mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=4)
    assert cut.shape[1] == 4 and torch.equal(cut, ref_cut) and ref_cut_mask is None and cut_mask is None


def test_the_last_hidden_state_is_the_normed_output_of_the_language_model(pipe):
    tokens = pipe.tokenizer(qm.format_prompts(PROMPTS), padding=True, return_tensors="pt")
    with torch.no_grad():
        out = pipe.text_encoder(**tokens, output_hidden_states=True)
        lm = pipe.text_encoder.model.language_model(**tokens)
    torch.testing.assert_close(out.hidden_states[-1], lm.last_hidden_state, rtol=0, atol=0)


def test_select_prompt_states_by_hand():
    hidden = torch.arange(2 * 5 * 1, dtype=torch.float32).view(2, 5, 1)  # value = 5·b + position
    mask = torch.tensor([[1, 1, 1, 0, 0],    # right padded: 3 tokens
                         [0, 1, 1, 1, 1]])   # left padded: 4 tokens
    embeds, kept = qm.select_prompt_states(hidden, mask, drop_idx=1)
    assert embeds[..., 0].tolist() == [[1.0, 2.0, 0.0], [7.0, 8.0, 9.0]]
    assert kept.tolist() == [[1, 1, 0], [1, 1, 1]]


def test_joined_prompt_embeds_pad_and_mask():
    a, b = torch.ones(1, 2, 3), 2 * torch.ones(2, 4, 3)
    embeds, mask = qm.join_prompt_embeds([(a, None), (b, torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))])
    assert embeds.shape == (3, 4, 3) and embeds[0, 2:].abs().sum() == 0 and embeds[1:].eq(2).all()
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]


# ------------------------------------------------------------------------------------------ latents

def test_packing_equals_the_pipelines_and_is_inverted(pipe):
    cls = type(pipe)
    height, width = 64, 96
    h, w = qm.latent_size(height, width)
    assert (h, w) == (8, 12)
    x = torch.randn(2, 1, 16, h, w, generator=torch.Generator().manual_seed(0))
    tokens = qm.pack_latents(x)
    assert tokens.shape == (2, (h // 2) * (w // 2), 64)
    assert torch.equal(tokens, cls._pack_latents(x, 2, 16, h, w))
    assert torch.equal(qm.pack_latents(x[:, 0]), tokens)  # (B, C, h, w) packs the same way
    unpacked = qm.unpack_latents(tokens, h, w)
    assert unpacked.shape == (2, 16, 1, h, w)
    assert torch.equal(unpacked, cls._unpack_latents(tokens, height, width, qm.VAE_SCALE_FACTOR))
    assert torch.equal(unpacked[:, :, 0], x[:, 0])

    one = torch.zeros(1, 16, h, w)
    one[0, 3, 2 * 1 + 1, 2 * 2 + 0] = 1.0  # channel 3, patch row 1 / col 2, inside it dy = 1, dx = 0
    hot = qm.pack_latents(one).nonzero().tolist()
    assert hot == [[0, 1 * (w // 2) + 2, 3 * 4 + 1 * 2 + 0]]


def test_initial_noise_equals_prepare_latents(pipe):
    ref = pipe.prepare_latents(3, 16, RESOLUTION, RESOLUTION, torch.float32, "cpu",
                               torch.Generator().manual_seed(7))
    ours = qm.initial_noise(3, RESOLUTION, RESOLUTION, torch.Generator().manual_seed(7))
    assert torch.equal(ours, ref)
    assert qm.img_shapes(3, RESOLUTION, RESOLUTION) == [[(1, 8, 8)]] * 3


# ------------------------------------------------------------------------------------------ σ schedule

def test_calculate_shift_equals_the_pipelines():
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    for n in (64, 1024, 4096, 6000):
        assert shared_shift(n) == calculate_shift(n)  # the one line every family's shift uses
        assert qm.mu_for(n, SCHEDULER_CONFIG) == calculate_shift(n, 256, 8192, 0.5, 0.9)
    # By hand: at 1024² (4096 tokens) mu = 0.5 + 3840 · 0.4 / 7936, i.e. SD3's static shift of e^mu ≈ 2.
    assert qm.mu_for(4096, SCHEDULER_CONFIG) == pytest.approx(0.5 + 3840 * 0.4 / 7936, abs=1e-12)
    assert np.exp(qm.mu_for(4096, SCHEDULER_CONFIG)) == pytest.approx(2.0008, abs=1e-4)
    assert qm.mu_for(64, {}) == calculate_shift(64)  # a config without the keys: the pipeline's fallbacks


@pytest.mark.parametrize("steps", [2, 3, 10, 50])
@pytest.mark.parametrize("seq_len", [64, 1024, 4096, 6000])
def test_sigma_schedule_equals_the_schedulers_bit_for_bit(pipe, steps, seq_len):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

    scheduler = copy.deepcopy(pipe.scheduler)
    c = scheduler.config  # mu as QwenImagePipeline.__call__ computes it
    mu = calculate_shift(seq_len, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    timesteps, _ = retrieve_timesteps(scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    sigmas = qm.sigma_schedule(steps, seq_len, scheduler.config)
    assert sigmas.dtype == torch.float32 and torch.equal(sigmas, scheduler.sigmas)
    assert torch.equal(sigmas[:-1] * 1000, timesteps)
    assert torch.equal(qm.transformer_timestep(sigmas[:-1]), timesteps / 1000)

    # Against the formula in float64: SD3's shift with shift = e^mu, then stretched so the last σ is 0.02.
    t = np.linspace(1.0, 1 / steps, steps)
    s = np.exp(mu) * t / (np.exp(mu) * t + 1 - t)
    s = 1 - (1 - s) * (1 - 0.02) / (1 - s[-1])
    np.testing.assert_allclose(sigmas[:-1].double().numpy(), s, rtol=0, atol=1e-6)
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0 and sigmas[-2].item() == pytest.approx(0.02, abs=1e-6)


def test_sigma_schedule_refuses_what_the_stock_scheduler_gets_wrong_or_qwen_image_does_not_use(pipe):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import retrieve_timesteps

    scheduler = copy.deepcopy(pipe.scheduler)
    with np.errstate(invalid="ignore"):
        retrieve_timesteps(scheduler, 1, "cpu", sigmas=np.linspace(1.0, 1.0, 1), mu=0.5)
    assert scheduler.sigmas[0].isnan()  # one step with shift_terminal: 1 − 0/0
    with pytest.raises(ValueError, match="at least 2 steps"):
        qm.sigma_schedule(1, 64, SCHEDULER_CONFIG)
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        qm.sigma_schedule(4, 64, dict(SCHEDULER_CONFIG, use_karras_sigmas=True))


# ------------------------------------------------------------------------------------------ CFG and Euler

def test_true_cfg_rescales_each_token_to_the_conditional_norm():
    cond = torch.tensor([[[3.0, 4.0], [1.0, 0.0]]])    # two tokens, norms 5 and 1
    uncond = torch.tensor([[[0.0, 0.0], [0.0, 1.0]]])
    out = qm.true_cfg(cond, uncond, 3.0)
    # token 0: comb = 3·(3, 4) = (9, 12), norm 15 → (3, 4); token 1: comb = (0, 1) + 3·(1, −1) = (3, −2), norm √13
    expected = torch.tensor([[[3.0, 4.0], [3.0 / 13 ** 0.5, -2.0 / 13 ** 0.5]]])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_euler_step_equals_the_schedulers(pipe):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import retrieve_timesteps

    scheduler = copy.deepcopy(pipe.scheduler)
    timesteps, _ = retrieve_timesteps(scheduler, 4, "cpu", sigmas=np.linspace(1.0, 0.25, 4), mu=0.7)
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 16, 64, generator=g), torch.randn(2, 16, 64, generator=g)
    scheduler.set_begin_index(0)
    for i, t in enumerate(timesteps):
        ref = scheduler.step(v, t, x, return_dict=False)[0]
        assert torch.equal(qm.euler_step(x, v, scheduler.sigmas[i], scheduler.sigmas[i + 1]), ref)
        x = ref


# ------------------------------------------------------------------------------------------ the whole loop

def _ode_sample(pipe, prompts, negative, latents, steps, true_cfg_scale, batched_cfg=False):
    """A plain Euler ODE loop from the pure pieces: encode, σ schedule, velocity (+ true CFG), step, decode."""
    embeds, mask = qm.encode_prompts(pipe.tokenizer, pipe.text_encoder, prompts)
    use_cfg = true_cfg_scale > 1 and negative is not None
    if use_cfg:
        neg_embeds, neg_mask = qm.encode_prompts(pipe.tokenizer, pipe.text_encoder, negative)
        if batched_cfg:  # both velocities in one call: padded to one length, masked
            joined, joined_mask = qm.join_prompt_embeds([(embeds, mask), (neg_embeds, neg_mask)])
    batch = latents.shape[0]
    sigmas = qm.sigma_schedule(steps, latents.shape[1], pipe.scheduler.config)
    shapes = qm.img_shapes(batch, RESOLUTION, RESOLUTION)

    def velocity(x, t, text, text_mask):
        return pipe.transformer(hidden_states=x, timestep=t.expand(x.shape[0]), encoder_hidden_states=text,
                                encoder_hidden_states_mask=text_mask, img_shapes=shapes * (x.shape[0] // batch),
                                return_dict=False)[0]

    x = latents
    with torch.no_grad():
        for i in range(steps):
            t = qm.transformer_timestep(sigmas[i])
            if use_cfg and batched_cfg:
                cond, uncond = velocity(torch.cat([x, x]), t, joined, joined_mask).chunk(2)
                v = qm.true_cfg(cond, uncond, true_cfg_scale)
            elif use_cfg:
                v = qm.true_cfg(velocity(x, t, embeds, mask), velocity(x, t, neg_embeds, neg_mask), true_cfg_scale)
            else:
                v = velocity(x, t, embeds, mask)
            x = qm.euler_step(x, v, sigmas[i], sigmas[i + 1])
    return x, qm.to_unit_range(qm.decode_latents(pipe.vae, x, RESOLUTION, RESOLUTION))


@pytest.mark.parametrize("true_cfg_scale,batched_cfg", [(1.0, False), (4.0, False), (4.0, True)],
                         ids=["no_cfg", "true_cfg", "true_cfg_one_call"])
def test_an_ode_loop_from_the_pieces_equals_the_stock_call(pipe, true_cfg_scale, batched_cfg):
    steps = 4
    latents = qm.initial_noise(len(PROMPTS), RESOLUTION, RESOLUTION, torch.Generator().manual_seed(11))
    negative = NEGATIVE if true_cfg_scale > 1 else None
    ours_latent, ours_image = _ode_sample(pipe, PROMPTS, negative, latents, steps, true_cfg_scale, batched_cfg)

    common = dict(prompt=PROMPTS, negative_prompt=negative, true_cfg_scale=true_cfg_scale, height=RESOLUTION,
                  width=RESOLUTION, num_inference_steps=steps, latents=latents.clone())
    ref_latent = pipe(output_type="latent", **common).images
    ref_image = pipe(output_type="pt", **common).images
    assert (ref_latent - latents).abs().max() > 0.1, "the loop must move the latents for this to mean anything"
    # Separate calls reproduce the stock path operation for operation (measured: bit-equal); the one-call batch
    # pads the shorter prompt, which changes only the float summation order (measured: 1.2e-6).
    torch.testing.assert_close(ours_latent, ref_latent, rtol=0, atol=1e-5 if batched_cfg else 1e-6)
    torch.testing.assert_close(ours_image, ref_image, rtol=0, atol=1e-5)

"""gerl plan for FLUX.1 and Qwen-Image against the CPU allocator, and their published sizes on the meta device.

The models: each family's published configs (assets/configs/flux.1-dev, qwen-image) with the transformer cut to a
few blocks and narrowed to 2 heads at the real head width (128: the RoPE's axes), the text width 256, at 128 px
(a 16 × 16 latent: 64 packed tokens). What is checked, each on the trainer's or the rollout's own code on real CPU
tensors against the plan's phase, within the SD3 checks' bound (tests/test_plan_algorithms.py):
- the actor's whole Flow-GRPO update under each family's recipe — FLUX.1-dev's guidance embedding, Qwen-Image's
  true CFG, whose second pass (the negative prompt) runs with grad in training too — with checkpointing off and on;
- the rollout's denoising (`denoise`, recorded SDE steps, Qwen-Image's two passes per step);
- Qwen-Image's 5-D VAE decode (gerl.workers.rollout.decode) while the micro-batch's conditioning and trajectory are
  held.
The measure is tests/plan_allocator.py's (the allocator's running sum less the GEMM and attention kernels' own
scratch).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gerl.config import load_config
from gerl.models import arch
from gerl.models.loader import DTYPES, add_lora
from gerl.plan import plan_for_config
from gerl.plan.arch import module_from_config
from gerl.plan.edit import PICTURE_TOKENS, VISION_TOKENS
from gerl.plan.qwenimage import NEGATIVE_TOKENS
from gerl.sampling.loop import Embeds, Schedule, Trajectory, denoise
from gerl.workers.actor import ActorWorker
from gerl.workers.batch import RolloutBatch
from tests.plan_allocator import KERNELS, existing_bytes, scratch_free_peak

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"flux": str(REPO / "recipes" / "flow_grpo_flux_ocr.yaml"),
           "qwenimage": str(REPO / "recipes" / "flow_grpo_qwenimage_ocr.yaml"),
           "flux_kontext": str(REPO / "recipes" / "flow_grpo_flux_kontext_edit.yaml"),
           "qwenimage_edit": str(REPO / "recipes" / "flow_grpo_qwenimage_edit.yaml"),
           "flux2": str(REPO / "recipes" / "flow_grpo_flux2_klein_ocr.yaml"),
           "zimage": str(REPO / "recipes" / "flow_grpo_zimage_turbo_ocr.yaml")}
# the editing families: their text-to-image family's narrowed configs, their pipeline class in model_index.json
EDIT_BASE = {"flux_kontext": ("flux", "FluxKontextPipeline"), "qwenimage_edit": ("qwenimage", "QwenImageEditPlusPipeline")}
COND_RES = 128  # the editing families' reference: 128² px → 16 × 16 latents → 64 tokens, as many as the image's
RES, TEXT, WIDTH, POOLED = 128, 8, 256, 64  # px; prompt tokens (T5 / Qwen); text width; FLUX's pooled width
LATENT = (16, RES // 8, RES // 8)
# FLUX.2-klein and Z-Image publish no configs here: their tiny models' (gerl/models/tiny_qwen3.py, whose VAEs are 4×)
# stand in, written by the stock save_pretrained; text widths 3 × 16 and 32
QWEN3_FAMILIES = {"flux2": ((128, RES // 8, RES // 8), 48), "zimage": ((16, RES // 4, RES // 4), 32)}


def _latent(name: str) -> tuple[int, int, int]:
    return QWEN3_FAMILIES[name][0] if name in QWEN3_FAMILIES else LATENT
B = 2  # images per step: one optimizer step of two training micro-batches
BOUND = 0.02  # |planned − measured| / measured, as for SD3
# + the CPU's mixed-dtype add: peft adds the fp32 LoRA delta to the bf16 base output, and the CPU casts the bf16
# operand into an fp32 temporary first (a (1, 64, 256) add: 64 KiB allocated and freed inside the call, 10 % of the
# checkpointed phase here) where CUDA's TensorIterator casts as it loads
SCRATCH = KERNELS | {"aten::add"}
ROLLOUT = ("sampling.num_steps=4", "model.dtype=fp32", "model.vae_dtype=fp32")  # the rollout checks: 3 recorded steps, fp32


def _narrow(family: str) -> dict[str, dict]:
    """Changes to the published configs: fewer blocks, 2 heads, narrow text encoders and VAE."""
    if family == "flux":
        clip = dict(num_hidden_layers=1, max_position_embeddings=16, vocab_size=256, hidden_size=POOLED,
                    intermediate_size=128, num_attention_heads=2, projection_dim=POOLED)
        return {"transformer": dict(num_layers=1, num_single_layers=1, num_attention_heads=2,
                                    joint_attention_dim=WIDTH, pooled_projection_dim=POOLED),
                "vae": dict(block_out_channels=[32, 32, 32, 32], layers_per_block=1, norm_num_groups=8),
                "text_encoder": clip,
                "text_encoder_2": dict(num_layers=1, vocab_size=256, d_model=WIDTH, d_ff=512, num_heads=4, d_kv=64)}
    ids = {k: 255 - i for i, k in enumerate(("bos_token_id", "eos_token_id", "image_token_id", "video_token_id",
                                              "vision_start_token_id", "vision_end_token_id", "vision_token_id"))}
    text = dict(hidden_size=WIDTH, intermediate_size=512, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=256, layer_types=["full_attention"], **ids,
                rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"})
    published = arch.load_config("qwen-image", "text_encoder")
    vision = dict(published["vision_config"], depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                  out_hidden_size=WIDTH, fullatt_block_indexes=[0])
    return {"transformer": dict(num_layers=2, num_attention_heads=2, joint_attention_dim=WIDTH),
            "vae": dict(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
            "text_encoder": dict(text, text_config=dict(published["text_config"], **text), vision_config=vision)}


@pytest.fixture(scope="module", params=["flux", "qwenimage", pytest.param("flux_kontext", marks=pytest.mark.slow),
                                        pytest.param("qwenimage_edit", marks=pytest.mark.slow),
                                        pytest.param("flux2", marks=pytest.mark.slow),
                                        pytest.param("zimage", marks=pytest.mark.slow)])
def family(request, tmp_path_factory):
    name = request.param
    path = tmp_path_factory.mktemp(f"{name}_narrow")
    if name in QWEN3_FAMILIES:
        from gerl.models.family import families

        families()[name].build_tiny(0, "").save_pretrained(str(path))
        return name, path
    base, pipeline = EDIT_BASE.get(name, (name, None))
    folder = {"flux": "flux.1-dev", "qwenimage": "qwen-image"}[base]
    for c, change in _narrow(base).items():
        (path / c).mkdir()
        (path / c / "config.json").write_text(json.dumps(dict(arch.load_config(folder, c), **change)))
    if pipeline:
        (path / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    return name, path


def _config(family, checkpointing: bool, *extra: str):
    name, path = family
    over = ["engine.kind=ray", "engine.device=cuda", "engine.hybrid=false", "engine.actor_workers=1",
            "engine.rollout_workers=1", f"model.path={path}", f"model.gradient_checkpointing={checkpointing}",
            f"model.resolution={RES}", f"model.max_sequence_length={TEXT}", "data.prompts_per_step=1",
            f"data.group_size={B}", f"sampling.micro_batch_size={B}", "train.micro_batch_size=1",
            f"train.mini_batch_size={B}", "sampling.sde_window_size=0", "model.lora_rank=4", "model.lora_alpha=8",
            f"model.condition_resolution={COND_RES}", *extra]
    return load_config(RECIPES[name], over)


_PLANS: dict = {}


def _plan(family, *extra: str):
    """The plan of the narrowed model under the recipe (checkpointing as configured: off), counted once per
    module; both checkpointing settings are in it."""
    key = (family[0], str(family[1]), extra)
    if key not in _PLANS:
        _PLANS[key] = plan_for_config(_config(family, False, *extra), card=None)
    return _PLANS[key]


def _module(family, component: str, dtype: torch.dtype, cfg=None) -> torch.nn.Module:
    """A real component of the narrowed configs on the CPU, seeded, in `dtype`; with cfg, the recipe's adapter."""
    torch.manual_seed(0)
    m = module_from_config(component, json.loads((family[1] / component / "config.json").read_text()))
    with torch.no_grad():
        for t in [*m.parameters(), *m.buffers()]:
            if t.is_floating_point():
                t.normal_(0, 0.02)
    m = m.requires_grad_(False).to(dtype).eval()
    if cfg is not None:
        add_lora(m, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_targets, seed=0)
    return m


def _embeds(name: str, b: int, dtype: torch.dtype, g: torch.Generator) -> Embeds:
    """Cached text embeddings as the plan holds them: FLUX T5 tokens and CLIP's pooled vector; Qwen-Image the
    prompts' tokens and the negative prompt's (true CFG), no mask (none padded). The editing families: the same and
    a COND_RES² reference's 64 tokens; Qwen-Image-Edit-Plus's prompts carry the condition image's 196 tokens and its
    6 markers (gerl/plan/edit.py)."""
    def text(n, width=WIDTH):
        return torch.randn(b, n, width, generator=g).to(dtype)
    base = EDIT_BASE.get(name, (name,))[0]
    if name in QWEN3_FAMILIES:  # klein's prompts padded to TEXT, Z-Image's at TEXT (none padded); no pooled vector
        width = QWEN3_FAMILIES[name][1]
        return Embeds(text(TEXT, width), None, text(TEXT, width))
    if base == "flux":
        e = Embeds(text(TEXT), torch.randn(b, POOLED, generator=g).to(dtype))
    elif name == "qwenimage_edit":
        extra = VISION_TOKENS + PICTURE_TOKENS
        e = Embeds(text(TEXT + extra), None, text(NEGATIVE_TOKENS + extra))
    else:
        e = Embeds(text(TEXT), None, text(NEGATIVE_TOKENS))
    if name in EDIT_BASE:
        side = COND_RES // 8
        e.cond = torch.randn(b, (side // 2) ** 2, 64, generator=g).to(dtype)
        e.cond_hw = torch.tensor([[side, side]] * b)
    return e


@pytest.mark.parametrize("checkpointing", [False, True])
def test_actor_peak_matches_the_cpu_allocator(family, checkpointing):
    """The actor's planned peak, less the weights and adapter that exist before it starts, against a real ActorWorker
    run for two updates of one optimizer step over two micro-batches (the second in the steady state: AdamW state,
    the first micro-batch's gradients and the recipe's EMA alive), one recorded SDE step per sample."""
    name, _ = family
    if name in EDIT_BASE and not checkpointing:  # the suite's time: the checkpointed run holds the same reference
        pytest.skip("the editing families' actor is checked with checkpointing on (their reference tokens count alike)")
    cfg = _config(family, checkpointing)
    actor = _plan(family).role("actor")
    top = max(actor.phases_with(checkpointing), key=lambda p: p.gib)
    assert top.name.startswith("training") and top.checkpointing is checkpointing
    dtype = DTYPES[cfg.model.dtype]
    tf = _module(family, "transformer", dtype, cfg)
    existing = existing_bytes(tf)
    assert existing == pytest.approx(sum(i.gib for i in actor.resident[:2]) * 2**30, rel=1e-6)
    g = torch.Generator().manual_seed(1)
    sigmas = torch.linspace(1, 0, cfg.sampling.num_steps + 1)
    x = torch.randn(B, 1, *_latent(name), generator=g)
    batch = RolloutBatch(prompts=["a"] * B, metadata=[{}] * B, group_ids=torch.zeros(B, dtype=torch.long),
                         embeds=_embeds(name, B, dtype, g), schedule=Schedule(sigmas, sigmas[:-1] * 1000),
                         traj=Trajectory(x, x + 0.01 * torch.randn(x.shape, generator=g), torch.zeros(B, 1),
                                         torch.tensor([2]), x[:, 0]), images=[None] * B, policy_version=0)
    metrics = []

    def run():
        worker = ActorWorker(tf, cfg.train, cfg.model, cfg.sampling, max_steps=2, images_per_step=B, seed=0,
                             conventions=cfg.conventions, algo=cfg.algo)
        metrics.extend(worker.update(batch, torch.tensor([1.0, -1.0]), step=s) for s in range(2))

    measured, raw = scratch_free_peak(run, SCRATCH)
    assert [m["optimizer_steps"] for m in metrics] == [1, 1]
    cuda_only = sum(i.gib for i in actor.resident if i.name.startswith("cuBLAS workspace")) * 2**30  # no CPU twin
    assert cuda_only == 2 * 32 * 2**20  # a training host: the forward's thread and autograd's backward thread
    predicted = actor.peak_gib_with(checkpointing) * 2**30 - existing - cuda_only
    assert abs(predicted - measured) / measured < BOUND, (predicted / 2**20, measured / 2**20, raw / 2**20)


def test_denoising_matches_the_cpu_allocator(family):
    """The rollout's denoising phase against gerl.sampling.loop.denoise run for real over a 4-step schedule on a
    micro-batch of 2 with 3 recorded SDE steps, the recipe's guidance (FLUX.1-dev's embedding: one pass; Qwen-Image's
    true CFG: a second pass per step on the negative prompt), the conditioning and the initial noise made inside as
    the rollout makes them on the device; the recorded steps' SDE noise, drawn on the host, added by hand. fp32, as
    the SD3 check (the CPU's bf16 elementwise kernels take scratch of their own)."""
    name, _ = family
    cfg = _config(family, False, *ROLLOUT)
    (phase,) = [p for p in _plan(family, *ROLLOUT).role("rollout").phases if p.name.startswith("denoising forward")]
    tf = _module(family, "transformer", torch.float32, cfg).eval()
    smp = cfg.sampling
    recorded = list(range(smp.num_steps - 1))
    sigmas = torch.linspace(1, 0, smp.num_steps + 1)

    def run():
        g = torch.Generator().manual_seed(2)
        noise = torch.randn(B, *_latent(name), generator=g)
        gens = [torch.Generator().manual_seed(i) for i in range(B)]
        denoise(tf, _embeds(name, B, torch.float32, g), noise, Schedule(sigmas, sigmas[:-1] * 1000), recorded,
                smp.sampler, smp.noise_level, smp.guidance_scale, gens)

    measured, raw = scratch_free_peak(run, SCRATCH)
    predicted = phase.gib * 2**30 + B * len(recorded) * torch.Size(_latent(name)).numel() * 4
    assert abs(predicted - measured) / measured < BOUND, (predicted / 2**20, measured / 2**20, raw / 2**20)


def test_qwenimage_vae_decode_matches_the_cpu_allocator(family):
    """Qwen-Image's 5-D VAE (causal 3-D convolutions, one frame) decoding a micro-batch of 2 through the rollout's own
    `decode` (fp32: model.vae_dtype=fp32, as a CPU run keeps it), while the micro-batch's conditioning and its
    recorded trajectory are held, as `generate` holds them, against the plan's VAE decode phase."""
    from gerl.models.qwenimage import QwenImage
    from gerl.workers.rollout import decode

    name, _ = family
    if name != "qwenimage":
        pytest.skip("FLUX.1's VAE is SD3's class (AutoencoderKL); the editing families decode as theirs")
    cfg = _config(family, False, *ROLLOUT)
    (phase,) = [p for p in _plan(family, *ROLLOUT).role("rollout").phases if p.name.startswith("VAE decode")]
    vae = _module(family, "vae", torch.float32)
    recorded = cfg.sampling.num_steps - 1

    def run():
        g = torch.Generator().manual_seed(3)
        held = _embeds(name, B, torch.float32, g), [torch.empty(B, recorded, *LATENT) for _ in range(2)]  # noqa: F841
        decode(vae, torch.randn(B, *LATENT, generator=g), QwenImage())

    # + oneDNN's convolution workspace (2 MiB here), which the plan leaves out as it leaves cuDNN's (docs/plan.md)
    measured, raw = scratch_free_peak(run, SCRATCH | {"aten::mkldnn_convolution"})
    assert measured > 1 * 2**20
    assert abs(phase.gib * 2**30 - measured) / measured < BOUND, (phase.gib * 2**10, measured / 2**20, raw / 2**20)


# Parameter counts as published (the Hub's safetensors metadata of each repository, as other tools quote them:
# FLUX.1-dev's transformer 23,802,816,640 bytes in bf16), not from gerl's own builders.
PUBLISHED = {
    "black-forest-labs/FLUX.1-dev": {"transformer": 11_901_408_320, "vae": 83_819_683, "text_encoder": 123_060_480,
                                     "text_encoder_2": 4_762_310_656},
    # no guidance embedding: 10,229,760 fewer (a 256 → 3072 → 3072 MLP)
    "black-forest-labs/FLUX.1-schnell": {"transformer": 11_891_178_560, "vae": 83_819_683,
                                         "text_encoder": 123_060_480, "text_encoder_2": 4_762_310_656},
    # the text encoder is Qwen2.5-VL-7B-Instruct whole: language model, vision tower and LM head
    "Qwen/Qwen-Image": {"transformer": 20_430_401_088, "vae": 126_892_531, "text_encoder": 8_292_166_656},
}


def _lora_by_hand(r: int, inner: int, ff: int, double_blocks: int, single_blocks: int) -> int:
    """A rank-r adapter's parameters, r·(in + out) per adapted Linear, on the recipes' targets: in each double-stream
    block eight inner × inner attention projections (q, k, v, out of both streams) and both streams' feed-forward
    (inner → ff → inner); in each FLUX single-stream block q, k and v only."""
    per_double = 8 * r * 2 * inner + 4 * r * (inner + ff)
    return double_blocks * per_double + single_blocks * 3 * r * 2 * inner


@pytest.mark.parametrize("path", list(PUBLISHED))
def test_full_size_components_have_the_published_parameter_counts(path):
    """Each component a rollout loads, built on the meta device from the shipped configs as the plan builds it, in
    the dtype the loader gives it on a GPU (bf16, the VAE's by model.vae_dtype=auto): the published parameter counts,
    and the plan's
    resident weight lines their bytes. The recipes' LoRA (r64 on the family's default targets) by hand: FLUX.1 19
    double + 38 single blocks, Qwen-Image 60 double blocks, width 3072, feed-forward 12288."""
    from gerl.config import ModelConfig
    from gerl.models.family import families
    from gerl.plan.family import family_for
    from gerl.plan.planner import vae_dtype
    from gerl.plan.work import resident_items

    name = "qwenimage" if "Qwen" in path else "flux"
    cfg = load_config(RECIPES[name], [f"model.path={path}"])
    fam = family_for(ModelConfig(path=path))
    comps = fam.components("rollout")
    assert fam.components("actor") == ("transformer",) and set(comps) == set(PUBLISHED[path])
    assert vae_dtype(cfg) == torch.bfloat16
    modules = {c: fam.build(c, vae_dtype(cfg) if c == "vae" else torch.bfloat16) for c in comps}
    counts = {c: sum(p.numel() for p in m.parameters()) for c, m in modules.items()}
    assert counts == PUBLISHED[path]
    assert {c: next(m.parameters()).dtype for c, m in modules.items()} == dict.fromkeys(comps, torch.bfloat16)
    add_lora(modules["transformer"], 64, 128, list(families()[name].lora_targets))
    trained = [p for p in modules["transformer"].parameters() if p.requires_grad]
    blocks = (60, 0) if name == "qwenimage" else (19, 38)
    assert sum(p.numel() for p in trained) == _lora_by_hand(64, 3072, 12288, *blocks)
    lines = resident_items(cfg, fam, modules, trained, trained)
    for c in comps:
        weights = lines[c][0]
        assert weights.name.startswith(fam.label(c)) and "weights" in weights.name
        size = 2
        # + buffers: CLIP's 77 int64 position ids (616 bytes)
        assert weights.gib * 2**30 == pytest.approx(PUBLISHED[path][c] * size, abs=1024), c

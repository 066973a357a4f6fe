"""Pretrain **ocr-mini**: a small SD3-architecture model that draws the quoted number of its prompt, imperfectly.

    python scripts/pretrain_ocr_mini.py --out assets/models/ocr-mini --threads 2  # the shipped model (~10 min, 2 cores)
    python scripts/pretrain_ocr_mini.py --out /tmp/m --steps 20 --vae-steps 20     # a short run (tests)

Everything is made here, offline and seeded: the data are 2-digit numbers drawn with Pillow's bundled font
(`ImageFont.load_default`, the same on every machine) in 64×64 grey images at a jittered position and size; the
VAE (`AutoencoderKL`, 4× down-sampling to 16×16×16 latents) is trained first, then the `SD3Transformer2DModel`
with the rectified-flow objective of SD3 (x_t = (1 − σ)·x0 + σ·ε, target ε − x0, σ logit-normal). The text encoders
and tokenizers are the tiny offline ones of `gerl.models.tiny` (random, frozen): the transformer learns to read
their character embeddings. Two settings keep it from memorising each number through a token that acts as a hash of
the whole prompt, which made the first models draw unseen numbers with the wrong digits:
- the pooled-text projection (`time_text_embed.text_embedder`) is fixed at zero: the pooled CLIP vector is read off
  a causal encoder's last token (held-out OCR 0.28 with it, 0.50 without, 1,800 steps);
- the text encoders' self-attention outputs are fixed at zero (`--text-context token`, the default): a random
  encoder's attention mixes the whole prompt into the closing quote, end-of-text and padding tokens (and every T5
  token); zeroed, each token's embedding depends on that token and its position only (held-out 0.50 → 0.91 at
  1,800 steps, a base with no room left for RL; hence 1,000 steps by default: about 0.5, see docs/lab_notebook.md).
The floating-point sums, and so the weights, depend on the number of torch threads: the shipped model used 2.
The result is a diffusers directory that `StableDiffusion3Pipeline.from_pretrained` loads and that
`model.path=ocr-mini` selects.

Held-out numbers (`DEV` and the sealed `TEST`) never occur in the pretraining data nor in the RL training prompts;
the script writes `assets/ocr_mini/{train,dev,test}.txt` prompt files when `--write-prompts` is given, and a model
card with the base OCR scores (rapidocr, recognition only, ODE sampling) on the training and dev numbers (the test
numbers are scored only by the final evaluations, never here).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESOLUTION = 64
SHIFT = 3.0  # the flow-matching scheduler's shift, used for training σ and saved with the scheduler
TEMPLATE = 'a sign that says "{}"'
# Two sets of 16 of the 100 two-digit strings, spread over first and last digits so that every digit is still seen
# in training, are never drawn here nor used as RL training prompts. DEV is for every choice (recipes validate on
# it; it was the earlier models' only held-out set, so every setting so far was tuned on it); TEST is sealed: only
# the final tables evaluate on it (fresh noise, with a standard error), never a choice.
DEV = ["07", "13", "20", "26", "31", "38", "44", "49", "52", "58", "65", "71", "76", "83", "89", "94"]
TEST = ["03", "10", "16", "22", "29", "34", "41", "47", "50", "56", "62", "69", "78", "85", "91", "98"]
HELD_OUT = DEV + TEST
TRAIN = [f"{i:02d}" for i in range(100) if f"{i:02d}" not in HELD_OUT]


def render(text: str, rng: random.Random) -> Image.Image:
    """`text` in black on white, 64×64 RGB, font size 27–29 px, position jittered by up to ±3 px around the centre."""
    font = ImageFont.load_default(size=rng.randint(27, 29))
    img = Image.new("RGB", (RESOLUTION, RESOLUTION), "white")
    draw = ImageDraw.Draw(img)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    x = (RESOLUTION - (right - left)) / 2 - left + rng.uniform(-3, 3)
    y = (RESOLUTION - (bottom - top)) / 2 - top + rng.uniform(-3, 3)
    draw.text((x, y), text, fill="black", font=font)
    return img


def to_tensor(images: list[Image.Image]) -> torch.Tensor:
    """PIL images → (B, 3, H, W) in [−1, 1]."""
    a = np.stack([np.asarray(im, dtype=np.float32) for im in images]) / 127.5 - 1.0
    return torch.from_numpy(a).permute(0, 3, 1, 2).contiguous()


def build_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 32), layers_per_block=1, latent_channels=16, norm_num_groups=8,
        sample_size=RESOLUTION, use_quant_conv=False, use_post_quant_conv=False,
    )


def build_transformer():
    from diffusers import SD3Transformer2DModel

    from gerl.models.tiny import CLIP_PROJ, T5_WIDTH

    return SD3Transformer2DModel(
        sample_size=RESOLUTION // 4, patch_size=2, in_channels=16, out_channels=16, num_layers=4,
        attention_head_dim=32, num_attention_heads=4, joint_attention_dim=T5_WIDTH, caption_projection_dim=128,
        pooled_projection_dim=2 * CLIP_PROJ, pos_embed_max_size=16,
    )


@torch.no_grad()
def context_free_text_encoders(tiny) -> None:
    """Zero the self-attention output projections of the three text encoders: a token's embedding then depends on
    that token and (CLIP's absolute) position only. The random encoders otherwise mix the whole prompt into every
    token after the first digit (the closing quote, end-of-text and padding, and every T5 token), so each number
    has tokens that act as its hash, and the transformer memorises numbers through them instead of composing digits."""
    for enc in (tiny.text_encoder, tiny.text_encoder_2):
        for layer in enc.text_model.encoder.layers:
            torch.nn.init.zeros_(layer.self_attn.out_proj.weight)
            torch.nn.init.zeros_(layer.self_attn.out_proj.bias)
    for block in tiny.text_encoder_3.encoder.block:
        torch.nn.init.zeros_(block.layer[0].SelfAttention.o.weight)


def train_vae(vae, steps: int, batch: int, rng: random.Random, log) -> None:
    """Reconstruction (L1 + MSE) with a small KL weight: the latents must stay close to a unit Gaussian's scale."""
    opt = torch.optim.AdamW(vae.parameters(), lr=1e-3, weight_decay=0.0)
    vae.train()
    for step in range(1, steps + 1):
        x = to_tensor([render(rng.choice(TRAIN), rng) for _ in range(batch)])
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample()).sample
        kl = post.kl().mean() / post.mean[0].numel()
        loss = F.l1_loss(rec, x) + F.mse_loss(rec, x) + 1e-4 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps:
            log(f"vae step {step}/{steps}: loss {loss.item():.4f} (kl {kl.item():.3f})")
    vae.eval()


@torch.no_grad()
def encode_dataset(vae, variants: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """`variants` jittered renderings of every training number → latent means and stds (N, 16, 16, 16), labels."""
    labels = [i for i in range(len(TRAIN)) for _ in range(variants)]
    means, stds = [], []
    for start in range(0, len(labels), 256):
        x = to_tensor([render(TRAIN[i], rng) for i in labels[start:start + 256]])
        d = vae.encode(x).latent_dist
        means.append(d.mean)
        stds.append(d.std)
    return torch.cat(means), torch.cat(stds), labels


def train_transformer(transformer, latents, latent_std, labels, embeds, steps, batch, lr, seed, log,
                      caption_dropout: float = 0.0, caption_noise: float = 0.0) -> None:
    """SD3's rectified flow: x_t = (1 − σ) x0 + σ ε, predict v = ε − x0; σ ~ logit-normal(0, 1) shifted by the
    sampler's shift (σ ← sσ / (1 + (s − 1)σ), s = 3) as SD3 does, so training spends its effort on the high-noise
    steps where sampling decides which digits appear (a first try without the shift drew digit-like glyphs of the
    wrong identity: OCR 0.05). With `caption_dropout` > 0 that fraction of the batch is conditioned on the empty
    prompt (the last row of `embeds`, what the pipeline encodes as its negative prompt), so that classifier-free
    guidance has an unconditional model to push away from. With `caption_noise` > 0 that fraction of the batch is
    conditioned on the caption of a random training number instead of its own (mismatched captions, as in web
    alt-text): the model then draws the right number only part of the time, whatever the number."""
    g, g_drop = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    g_noise = torch.Generator().manual_seed(seed + 2)
    n_captions = int(max(labels)) + 1
    prompt_embeds, pooled = embeds
    opt = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * (0.5 * (1 + math.cos(math.pi * min(s / max(steps, 1), 1.0))) * 0.9 + 0.1))
    transformer.train()
    labels_t = torch.tensor(labels)
    for step in range(1, steps + 1):
        idx = torch.randint(len(labels), (batch,), generator=g)
        x0 = latents[idx] + latent_std[idx] * torch.randn(latents[idx].shape, generator=g)
        eps = torch.randn(x0.shape, generator=g)
        u = torch.sigmoid(torch.randn(batch, generator=g))
        sigma = SHIFT * u / (1 + (SHIFT - 1) * u)
        s = sigma.view(-1, 1, 1, 1)
        xt = (1 - s) * x0 + s * eps
        lab = labels_t[idx]
        if caption_noise > 0:  # its own generator, like the dropout's
            wrong = torch.randint(n_captions, (batch,), generator=g_noise)
            lab = torch.where(torch.rand(batch, generator=g_noise) < caption_noise, wrong, lab)
        if caption_dropout > 0:  # its own generator: the data and noise draws stay those of a run without dropout
            lab = torch.where(torch.rand(batch, generator=g_drop) < caption_dropout, len(prompt_embeds) - 1, lab)
        v = transformer(hidden_states=xt, timestep=sigma * 1000, encoder_hidden_states=prompt_embeds[lab],
                        pooled_projections=pooled[lab], return_dict=False)[0]
        loss = F.mse_loss(v, eps - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps:
            log(f"transformer step {step}/{steps}: loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}")
    transformer.eval()


def ocr_scores(pipe, numbers: list[str], seed: int, num_steps: int) -> dict:
    """Mean OCR reward (rapidocr, recognition only) of one ODE sample per number, and the exact-match rate."""
    from gerl.config import SamplingConfig
    from gerl.models.loader import TextEmbedder
    from gerl.workers.rollout import RolloutWorker
    from rewards.ocr import OcrReward

    worker = RolloutWorker(pipe, TextEmbedder(pipe, 32), SamplingConfig(micro_batch_size=16), RESOLUTION, seed)
    prompts = [TEMPLATE.format(n) for n in numbers]
    images = worker.sample_images(prompts, seed, num_steps, 1.0)
    scores, _ = OcrReward(rec_only=True)(images, prompts, [{} for _ in prompts])
    return {"mean": float(np.mean(scores)), "exact": float(np.mean([s == 1.0 for s in scores])), "n": len(scores)}


def write_model_card(out: Path, card: dict) -> None:
    """README.md beside the weights: what the model is, its data, the command that made it, its base OCR scores."""
    a = card["args"]
    pooled = a.get("pooled", "use")  # cards written before --pooled existed trained the projection
    context = a.get("text_context", "full")  # ... and before --text-context kept the encoders' attention
    cmd = (f"python scripts/pretrain_ocr_mini.py --out {a['out']} --steps {a['steps']} --batch {a['batch']} "
           f"--lr {a['lr']} --vae-steps {a['vae_steps']} --variants {a['variants']} --seed {a['seed']} "
           f"--pooled {pooled} --text-context {context} --threads {a['threads']}"
           + (f" --caption-dropout {a['caption_dropout']}" if a.get("caption_dropout") else "")
           + (f" --caption-noise {a['caption_noise']}" if a.get("caption_noise") else ""))
    score = lambda k: (f"{card[k]['mean']:.3f} (exact match {card[k]['exact']:.2f}, {card[k]['n']} numbers)"  # noqa: E731
                       if k in card else "not measured (--eval-steps 0)")
    conditioning = ("the pooled-text projection is fixed at zero (`--pooled zero`), so the digits are read from the "
                    "token sequence through joint attention, which lets unseen pairs compose from seen digits."
                    if pooled == "zero" else
                    "the pooled-text projection is trained (`--pooled use`), which lets the model memorise each number.")
    conditioning += (" The text encoders' self-attention outputs are fixed at zero (`--text-context token`): each "
                     "token's embedding depends on that token and its position only, so no token carries a hash of "
                     "the whole number." if context == "token" else
                     " The random text encoders keep their attention (`--text-context full`): every token after the "
                     "first digit carries a hash of the whole number.")
    if a.get("caption_dropout"):
        conditioning += (f" {a['caption_dropout']:.0%} of the training samples saw the empty prompt instead "
                         "(`--caption-dropout`), so classifier-free guidance works (negative prompt \"\").")
    if a.get("caption_noise"):
        conditioning += (f" {a['caption_noise']:.0%} of the training samples were conditioned on the caption of a "
                         "random training number instead of their own (`--caption-noise`), as web captions often do "
                         "not match their image: the model draws the number it is asked for only part of the time, "
                         "and otherwise some other number.")
    (out / "README.md").write_text(f"""# ocr-mini

A 2.3M-parameter Stable Diffusion 3 architecture (`SD3Transformer2DModel`: 4 joint blocks, 4 heads × 32, patch 2,
16×16×16 latents; a 0.25M-parameter `AutoencoderKL` with 4× down-sampling; the tiny offline CLIP-L/CLIP-G/T5 text
encoders and tokenizers of `gerl.models.tiny`, random and frozen) that draws the 2-digit number quoted in a prompt
such as `{TEMPLATE.format("42")}` as a 64×64 grey image — imperfectly, so that RL with the OCR reward has room to
improve it. Loads with stock `StableDiffusion3Pipeline.from_pretrained`; in gerl, `model.path=ocr-mini`.
It was trained with 32 T5 tokens: call the stock pipeline with `max_sequence_length=32`. Its default, 256, adds
224 padding tokens the model never saw, and the drawings suffer (held-out OCR of the shipped model, 8 images per
number, 20 steps, `gerl eval` seed 1234: 0.54 at 32 tokens, 0.35 at 256; the first, full-context model drew no
legible digits at 256). gerl passes `model.max_sequence_length` (32 in the recipes).

- **Data**: the {len(TRAIN)} two-digit strings not held out, drawn by Pillow's bundled font at 27–29 px, position
  jittered by ±3 px, {a['variants']} renderings each. Held out (never seen here, nor in the RL training prompts):
  dev {", ".join(DEV)} (`assets/ocr_mini/dev.txt`, for every choice) and the sealed test
  {", ".join(TEST)} (`assets/ocr_mini/test.txt`, only for final evaluations).
- **Conditioning**: {conditioning}
- **Training**: VAE {a['vae_steps']} steps of batch 32 (L1 + MSE + 1e-4·KL); latents normalised by the fitted
  shift {card['shift']:.4f} and scale {card['scale']:.4f}; transformer {a['steps']} steps of batch {a['batch']},
  rectified flow with logit-normal σ shifted by 3, AdamW lr {a['lr']} (warm-up 100, cosine to 10 %), seed {a['seed']}.
  {card['seconds'] / 60:.0f} minutes on CPU with {a['threads'] or "torch's default number of"} thread(s) (torch {card["torch"]}; wall
  time depends on what else the machine runs).
- **Command**: `{cmd}`
- **Base OCR reward** (rapidocr, recognition only, one {a['eval_steps']}-step ODE sample per number, noise seed 1234):
  training numbers {score('ocr_train_numbers')}; dev numbers {score('ocr_dev')}. (The sealed test numbers are
  not scored here: see the README's evaluation.)
""")


def write_prompts(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, numbers in (("train", TRAIN), ("dev", DEV), ("test", TEST)):
        (directory / f"{name}.txt").write_text("".join(TEMPLATE.format(n) + "\n" for n in numbers))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="output diffusers directory (replaced if it exists)")
    ap.add_argument("--steps", type=int, default=1000, help="transformer training steps")
    ap.add_argument("--batch", type=int, default=64, help="transformer batch size")
    ap.add_argument("--lr", type=float, default=1e-3, help="transformer peak learning rate (warm-up 100, cosine to 10%)")
    ap.add_argument("--vae-steps", type=int, default=300, help="VAE training steps (batch 32)")
    ap.add_argument("--variants", type=int, default=48, help="jittered renderings per training number")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--eval-steps", type=int, default=20, help="ODE steps of the OCR evaluation (0 = skip it)")
    ap.add_argument("--pooled", choices=("zero", "use"), default="zero",
                    help="zero (default): the pooled-text projection is fixed at zero, so the transformer must read the "
                         "digits from the token sequence; use: train it (the model then memorises each number)")
    ap.add_argument("--text-context", choices=("full", "token"), default="token",
                    help="token (default, the shipped model): fix the random text encoders' self-attention outputs at "
                         "zero, so each token's embedding depends on that token and its position only (composes unseen "
                         "numbers far better); full: keep their attention, so every token after the first digit "
                         "carries a hash of the whole number (the first shipped models; docs/lab_notebook.md)")
    ap.add_argument("--caption-dropout", type=float, default=0.0,
                    help="fraction of training samples conditioned on the empty prompt, so that the model also learns "
                         "the unconditional velocity that classifier-free guidance needs (default 0: no guidance)")
    ap.add_argument("--caption-noise", type=float, default=0.0,
                    help="fraction of training samples conditioned on a random training number's caption instead of "
                         "their own, so the model draws the number it is asked for only part of the time")
    ap.add_argument("--write-prompts", default="", help="also write train.txt/dev.txt/test.txt prompt files to this directory")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.vae_steps < 1 or args.batch < 1 or args.variants < 1:
        print("pretrain_ocr_mini: --steps, --vae-steps, --batch and --variants must be ≥ 1", file=sys.stderr)
        return 2
    if not 0.0 <= args.caption_dropout < 1.0:
        print(f"pretrain_ocr_mini: --caption-dropout {args.caption_dropout} must be in [0, 1) (e.g. 0.1)",
              file=sys.stderr)
        return 2
    if not 0.0 <= args.caption_noise < 1.0:
        print(f"pretrain_ocr_mini: --caption-noise {args.caption_noise} must be in [0, 1) (e.g. 0.4)", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from gerl.models.tiny import build_tiny_sd3

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    tiny = build_tiny_sd3(args.seed)  # its tokenizers and frozen random text encoders
    vae = build_vae()
    log(f"VAE: {sum(p.numel() for p in vae.parameters()) / 1e6:.2f}M parameters")
    train_vae(vae, args.vae_steps, 32, rng, log)
    means, stds, labels = encode_dataset(vae, args.variants, rng)
    # SD3 normalises latents as (z − shift) · scale; fit both to the data so x0 has zero mean and unit std.
    shift, scale = float(means.mean()), float(1.0 / (means.std() + 1e-6))
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    latents, latent_std = (means - shift) * scale, stds * scale
    log(f"latents {tuple(latents.shape)}: shift {shift:.4f}, scale {scale:.4f}")

    transformer = build_transformer()
    if args.pooled == "zero":
        proj = transformer.time_text_embed.text_embedder.linear_2
        torch.nn.init.zeros_(proj.weight)
        torch.nn.init.zeros_(proj.bias)
        proj.requires_grad_(False)
    if args.text_context == "token":
        context_free_text_encoders(tiny)
    log(f"transformer: {sum(p.numel() for p in transformer.parameters()) / 1e6:.2f}M parameters")
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT), vae=vae,
        text_encoder=tiny.text_encoder, tokenizer=tiny.tokenizer, text_encoder_2=tiny.text_encoder_2,
        tokenizer_2=tiny.tokenizer_2, text_encoder_3=tiny.text_encoder_3, tokenizer_3=tiny.tokenizer_3,
    )
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        texts = [TEMPLATE.format(n) for n in TRAIN] + ([""] if args.caption_dropout else [])  # "" = the null prompt
        embeds, _, pooled, _ = pipe.encode_prompt(prompt=texts, prompt_2=None, prompt_3=None,
                                                  do_classifier_free_guidance=False, max_sequence_length=32)
    train_transformer(transformer, latents, latent_std, labels, (embeds, pooled), args.steps, args.batch, args.lr,
                      args.seed, log, args.caption_dropout, args.caption_noise)
    for m in (transformer, vae):
        m.requires_grad_(False)

    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    pipe.save_pretrained(str(tmp), safe_serialization=True)
    card = {"seconds": round(time.perf_counter() - t_start, 1), "args": vars(args), "torch": torch.__version__,
            "shift": shift, "scale": scale}
    if args.eval_steps:
        card["ocr_train_numbers"] = ocr_scores(pipe, TRAIN, 1234, args.eval_steps)
        card["ocr_dev"] = ocr_scores(pipe, DEV, 1234, args.eval_steps)
        log(f"OCR (rapidocr rec-only, {args.eval_steps}-step ODE): train numbers {card['ocr_train_numbers']}, "
            f"dev {card['ocr_dev']}")
    (tmp / "pretrain.json").write_text(json.dumps(card, indent=1) + "\n")
    # what `gerl sample`/`gerl eval --model ocr-mini` use by default: the recipes' resolution, tokens and eval steps
    (tmp / "gerl_settings.json").write_text(json.dumps(
        {"resolution": RESOLUTION, "max_sequence_length": 32, "num_steps": 20, "guidance": 1.0}) + "\n")
    write_model_card(tmp, card)
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
    if args.write_prompts:
        write_prompts(Path(args.write_prompts))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""RolloutWorker: turns prompts into a trajectory batch — denoise micro-batch by micro-batch, decode, submit rewards."""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from PIL import Image

from gerl.config import SamplingConfig
from gerl.data.prompts import condition_images
from gerl.models.family import family_of
from gerl.models.vae import to_uint8
from gerl.sampling.loop import Embeds, Schedule, Trajectory, denoise, sde_window
from gerl.workers.batch import RolloutBatch


def sample_seed(seed: int, step: int, index: int) -> int:
    """A distinct, reproducible noise seed for sample `index` of step `step` (independent of batch splitting)."""
    return (seed * 1_000_003 + step * 65_537 + index) % (2**63 - 1)


def latent_noise(seeds: list[int], shape: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Generator]]:
    """Initial noise (B, *shape) drawn per sample on the CPU, and each sample's generator, positioned after it,
    for that sample's SDE noise. Matches diffusers' randn_tensor with a list of generators."""
    gens = [torch.Generator("cpu").manual_seed(s) for s in seeds]
    noise = torch.stack([torch.randn(shape, generator=g, dtype=torch.float32) for g in gens])
    return noise, gens


def group_latent_noise(seeds: list[int], group_seeds: list[int], shape: tuple[int, ...]
                       ) -> tuple[torch.Tensor, list[torch.Generator]]:
    """`init_same_noise`: sample i starts from the initial noise of its group's seed (shared by the whole group),
    and its SDE noise comes from its own seed, so the images of a group differ only by the SDE window's noise."""
    noise, _ = latent_noise(group_seeds, shape)
    return noise, [torch.Generator("cpu").manual_seed(s) for s in seeds]


def group_seed(seed: int, step: int, group_id: int) -> int:
    """The initial-noise seed of group `group_id` of step `step` (group ids are unique within a step)."""
    return sample_seed(seed, step, -2 - group_id)


@torch.no_grad()
def decode(vae, latents: torch.Tensor, family) -> list[Image.Image]:
    """Canonical latents (B, C, h, w) → PIL images through the model family's VAE decoding (`family.decode`: SD3's
    scaling and shift factors, Qwen-Image's per-channel statistics and video VAE, ...), in the VAE's own dtype and memory format (model.vae_dtype, as the loader prepared
    it: bf16 and channels_last on CUDA, fp32 on a CPU; gerl/models/vae.py). Never fp16: its decoder overflows to
    NaN there, and a NaN image would become a black image scoring ~0 without a word — so a non-finite decode is
    reported on stderr."""
    x = family.decode(vae, latents).float()
    bad = int((~torch.isfinite(x.flatten(1))).any(1).sum())
    if bad:
        print(f"gerl: warning: the VAE decoded {bad} of {len(x)} images with NaN/inf values (VAE dtype {vae.dtype}); "
              "they become black images and score as such", file=sys.stderr)
    x = to_uint8(x).cpu().numpy()
    return [Image.fromarray(np.ascontiguousarray(a)) for a in x]


class RolloutWorker:
    """Generates trajectory batches with the current weights of `pipe.transformer`. One role: generation."""

    def __init__(self, pipe, embedder, sampling: SamplingConfig, resolution: int, seed: int, record_sde: bool = True,
                 reference_guidance: float = 1.0):
        self.pipe, self.embedder, self.cfg = pipe, embedder, sampling
        self.record_sde = record_sde  # False: ODE everywhere, only the clean final latents kept (nft, awm, dgpo)
        # the guidance a training forward applies to the batch's embeddings besides the rollout's own (dgpo's
        # guided base reference): its negative embeddings are recorded even when the rollout does not guide
        self.reference_guidance = reference_guidance
        self.seed = seed
        self.family = family_of(pipe)  # latent layout, σ schedule, decoding (the velocity: predict_velocity)
        self.latent_shape = self.family.latent_shape(pipe, resolution)
        self.train_schedule = self.family.schedule(pipe.scheduler.config, sampling.num_steps, self.latent_shape)
        self.policy_version = 0

    @property
    def device(self) -> torch.device:
        return self.pipe.transformer.device

    def generate(self, prompts: list[str], metadata: list[dict], group_ids: torch.Tensor, step: int,
                 submit=None, index_offset: int = 0, between=None) -> RolloutBatch:
        """Sample one step's batch. `submit(images, prompts, metadata) -> Future` is called per decoded micro-batch
        (reward futures); when None, rewards are left to the caller. `index_offset` is this shard's first sample
        index in the whole step, so noise seeds (and images) do not depend on how the step is sharded.
        `between()` runs before each micro-batch (staged weights are loaded there, never mid micro-batch); the
        batch's policy_version is the oldest version any of its micro-batches was generated with. Every tensor of
        the returned batch is on the CPU."""
        cfg, sched = self.cfg, self.train_schedule
        window_rng = torch.Generator().manual_seed(sample_seed(self.seed, step, -1))
        sde_steps = (sde_window(sched.num_steps, cfg.sde_window_size, tuple(cfg.sde_window_range), window_rng)
                     if self.record_sde else [])
        guided = self.family.uses_negative(max(cfg.guidance_scale, self.reference_guidance))
        trajs, images, futures, embeds_all, spans, versions = [], [], [], [], [], []
        t_gen = t_dec = 0.0
        self.pipe.transformer.eval()
        for start in range(0, len(prompts), cfg.micro_batch_size):
            sl = slice(start, start + cfg.micro_batch_size)
            if between is not None:
                between()
            versions.append(self.policy_version)
            t0 = time.perf_counter()
            embeds = self.embedder(prompts[sl], with_negative=guided, images=condition_images(metadata[sl]))
            seeds = [sample_seed(self.seed, step, index_offset + i)
                     for i in range(sl.start, min(sl.stop, len(prompts)))]
            if cfg.init_same_noise:
                gids = group_ids[sl].tolist()
                noise, gens = group_latent_noise(seeds, [group_seed(self.seed, step, g) for g in gids],
                                                 self.latent_shape)
            else:
                noise, gens = latent_noise(seeds, self.latent_shape)
            traj = denoise(self.pipe.transformer, embeds, noise.to(self.device), sched, sde_steps, cfg.sampler,
                           cfg.noise_level, cfg.guidance_scale, gens, frozenset(cfg.reuse_velocity_steps))
            if traj.final_latents.is_cuda:
                torch.cuda.synchronize()  # CUDA is asynchronous: without this, denoising time lands in decode_s
            t1 = time.perf_counter()
            mb_images = decode(self.pipe.vae, traj.final_latents, self.family)
            t2 = time.perf_counter()
            t_dec += t2 - t1
            t_gen += t1 - t0
            wall = time.time() - t2  # perf_counter → epoch offset, for the timeline
            spans += [{"name": f"generate mb{len(trajs)}", "start": t0 + wall, "end": t1 + wall},
                      {"name": f"decode mb{len(trajs)}", "start": t1 + wall, "end": t2 + wall}]
            if submit is not None:
                futures.append((sl, submit(mb_images, prompts[sl], metadata[sl])))
            # The batch is kept on the CPU: it crosses Ray to the actor (a pickled CUDA tensor would be restored
            # on the receiver's cuda:0), and the actor moves each training micro-batch to its own device.
            trajs.append(traj.cpu())
            images.extend(mb_images)
            embeds_all.append(embeds.to("cpu"))
        return RolloutBatch(
            prompts=list(prompts), metadata=list(metadata), group_ids=group_ids, embeds=Embeds.cat(embeds_all),
            schedule=sched, traj=Trajectory.cat(trajs), images=images,
            policy_version=min(versions, default=self.policy_version),
            reward_futures=futures, timings={"generate_s": t_gen, "decode_s": t_dec}, spans=spans,
        )

    @torch.no_grad()
    def sample_images(self, prompts: list[str], seed: int, num_steps: int, guidance: float,
                      micro_batch_size: int | None = None, images: list | None = None) -> list[Image.Image]:
        """ODE sampling for validation / `gerl sample` / `gerl eval`: image i uses noise seed (seed, i). images: each
        prompt's conditioning image path (an image-editing family), or None."""
        sched: Schedule = self.family.schedule(self.pipe.scheduler.config, num_steps, self.latent_shape)
        mb = micro_batch_size or self.cfg.micro_batch_size
        out = []
        self.pipe.transformer.eval()
        for start in range(0, len(prompts), mb):
            chunk = prompts[start:start + mb]
            noise, _ = latent_noise([sample_seed(seed, 0, start + i) for i in range(len(chunk))], self.latent_shape)
            embeds = self.embedder(chunk, with_negative=self.family.uses_negative(guidance),
                                   images=None if images is None else images[start:start + mb])
            traj = denoise(self.pipe.transformer, embeds, noise.to(self.device), sched, [], self.cfg.sampler,
                           self.cfg.noise_level, guidance, None)
            out.extend(decode(self.pipe.vae, traj.final_latents, self.family))
        return out

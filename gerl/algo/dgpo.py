"""Direct Group Preference Optimization (DGPO; Luo, Hu, Tang, "Reinforcing Diffusion Models by Direct Group
Preference Optimization", ICLR 2026; github.com/Luo-Yihong/DGPO, scripts/train_sd3_dgpo.py).

Like NFT and AWM, DGPO trains on the clean final latents x0 of a plain ODE rollout, noised again at a noise level σ
of the sampling schedule: x_σ = (1 − σ)·x0 + σ·ε, flow-matching target ε − x0. Per training point of sample i,

    e_i     = mean((v_θ(x_σ) − (ε − x0_i))²)          the policy's flow-matching error (the reference's dsm_loss)
    e_ref_i = the same error of the reference's velocity (the frozen base, or the anchor: `algo.dgpo_reference`)

A group g of samples of one prompt is split by the sign of the advantage into a positive set G+ = {A > 0} and a
negative set G− = {A < 0} (A = 0: in neither), each sample weighted by |A_i| / n_g. With the implicit reward of a
sample R(x) = −β·(e − e_ref) (a flow-matching error below the reference's is a likelihood above it) and
R(G) = Σ_{x∈G} (|A(x)| / n_g)·R(x), DGPO maximises log σ(R(G+) − R(G−)). Since R(G+) − R(G−) = −S_g with

    S_g = (β / n_g) · Σ_{i∈g} A_i · (e_i − e_ref_i)                    (`group_margins`)

the loss is −log σ(−S_g) = softplus(S_g), whose gradient is σ(S_g)·(β/n_g)·Σ A_i ∇e_i. The reference trains the
surrogate whose gradient is that without the factor β/n_g (β only sharpens the sigmoid):

    L = mean_i  sg(σ(S_{g(i)})) · A_i · e_i                           (`dgpo_loss`)

so a group whose positive samples already sit below the reference's error and negative ones above it (S_g ≪ 0) is
nearly done (σ → 0), and a group the policy ranks the wrong way round gets the full weight (σ → 1). Group-mean-
normalised advantages sum to zero in a group, so both sets carry the same total weight.

PPO-style clip (the reference's clip_dsm): with e_old the error of the anchor ("old" policy) at the same point and
ratio = exp(e_old − e), a point with A > 0 and ratio > 1 + ε, or A ≤ 0 and ratio < 1 − ε, has moved far enough:
its e_i is detached (no gradient) but still counts in S_g (`dgpo_clip`).
"""

from __future__ import annotations

import torch


def flow_matching_error(v: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """mean((v − (ε − x0))²) per sample, (B,), in fp64 (a margin multiplies error differences by β ≈ 10²–10³, and
    the clip compares them with ε down to 1e-5). v, x0, noise: (B, C, h, w)."""
    d = v.double() - (noise.double() - x0.double())
    return (d * d).mean(dim=tuple(range(1, d.ndim)))


def group_margins(err: torch.Tensor, ref_err: torch.Tensor, advantages: torch.Tensor, groups: torch.Tensor,
                  beta: float) -> torch.Tensor:
    """S of each sample's group, (B,): S_g = (β / n_g)·Σ_{i∈g} A_i·(e_i − e_ref_i), no gradient.

    Args:
        err, ref_err: (B,) the policy's and the reference's flow-matching errors at the same points.
        advantages: (B,) already clipped; groups: (B,) long group ids; every member of a group must be present
            (n_g counts them: data.group_size unless rewards were dropped).
        beta: DGPO's β (> 0).
    """
    term = (advantages.double() * (err.detach().double() - ref_err.detach().double())) * beta
    _, inv, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=term.dtype, device=term.device).index_add_(0, inv, term)
    return (sums / counts.to(term))[inv]


def dgpo_clip(err: torch.Tensor, old_err: torch.Tensor, advantages: torch.Tensor,
              clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio, clipped), each (B,): ratio = exp(e_old − e), clipped where A > 0 and ratio > 1 + ε or A ≤ 0 and
    ratio < 1 − ε (the point has already moved that far from the old policy in the advantage's direction)."""
    ratio = torch.exp(old_err.detach().double() - err.detach().double())
    clipped = torch.where(advantages > 0, ratio > 1 + clip_range, ratio < 1 - clip_range)
    return ratio, clipped


def dgpo_loss(err: torch.Tensor, margin: torch.Tensor, advantages: torch.Tensor, clipped: torch.Tensor | None = None,
              weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The reference's surrogate mean_i sg(σ(S_i))·A_i·e_i (see the module docstring).

    Args:
        err: (B,) the policy's flow-matching errors (with grad); margin: (B,) S of each sample's group
            (`group_margins`); advantages: (B,) already clipped.
        clipped: (B,) bool or None: those points' errors are detached (`dgpo_clip`).
        weight: (B,) each sample's weight in the mean (a stale group's < 1), or None for 1.
    Returns:
        (scalar loss, detached stats: policy_loss, dgpo_weight_mean = mean σ(S), margin_mean)
    """
    if clipped is not None:
        err = torch.where(clipped, err.detach(), err)
    w = torch.sigmoid(margin.detach().double())
    per_sample = w * advantages.double() * err
    if weight is not None:
        per_sample = per_sample * weight.double()
    loss = per_sample.mean()
    stats = {"policy_loss": loss.detach(), "dgpo_weight_mean": w.mean(), "margin_mean": margin.detach().mean()}
    return loss.float(), stats

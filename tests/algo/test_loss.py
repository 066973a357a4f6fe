"""The clipped GRPO loss: values, gradient directions, clipping, the KL term — and one real actor update that
moves each sample's log-prob the way its advantage says."""

import pytest
import torch

from gerl.algo.loss import grpo_loss
from gerl.config import ModelConfig, SamplingConfig, TrainConfig
from gerl.sampling.loop import replay_log_prob
from gerl.workers.actor import ActorWorker

ADV = torch.tensor([1.5, -0.5, 0.0, -2.0])


def test_ratio_one_loss_is_minus_mean_advantage():
    lp = torch.tensor([-1.0, -2.0, 0.3, 4.0])
    loss, stats = grpo_loss(lp, lp.clone(), ADV, clip_range=0.2)
    assert loss.item() == pytest.approx(-ADV.mean().item())
    assert stats["ratio_mean"].item() == pytest.approx(1.0)
    assert stats["clipfrac"].item() == 0 and stats["kl"].item() == 0 and stats["approx_kl"].item() == 0


def test_gradient_raises_the_log_prob_of_positive_advantages():
    lp = torch.tensor([-1.0, -2.0, 0.3, 4.0], requires_grad=True)
    loss, _ = grpo_loss(lp, lp.detach().clone(), ADV, clip_range=0.2)
    loss.backward()
    # At ratio 1: d loss / d log_prob_i = −A_i / B — gradient descent moves log_prob_i along +A_i.
    torch.testing.assert_close(lp.grad, -ADV / len(ADV))
    assert lp.grad[0] < 0 and lp.grad[1] > 0 and lp.grad[2] == 0


@pytest.mark.parametrize(
    "log_ratio,adv,value,grad",
    [  # ε = 0.2; e^0.5 = 1.648721, e^−0.5 = 0.606531, e^0.05 = 1.051271
        (0.5, 1.0, -1.2, 0.0),  # ratio > 1 + ε, A > 0: already pushed up enough: −A·1.2, no gradient
        (-0.5, -1.0, 0.8, 0.0),  # ratio < 1 − ε, A < 0: already pushed down enough: −A·0.8, no gradient
        (0.5, -1.0, 1.648721, 1.648721),  # ratio > 1 + ε, A < 0: the pessimistic (unclipped) −A·r pulls it back
        (-0.5, 1.0, -0.606531, -0.606531),  # ratio < 1 − ε, A > 0: likewise
        (0.05, 1.0, -1.051271, -1.051271),  # inside the trust region: −A·r
    ],
)
def test_clipping(log_ratio, adv, value, grad):
    old = torch.tensor([-1.0])
    lp = (old + log_ratio).requires_grad_(True)
    loss, stats = grpo_loss(lp, old, torch.tensor([adv]), clip_range=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(value, rel=1e-5)
    assert lp.grad.item() == pytest.approx(grad, rel=1e-5)
    assert stats["clipfrac"].item() == (1.0 if abs(log_ratio) > 0.2 else 0.0)


def test_ratio_cap_bounds_a_stale_ratio():
    # A stale batch's ratio e (> 1 + ε) with A < 0 stays on the unclipped branch: the cap truncates it there.
    old, adv = torch.tensor([-1.0]), torch.tensor([-1.0])
    lp = (old + 1.0).requires_grad_(True)
    loss, _ = grpo_loss(lp, old, adv, clip_range=0.2, ratio_cap=2.0)
    loss.backward()
    assert loss.item() == pytest.approx(2.0) and lp.grad.item() == 0
    lp.grad = None
    uncapped, _ = grpo_loss(lp, old, adv, clip_range=0.2)
    uncapped.backward()
    assert uncapped.item() == pytest.approx(torch.e) and lp.grad.item() == pytest.approx(torch.e)


def test_kl_term_is_the_gaussian_kl_to_the_reference():
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(3, 4, 5, 5, generator=g, requires_grad=True)
    ref = torch.randn(3, 4, 5, 5, generator=g)
    std = torch.tensor([0.1, 0.3, 0.05]).view(3, 1, 1, 1)
    lp = torch.zeros(3)
    beta = 0.25
    loss, stats = grpo_loss(lp, lp, ADV[:3], 0.2, beta, mean, ref, std)
    expected = (((mean - ref) ** 2) / (2 * std**2)).mean(dim=(1, 2, 3)).mean()
    true_kl = torch.distributions.kl_divergence(torch.distributions.Normal(mean, std),
                                                torch.distributions.Normal(ref, std)).mean(dim=(1, 2, 3)).mean()
    torch.testing.assert_close(stats["kl"], expected.detach())
    torch.testing.assert_close(stats["kl"], true_kl.detach(), rtol=1e-5, atol=1e-6)
    assert loss.item() == pytest.approx(stats["policy_loss"].item() + beta * stats["kl"].item(), rel=1e-6)
    loss.backward()
    assert torch.all(mean.grad * (mean - ref).detach() >= 0), "the KL gradient pulls the mean towards the reference"
    same, stats_same = grpo_loss(lp, lp, ADV[:3], 0.2, beta, ref.clone(), ref, std)
    assert stats_same["kl"].item() == 0 and same.item() == pytest.approx(stats_same["policy_loss"].item())


# ------------------------------------------------------------------ end to end: one actor update

PROMPTS = ["a red cat", "a red cat", "hello 42", "hello 42"]


def _log_probs(transformer, batch, cfg):
    """(B,) mean over the recorded steps of each sample's replayed log-prob."""
    traj = batch.traj
    B, K = traj.log_probs.shape
    with torch.no_grad():
        lps = [replay_log_prob(transformer, traj.latents[:, k], traj.next_latents[:, k],
                               traj.step_indices[k].expand(B), batch.embeds, batch.schedule, cfg.sampler,
                               cfg.noise_level, cfg.guidance_scale).log_prob for k in range(K)]
    return torch.stack(lps, 1).mean(1)


@pytest.mark.parametrize("sampler,lr", [("sde", 1e-2), ("cps", 3e-5)])  # CPS log-probs are far more lr-sensitive
def test_actor_update_moves_log_probs_with_the_advantage(make_rollout, lora_transformer, sampler, lr):
    tr = lora_transformer()
    cfg = SamplingConfig(sampler=sampler, num_steps=4, noise_level=0.7, sde_window_size=0, micro_batch_size=4)
    batch = make_rollout(cfg, tr).generate(PROMPTS, [{}] * 4, torch.tensor([0, 0, 1, 1]), step=1)
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    before = _log_probs(tr, batch, cfg)
    torch.testing.assert_close(before, batch.traj.log_probs.mean(1), rtol=0, atol=1e-5)
    train = TrainConfig(learning_rate=lr, micro_batch_size=2, clip_range=1e-4, max_grad_norm=1.0)
    actor = ActorWorker(tr, train, ModelConfig(lora=True), cfg, max_steps=1, images_per_step=4, seed=0)
    actor.update(batch, adv, step=1)
    change = _log_probs(tr, batch, cfg) - before
    assert torch.all(change[adv > 0] > 0), f"positive-advantage log-probs must rise: {change.tolist()}"
    assert torch.all(change[adv < 0] < 0), f"negative-advantage log-probs must fall: {change.tolist()}"


def test_actor_kl_reference_is_the_base_model(make_rollout, lora_transformer):
    # With LoRA the reference policy is the adapter switched off: a fresh adapter (B = 0) gives KL 0 exactly,
    # a non-trivial one a positive KL.
    cfg = SamplingConfig(sampler="sde", num_steps=4, noise_level=0.7, sde_window_size=0, micro_batch_size=4)
    train = TrainConfig(learning_rate=1e-6, micro_batch_size=4, beta=0.1)
    kls = []
    for tr in (lora_transformer(), lora_transformer(randomize=True)):
        batch = make_rollout(cfg, tr).generate(PROMPTS, [{}] * 4, torch.tensor([0, 0, 1, 1]), step=1)
        actor = ActorWorker(tr, train, ModelConfig(lora=True), cfg, max_steps=1, images_per_step=4, seed=0)
        kls.append(actor.update(batch, ADV, step=1)["kl"])
        assert actor.named_params and all("lora_" in n for n, _ in actor.named_params), "only the adapter trains"
    assert kls[0] == 0 and kls[1] > 0

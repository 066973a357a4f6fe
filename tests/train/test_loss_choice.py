"""train.loss and its options reach the actor: a real (tiny) training run calls the configured objective of
gerl/algo/policy_loss.py with the configured options and the batch's rewards, and the logged loss is that
objective's."""

import json

from gerl.algo import policy_loss
from gerl.trainer import train
from tests.train.helpers import small_config


# All 8 images in one optimizer step: every micro-batch is trained on-policy (r = 1) and holds whole groups.
ONE_UPDATE = ("train.mini_batch_size=8", "train.micro_batch_size=8")


def _spy(monkeypatch) -> list[tuple[str, dict, bool]]:
    """Wrap every registered objective; each call appends (name, options, whether rewards were passed)."""
    calls = []
    for name, fn in list(policy_loss.POLICY_LOSSES.items()):
        def spy(lp, old, adv, rewards=None, *, _name=name, _fn=fn, **options):
            calls.append((_name, options, rewards is not None and rewards.shape == adv.shape))
            return _fn(lp, old, adv, rewards, **options)
        monkeypatch.setitem(policy_loss.POLICY_LOSSES, name, spy)
    return calls


def _first_step(run_dir) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])


def test_the_actor_trains_with_the_configured_loss(tmp_path, monkeypatch):
    calls = _spy(monkeypatch)
    policy = {}
    for loss, extra in (("ppo_clip", []), ("topr", ["train.topr_split=reward"])):
        calls.clear()
        train(small_config(tmp_path / loss, "max_steps=1", f"train.loss={loss}", *extra, *ONE_UPDATE))
        assert calls and {name for name, _, _ in calls} == {loss}, f"train.loss={loss} but the actor called {calls}"
        assert all(with_rewards for _, _, with_rewards in calls), "the actor must pass the batch's rewards"
        policy[loss] = _first_step(tmp_path / loss)["policy_loss"]
    assert all(opts["topr_split"] == "reward" for name, opts, _ in calls)
    # Step 1 is the same rollout in both runs (same seed, same initial weights), trained in one step (r = 1):
    # ppo_clip's loss is then −mean(A), 0 for group-normalised advantages; topr's is −mean(w·A·log π), which is
    # not, since log π differs between the images of a group (measured: ppo_clip 1.3e-6, topr 1.8e-4).
    assert abs(policy["ppo_clip"]) < 1e-5
    assert abs(policy["topr"]) > 5e-5 and abs(policy["topr"]) > 20 * abs(policy["ppo_clip"]), policy

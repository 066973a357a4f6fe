"""Reward plug-ins. Importing this package registers the built-in rewards (their models load lazily).

    from rewards import build_reward, call_reward
    reward = build_reward("ocr", {"num_threads": 1})
    scores, extras = call_reward(reward, images, prompts, metadata)
"""

from rewards.registry import (
    ENTRY_POINT_GROUP,
    RewardFn,
    build_reward,
    call_reward,
    is_reward_factory,
    register,
    registered_names,
    reward_factory,
    validate_reward_inputs,
)
from rewards import delayed, edit, jpeg, ocr, packaged, preference, vlm  # noqa: E402,F401  (registers the built-in rewards)

__all__ = [
    "ENTRY_POINT_GROUP",
    "RewardFn",
    "build_reward",
    "call_reward",
    "is_reward_factory",
    "register",
    "registered_names",
    "reward_factory",
    "validate_reward_inputs",
]

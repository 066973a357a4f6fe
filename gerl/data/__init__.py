"""Prompt datasets (.txt / .jsonl) and the seeded, resumable per-step prompt sampler."""

from gerl.data.prompts import Prompt, PromptSampler, load_prompts

__all__ = ["Prompt", "PromptSampler", "load_prompts"]

"""DAPO's reward-side filters: dynamic sampling keeps only groups whose rewards differ, and the soft
overlong punishment lowers the reward of answers that run into the generation budget (arXiv 2503.14476).
"""

from __future__ import annotations


def is_informative_group(rewards: list[float]) -> bool:
    """False when every answer of the group got the same reward: its group-relative advantages are all 0."""
    return len(rewards) > 0 and max(rewards) != min(rewards)


def overlong_penalty(output_length: int, max_new_tokens: int, cache_length: int, factor: float = 1.0) -> float:
    """Reward added for an answer of ``output_length`` tokens (DAPO eq. 13, scaled by ``factor``).

    0 up to max_new_tokens − cache_length, then falling linearly to −factor at max_new_tokens (and beyond).
    """
    if not 0 <= cache_length <= max_new_tokens:
        raise ValueError(f"overlong cache_length={cache_length} must lie in [0, max_new_tokens={max_new_tokens}]")
    free = max_new_tokens - cache_length
    if output_length <= free:
        return 0.0
    if output_length >= max_new_tokens:
        return -factor
    return -factor * (output_length - free) / cache_length

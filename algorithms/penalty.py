"""Invalid-action penalty: a reply that does not parse into a valid action loses `penalty` from its step reward,
so the policy learns the action format (GiGPO paper, arXiv 2505.10978, experimental setup: penalty 0.1)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

INVALID_ACTION_PENALTY = 0.1  # GiGPO paper


def apply_invalid_action_penalty(
    step_rewards: Iterable[float], is_action_valid: Iterable[bool], penalty: float = INVALID_ACTION_PENALTY
) -> np.ndarray:
    """Step rewards minus `penalty` where the action was invalid (a new array; float32 input stays float32)."""
    rewards = np.asarray(step_rewards)
    valid = np.asarray(is_action_valid)
    if rewards.ndim != 1 or valid.shape != rewards.shape:
        raise ValueError(
            f"step_rewards and is_action_valid must be 1-D of equal length, got {rewards.shape} and {valid.shape}"
        )
    if valid.dtype != bool:
        raise ValueError(f"is_action_valid must be boolean, got dtype {valid.dtype}")
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0 (it is subtracted), got {penalty}")
    out_dtype = np.result_type(rewards.dtype, np.float32)  # float32 stays float32; ints become float64
    return rewards.astype(out_dtype) - np.asarray(penalty, dtype=out_dtype) * ~valid

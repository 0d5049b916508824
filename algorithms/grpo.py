"""GRPO's outcome advantage (Shao et al., 2024, DeepSeekMath, arXiv 2402.03300, Sec. 4.1.2).

G trajectories sampled from the same start form a group; each is scored by its return against the group:
    A(tau_i) = (R(tau_i) - mean_j R(tau_j)) / (std_j R(tau_j) + eps)
and that one value is the advantage of every step (and token) of tau_i. R(tau) = sum of the step rewards; each
trajectory counts once in the statistics; std is unbiased; a trajectory alone in its group gets 0.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from algorithms.core import group_normalize, trajectory_returns

EPSILON = 1e-6  # keeps the division finite when all returns of a group are equal (then A = 0)


def compute_grpo_advantages(
    group_ids: Iterable,
    traj_ids: Iterable,
    step_rewards: Iterable[float],
    *,
    mode: str = "mean_std_norm",
    epsilon: float = EPSILON,
) -> np.ndarray:
    """GRPO advantage of every step row (float32). `mode="mean_norm"` drops the std division (Dr. GRPO)."""
    idx, returns = trajectory_returns(group_ids, traj_ids, step_rewards)
    advantage = group_normalize(returns, idx.traj_group, idx.n_groups, mode=mode, epsilon=epsilon)
    return advantage[idx.row_traj].astype(np.float32)  # broadcast each trajectory's advantage to its rows

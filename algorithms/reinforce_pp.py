"""REINFORCE++ (Hu et al., 2025, arXiv 2501.03262): no critic, no group baseline, but advantages normalized over
the whole batch (z-score), which the paper finds more stable than per-group normalization:
    A(tau_i) = (R(tau_i) - mean_batch R) / (std_batch R + eps).
REINFORCE++-baseline (same paper, for group sampling) first subtracts the group's mean return, then normalizes the
result over the batch:
    A'(tau_i) = R(tau_i) - mean_{j in group} R(tau_j),   A(tau_i) = (A'(tau_i) - mean_batch A') / (std_batch A' + eps).
Here a "sequence" of the single-turn paper is a trajectory: each trajectory counts once in the batch statistics
(unbiased std), and its advantage is broadcast to its rows. The paper's per-token KL reward shaping is left to the
loss (`algorithms.losses.kl_penalty`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from algorithms.core import group_mean, trajectory_returns

EPSILON = 1e-6


def compute_reinforce_pp_advantages(
    group_ids: Iterable,
    traj_ids: Iterable,
    step_rewards: Iterable[float],
    *,
    baseline: bool = False,
    epsilon: float = EPSILON,
) -> np.ndarray:
    """REINFORCE++ advantage of every step row (float32); `baseline=True` gives REINFORCE++-baseline."""
    idx, returns = trajectory_returns(group_ids, traj_ids, step_rewards)
    if baseline:
        returns = returns - group_mean(returns, idx.traj_group, idx.n_groups)[idx.traj_group]
    if idx.n_traj < 2:  # a batch of one trajectory has nothing to be compared with
        return np.zeros(len(idx.row_traj), dtype=np.float32)
    advantage = (returns - returns.mean()) / (returns.std(ddof=1) + epsilon)  # global (batch) normalization
    return advantage[idx.row_traj].astype(np.float32)

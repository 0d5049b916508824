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

from algorithms.core import Moments, group_mean, trajectory_returns

EPSILON = 1e-6


def reinforce_pp_values(
    group_ids: Iterable, traj_ids: Iterable, step_rewards: Iterable[float], *, baseline: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The part computed where the rows are (whole groups at a time): every row's trajectory return (minus its
    group's mean return with `baseline`), and a mask of one row per trajectory, the rows the batch statistics
    count (each trajectory once)."""
    idx, returns = trajectory_returns(group_ids, traj_ids, step_rewards)
    if baseline:
        returns = returns - group_mean(returns, idx.traj_group, idx.n_groups)[idx.traj_group]
    first = np.zeros(len(idx.row_traj), dtype=bool)
    first[np.unique(idx.row_traj, return_index=True)[1]] = True
    return returns[idx.row_traj], first


def whiten(values: np.ndarray, moments: Moments, epsilon: float = EPSILON) -> np.ndarray:
    """(value - batch mean) / (batch std + eps), the batch statistics being `moments` of the whole batch (unbiased
    std); a batch of fewer than two trajectories has nothing to compare with and gives 0."""
    if moments.count < 2:
        return np.zeros(len(values), dtype=np.float32)
    return ((np.asarray(values, np.float64) - moments.mean) / (moments.std() + epsilon)).astype(np.float32)


def compute_reinforce_pp_advantages(
    group_ids: Iterable,
    traj_ids: Iterable,
    step_rewards: Iterable[float],
    *,
    baseline: bool = False,
    epsilon: float = EPSILON,
) -> np.ndarray:
    """REINFORCE++ advantage of every step row of a batch held in one call (float32); `baseline=True` gives
    REINFORCE++-baseline. A batch spread over blocks: `reinforce_pp_values` per block, `Moments` merged, `whiten`."""
    values, first = reinforce_pp_values(group_ids, traj_ids, step_rewards, baseline=baseline)
    return whiten(values, Moments.of(values[first]), epsilon)

"""RLOO: REINFORCE with a leave-one-out baseline (Kool et al., 2019; Ahmadian et al., 2024, arXiv 2402.14740).

Each trajectory's baseline is the mean return of the *other* k - 1 trajectories of its group, so the baseline does
not depend on the trajectory itself (unbiased gradient):
    A(tau_i) = R(tau_i) - 1/(k-1) * sum_{j != i} R(tau_j)  =  k/(k-1) * (R(tau_i) - mean_j R(tau_j)).
A trajectory alone in its group has no baseline and gets 0.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from algorithms.core import group_count, group_sum, trajectory_returns


def compute_rloo_advantages(group_ids: Iterable, traj_ids: Iterable, step_rewards: Iterable[float]) -> np.ndarray:
    """RLOO advantage of every step row (float32)."""
    idx, returns = trajectory_returns(group_ids, traj_ids, step_rewards)
    k = group_count(idx.traj_group, idx.n_groups)[idx.traj_group]  # group size, per trajectory
    others = group_sum(returns, idx.traj_group, idx.n_groups)[idx.traj_group] - returns  # sum over j != i
    advantage = np.where(k > 1, returns - others / np.maximum(k - 1, 1), 0.0)
    return advantage[idx.row_traj].astype(np.float32)

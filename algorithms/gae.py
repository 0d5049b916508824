"""PPO's advantage: generalized advantage estimation (Schulman et al., 2016, arXiv 1506.02438).

With a critic V, per step of each trajectory:
    delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
    A_t     = delta_t + gamma * lam * A_{t+1}           (A = 0 after the last step)
    G_t     = A_t + V(s_t)                              (the value target, "returns")
V(s_{t+1}) after a trajectory's last step is 0 for a real terminal state; for a trajectory cut off by a step limit
pass the critic's value of the state it stopped in as `bootstrap_values` (read at each trajectory's last row only).
Here t counts environment steps (turns): each step row carries one reward and one value.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from algorithms.core import (
    as_float_array,
    check_same_length,
    index_trajectories,
    reverse_scan,
    trajectory_layout,
)

# CleanRL ppo.py defaults (gamma 0.99, gae_lambda 0.95), themselves from the GAE paper's experiments.
GAMMA = 0.99
LAM = 0.95


def compute_gae_advantages(
    group_ids: Iterable,
    traj_ids: Iterable,
    step_rewards: Iterable[float],
    values: Iterable[float],
    *,
    gamma: float = GAMMA,
    lam: float = LAM,
    bootstrap_values: Iterable[float] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """GAE advantages and value targets (returns) of every step row, both float32."""
    rewards = as_float_array(step_rewards, "step_rewards")
    value = as_float_array(values, "values")
    idx = index_trajectories(group_ids, traj_ids)
    n = check_same_length(group_ids=idx.row_group, step_rewards=rewards, values=value)
    if bootstrap_values is None:
        bootstrap = np.zeros(n)
    else:
        bootstrap = as_float_array(bootstrap_values, "bootstrap_values")
        check_same_length(step_rewards=rewards, bootstrap_values=bootstrap)

    position, next_row, _ = trajectory_layout(idx.row_traj, idx.n_traj)
    is_last = next_row < 0
    next_value = np.where(is_last, bootstrap, value[np.where(is_last, 0, next_row)])  # V(s_{t+1})
    delta = rewards + gamma * next_value - value  # TD error
    advantage = reverse_scan(
        delta, gamma * lam, position, next_row
    )  # GAE: the (gamma * lam)-discounted sum of TD errors
    return advantage.astype(np.float32), (advantage + value).astype(np.float32)

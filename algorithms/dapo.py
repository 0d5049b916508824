"""DAPO's dynamic sampling (Yu et al., 2025, arXiv 2503.14476, Sec. 3.2).

A group whose trajectories all have the same return (all solved, or all failed) has zero group-relative advantage
everywhere, so it contributes no gradient and only shrinks the effective batch. DAPO drops such groups (and keeps
sampling until the batch is full; refilling is the caller's job). A group of one trajectory is dropped too.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from algorithms.core import trajectory_returns


def dynamic_sampling_mask(
    group_ids: Iterable, traj_ids: Iterable, step_rewards: Iterable[float], *, atol: float = 0.0
) -> np.ndarray:
    """Boolean row mask: True for rows of groups whose trajectory returns differ by more than `atol`."""
    idx, returns = trajectory_returns(group_ids, traj_ids, step_rewards)
    highest = np.full(idx.n_groups, -np.inf)
    lowest = np.full(idx.n_groups, np.inf)
    np.maximum.at(highest, idx.traj_group, returns)  # one pass over trajectories, not rows
    np.minimum.at(lowest, idx.traj_group, returns)
    keep_group = (highest - lowest) > atol
    return keep_group[idx.row_group]

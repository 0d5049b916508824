"""GiGPO: Group-in-Group Policy Optimization (Feng et al., 2025, arXiv 2505.10978).

Two levels of group-relative advantage, no critic:
1. Episode level (paper Eq. 3), as in GRPO: the trajectories of a group start from the same initial state; each one
   is scored by its return R(tau_i) = sum_t r_t against the others of its group,
       A_E(tau_i) = R(tau_i) - mean_j R(tau_j)                            ("mean_norm")
       A_E(tau_i) = (R(tau_i) - mean_j R(tau_j)) / (std_j R(tau_j) + eps) ("mean_std_norm", unbiased std).
2. Step level (Eqs. 5-7): every row whose *anchor state* (observation) is identical to another row's of the same
   group, at any time step and in any trajectory (also the same trajectory, e.g. after a loop), joins that state's
   step group. Rows are scored by their discounted return-to-go R_t = r_t + gamma * R_{t+1} against their step
   group, with the same normalization.
The combined advantage is A = A_E + step_weight * A_S (Eq. 8). One value per row, broadcast later to its tokens.

Lone states. A step alone in its step group gets A_S = 0, as in the public reference implementation (verl-agent's
`gigpo/core_gigpo.py`, read at commit 20bd331: a singleton's mean is its own value and its std 1, so (x - x) / 1).
A trajectory alone in its group gets A_E = 0 by default; `singleton="reference"` gives it its raw return instead
(the reference's episode level uses mean 0 and std 1 for a lone trajectory).

Where this differs from the public reference implementation (deliberately, and as our design asks):
- The episode-level mean/std count each trajectory once. The reference's default counts each trajectory once per
  step, which weights long trajectories more.
- Everything is vectorized group-bys (O(N log N) sort + O(N) bincounts) instead of a per-row search over the batch.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from algorithms.core import (
    as_float_array,
    as_key_array,
    check_mode,
    check_same_length,
    combine_codes,
    discounted_returns_to_go,
    factorize,
    group_count,
    group_normalize,
    group_sum,
    index_trajectories,
    trajectory_layout,
)
from algorithms.similarity import cluster_similar_texts

# The paper's settings: gamma 0.95, step-advantage weight w = 1. mode="mean_norm" is the reference code's default.
GAMMA = 0.95
STEP_WEIGHT = 1.0
EPSILON = 1e-6
SINGLETON_CHOICES = ("zero", "reference")


def step_group_codes(
    row_group: np.ndarray, anchor_keys: np.ndarray, anchor_similarity: float | None = None
) -> tuple[np.ndarray, int]:
    """Step-group code of every row: same group and same anchor (or a similar one, if `anchor_similarity`)."""
    if anchor_similarity is not None and not 0.0 < anchor_similarity <= 1.0:
        raise ValueError(f"anchor_similarity must be in (0, 1] or None, got {anchor_similarity}")
    if anchor_similarity is None or anchor_similarity == 1.0:
        anchor_code, _ = factorize(anchor_keys, "anchor_keys")
        return combine_codes(row_group, anchor_code)  # the key is the pair (group, anchor)
    return cluster_similar_texts(row_group, anchor_keys, anchor_similarity)


def compute_gigpo_advantages(
    group_ids: Iterable,
    traj_ids: Iterable,
    anchor_keys: Iterable,
    step_rewards: Iterable[float],
    *,
    gamma: float = GAMMA,
    step_weight: float = STEP_WEIGHT,
    mode: str = "mean_norm",
    epsilon: float = EPSILON,
    anchor_similarity: float | None = None,
    singleton: str = "zero",
) -> np.ndarray:
    """GiGPO advantage of every step row (float32, same order as the inputs).

    `anchor_similarity` (in (0, 1]): when set, anchor texts of one group whose character 3-gram Jaccard similarity is
    at least this share a step group (see `algorithms.similarity`); 1.0 or None means identical anchors only.
    `singleton`: "zero" (a lone trajectory gets A_E = 0) or "reference" (its raw return, as the public code does).
    """
    check_mode(mode)
    if singleton not in SINGLETON_CHOICES:
        raise ValueError(f"unknown singleton {singleton!r}; expected one of {SINGLETON_CHOICES}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    rewards = as_float_array(step_rewards, "step_rewards")
    anchors = as_key_array(anchor_keys, "anchor_keys")
    idx = index_trajectories(group_ids, traj_ids)
    check_same_length(group_ids=idx.row_group, anchor_keys=anchors, step_rewards=rewards)

    # Episode level (Eq. 3): one return per trajectory, so each trajectory counts once in its group's statistics.
    episode_return = group_sum(rewards, idx.row_traj, idx.n_traj)
    a_episode = group_normalize(episode_return, idx.traj_group, idx.n_groups, mode=mode, epsilon=epsilon,
                                singleton="raw" if singleton == "reference" else "zero")

    # Step level (Eqs. 5-7): discounted return-to-go of every row, compared within its anchor-state group.
    position, next_row, _ = trajectory_layout(idx.row_traj, idx.n_traj)
    return_to_go = discounted_returns_to_go(rewards, gamma, position, next_row)
    step_group, n_step_groups = step_group_codes(idx.row_group, anchors, anchor_similarity)
    a_step = group_normalize(return_to_go, step_group, n_step_groups, mode=mode, epsilon=epsilon)

    # Eq. 8: the trajectory's episode advantage, broadcast to its rows, plus the weighted step advantage.
    return (a_episode[idx.row_traj] + step_weight * a_step).astype(np.float32)


def step_group_stats(
    group_ids: Iterable, anchor_keys: Iterable, *, anchor_similarity: float | None = None
) -> dict[str, float]:
    """How much GiGPO's step level has to work with in a batch.

    - `step_group_share`: share of rows in a step group larger than one (rows that get a non-zero A_S).
    - `step_group_mean_size`: mean number of rows per step group.
    - `num_step_groups`: number of step groups.
    """
    row_group, _ = factorize(group_ids, "group_ids")
    anchors = as_key_array(anchor_keys, "anchor_keys")
    n_rows = check_same_length(group_ids=row_group, anchor_keys=anchors)
    if n_rows == 0:
        return {"step_group_share": 0.0, "step_group_mean_size": 0.0, "num_step_groups": 0.0}
    codes, n_codes = step_group_codes(row_group, anchors, anchor_similarity)
    size = group_count(codes, n_codes)
    return {
        "step_group_share": float(np.mean(size[codes] > 1)),
        "step_group_mean_size": n_rows / n_codes,
        "num_step_groups": float(n_codes),
    }

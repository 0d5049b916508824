"""HGPO: step groups by shared history contexts of several lengths (arXiv 2602.22817; verl-agent ships it as
`recipe/hgpo`, read at commit 20bd331).

GiGPO compares a step with the other steps of its group that stand in the same state. HGPO asks more of the match:
at level k (k = 1 .. history_length + 1) two steps of a group share a step group when their last k anchors agree,
the current state and the k - 1 states before it, so the comparison also holds the recent past fixed. A step at
time t has the levels k <= t + 1 only.

Per level, every step's discounted return-to-go R_t = r_t + gamma * R_{t+1} is scored against its level-k group:
    a_k = R_t - mean                              ("mean_norm")
    a_k = (R_t - mean) / (std + eps)              ("mean_std_norm", population std as the reference code)
and a step alone at a level gets no score there. The levels are combined with weights that grow with the length of
the shared context, over the levels where the step has a non-zero score:
    A = sum_k w_k a_k / (sum_k w_k + eps),   w_k = (k + 1) ** alpha
(alpha = 1 and three levels: 2/9, 3/9, 4/9). A step with no such level gets 0. `base_group=True` adds the episode
level (GRPO's A_E, each trajectory once) as level 0 with weight 1.

The history keys come from the trajectory rows themselves (the anchors of the previous steps, and with
`with_actions` the actions taken there), whatever memory module built the prompts.
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
    group_normalize,
    group_sum,
    index_trajectories,
    trajectory_layout,
)

# The recipe's defaults: history_length 2 (levels 1..3), alpha 1, mean_std_norm, no episode level; gamma as GiGPO.
GAMMA = 0.95
HISTORY_LENGTH = 2
ALPHA = 1.0
EPSILON = 1e-6


def compute_hgpo_advantages(
    group_ids: Iterable,
    traj_ids: Iterable,
    anchor_keys: Iterable,
    step_rewards: Iterable[float],
    *,
    actions: Iterable | None = None,
    gamma: float = GAMMA,
    history_length: int = HISTORY_LENGTH,
    alpha: float = ALPHA,
    mode: str = "mean_std_norm",
    base_group: bool = False,
    with_actions: bool = False,
    epsilon: float = EPSILON,
) -> np.ndarray:
    """HGPO advantage of every step row (float32, same order as the inputs); rows of a trajectory in time order."""
    check_mode(mode)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if history_length < 0:
        raise ValueError(f"history_length must be >= 0, got {history_length}")
    if with_actions and actions is None:
        raise ValueError("with_actions=True needs the rows' actions")
    rewards = as_float_array(step_rewards, "step_rewards")
    anchors = as_key_array(anchor_keys, "anchor_keys")
    idx = index_trajectories(group_ids, traj_ids)
    n = check_same_length(group_ids=idx.row_group, anchor_keys=anchors, step_rewards=rewards)

    position, next_row, _ = trajectory_layout(idx.row_traj, idx.n_traj)
    previous = np.full(n, -1, dtype=np.int64)
    has_next = next_row >= 0
    previous[next_row[has_next]] = np.flatnonzero(has_next)
    returns = discounted_returns_to_go(rewards, gamma, position, next_row)

    anchor_code, _ = factorize(anchors, "anchor_keys")
    past_code = anchor_code  # what a previous step adds to the key: its state, and with_actions what it did there
    if with_actions:
        action_code, _ = factorize(["" if a is None else str(a) for a in actions], "actions")
        check_same_length(anchor_keys=anchors, actions=action_code)
        past_code, _ = combine_codes(anchor_code, action_code)

    weights = [(k + 1.0) ** alpha for k in range(1, history_length + 2)]
    scores = []
    key, _ = combine_codes(idx.row_group, anchor_code)  # level 1: the current state, within the group
    back = np.arange(n)  # the earliest step of the level's context; -1 once the trajectory has no such step
    for level in range(1, history_length + 2):
        if level > 1:
            back = np.where(back >= 0, previous[np.maximum(back, 0)], -1)
            key, _ = combine_codes(key, np.where(back >= 0, past_code[np.maximum(back, 0)], 0))
        rows = np.flatnonzero(back >= 0)
        score = np.zeros(n)
        codes, n_codes = factorize(key[rows], "step keys")
        score[rows] = group_normalize(returns[rows], codes, n_codes, mode=mode, epsilon=epsilon, ddof=0)
        scores.append(score)
    if base_group:
        episode_return = group_sum(rewards, idx.row_traj, idx.n_traj)
        episode = group_normalize(episode_return, idx.traj_group, idx.n_groups, mode=mode, epsilon=epsilon)
        scores.append(episode[idx.row_traj])
        weights.append(1.0)  # level 0: (0 + 1) ** alpha

    score = np.stack(scores, axis=1)
    weight = np.asarray(weights)[None, :] * (score != 0)  # levels where the step has a (non-zero) score
    return ((score * weight).sum(axis=1) / (weight.sum(axis=1) + epsilon)).astype(np.float32)

"""Dr. GRPO, "GRPO done right" (Liu et al., 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783).

Dividing by the group's std weights groups with small spread (almost always right or always wrong) more, a
question-level difficulty bias; Dr. GRPO removes it:
    A(tau_i) = R(tau_i) - mean_j R(tau_j).
Its other fix, no per-sequence length normalization in the loss, is `loss_agg_mode="seq-mean-token-sum-norm"` in
`algorithms.losses`.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from algorithms.grpo import compute_grpo_advantages


def compute_drgrpo_advantages(group_ids: Iterable, traj_ids: Iterable, step_rewards: Iterable[float]) -> np.ndarray:
    """Dr. GRPO advantage of every step row (float32): the return minus its group's mean return."""
    return compute_grpo_advantages(group_ids, traj_ids, step_rewards, mode="mean_norm")

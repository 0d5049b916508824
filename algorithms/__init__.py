"""Advantage estimators and policy losses: pure numpy / torch functions (no Ray, no environments).

Every estimator takes flat per-step rows: `group_ids` (trajectories from the same initial state), `traj_ids`,
`step_rewards` (and GiGPO also `anchor_keys`), rows of one trajectory in time order, and returns one float32
advantage per row. `ESTIMATORS` maps a config name to a callable with one uniform signature,
`fn(group_ids, traj_ids, anchor_keys, step_rewards, **params)`; `compute_advantages(name, ...)` calls it.
PPO's GAE needs critic values and is the separate `compute_gae_advantages`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from algorithms.dapo import dynamic_sampling_mask
from algorithms.drgrpo import compute_drgrpo_advantages
from algorithms.gae import compute_gae_advantages
from algorithms.gigpo import compute_gigpo_advantages, step_group_stats
from algorithms.grpo import compute_grpo_advantages
from algorithms.penalty import apply_invalid_action_penalty
from algorithms.reinforce_pp import compute_reinforce_pp_advantages
from algorithms.rloo import compute_rloo_advantages

Estimator = Callable[..., np.ndarray]


def _without_anchors(fn: Callable[..., np.ndarray], name: str, **fixed: Any) -> Estimator:
    """Adapter to the uniform signature for estimators that do not look at anchor states."""

    def estimator(
        group_ids: Iterable, traj_ids: Iterable, anchor_keys: Iterable | None, step_rewards: Iterable[float], **params
    ) -> np.ndarray:
        return fn(group_ids, traj_ids, step_rewards, **fixed, **params)

    estimator.__name__ = estimator.__qualname__ = name
    estimator.__doc__ = fn.__doc__
    return estimator


ESTIMATORS: dict[str, Estimator] = {
    "gigpo": compute_gigpo_advantages,
    "grpo": _without_anchors(compute_grpo_advantages, "grpo"),
    "drgrpo": _without_anchors(compute_drgrpo_advantages, "drgrpo"),
    "rloo": _without_anchors(compute_rloo_advantages, "rloo"),
    "reinforce_pp": _without_anchors(compute_reinforce_pp_advantages, "reinforce_pp", baseline=False),
    "reinforce_pp_baseline": _without_anchors(compute_reinforce_pp_advantages, "reinforce_pp_baseline", baseline=True),
}


def compute_advantages(
    name: str,
    group_ids: Iterable,
    traj_ids: Iterable,
    anchor_keys: Iterable | None,
    step_rewards: Iterable[float],
    **params: Any,
) -> np.ndarray:
    """Advantages of every step row by the estimator called `name` (a key of `ESTIMATORS`)."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; expected one of {sorted(ESTIMATORS)}")
    return ESTIMATORS[name](group_ids, traj_ids, anchor_keys, step_rewards, **params)


# The losses need torch; load them on first use so that computing advantages (e.g. in a Ray Data task) stays
# numpy-only and fast to import.
_LOSS_NAMES = (
    "aggregate_loss",
    "entropy_bonus",
    "entropy_from_logits",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
)


def __getattr__(name: str) -> Any:
    if name in _LOSS_NAMES:
        from algorithms import losses

        return getattr(losses, name)
    raise AttributeError(f"module 'algorithms' has no attribute {name!r}")


__all__ = [
    "ESTIMATORS",
    "aggregate_loss",
    "apply_invalid_action_penalty",
    "compute_advantages",
    "compute_drgrpo_advantages",
    "compute_gae_advantages",
    "compute_gigpo_advantages",
    "compute_grpo_advantages",
    "compute_reinforce_pp_advantages",
    "compute_rloo_advantages",
    "dynamic_sampling_mask",
    "entropy_bonus",
    "entropy_from_logits",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
    "step_group_stats",
]

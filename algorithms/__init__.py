"""Advantage estimators and policy losses: pure numpy / torch functions (no Ray, no environments).

Every estimator takes flat per-step rows: `group_ids` (trajectories from the same initial state), `traj_ids`,
`step_rewards` (GiGPO and HGPO also `anchor_keys`, HGPO optionally `actions`), rows of one trajectory in time order,
and returns one float32 advantage per row. `ESTIMATORS` maps a config name to a callable with one uniform
signature, `fn(group_ids, traj_ids, anchor_keys, step_rewards, **params)`; `compute_advantages(name, ...)` calls it
on a batch held in one call.

A batch spread over blocks (one per env-group actor, each holding whole groups): group-level estimators run per
block as they are. Those with whole-batch statistics (`WHOLE_BATCH`: REINFORCE++) split into a per-block part
(`values`), statistics merged over the blocks (`core.Moments`) and `finish`, so the result does not depend on how
the batch was cut. PPO's GAE needs critic values and is the separate `compute_gae_advantages`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np

from algorithms.core import Moments
from algorithms.dapo import dynamic_sampling_mask
from algorithms.drgrpo import compute_drgrpo_advantages
from algorithms.gae import compute_gae_advantages
from algorithms.gigpo import compute_gigpo_advantages, step_group_stats
from algorithms.grpo import compute_grpo_advantages
from algorithms.hgpo import compute_hgpo_advantages
from algorithms.penalty import apply_invalid_action_penalty
from algorithms.reinforce_pp import compute_reinforce_pp_advantages, reinforce_pp_values, whiten
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
    "hgpo": compute_hgpo_advantages,
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
    actions: Iterable | None = None,
    **params: Any,
) -> np.ndarray:
    """Advantages of every step row by the estimator called `name` (a key of `ESTIMATORS`), the batch held in this
    one call. `actions` reach the estimators that read them (HGPO's `with_actions`)."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; expected one of {sorted(ESTIMATORS)}")
    fn = ESTIMATORS[name]
    if actions is not None and "actions" in inspect.signature(fn).parameters:
        params = {**params, "actions": actions}
    return fn(group_ids, traj_ids, anchor_keys, step_rewards, **params)


class WholeBatch(NamedTuple):
    """An estimator whose advantages need statistics of the whole batch. `values(group_ids, traj_ids, step_rewards,
    **params)` runs where the rows are (whole groups at a time) and gives each row's value and whether the row
    counts in the statistics; `finish(values, moments, **params)` turns them into advantages given the merged
    `Moments` of the counted values of every block."""

    values: Callable[..., tuple[np.ndarray, np.ndarray]]
    finish: Callable[..., np.ndarray]


def _finish_reinforce_pp(values: np.ndarray, moments: Moments, epsilon: float = 1e-6, **_: Any) -> np.ndarray:
    return whiten(values, moments, epsilon)


WHOLE_BATCH: dict[str, WholeBatch] = {
    "reinforce_pp": WholeBatch(lambda g, t, r, epsilon=1e-6: reinforce_pp_values(g, t, r, baseline=False),
                               _finish_reinforce_pp),
    "reinforce_pp_baseline": WholeBatch(lambda g, t, r, epsilon=1e-6: reinforce_pp_values(g, t, r, baseline=True),
                                        _finish_reinforce_pp),
}


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
    "WHOLE_BATCH",
    "Moments",
    "WholeBatch",
    "aggregate_loss",
    "apply_invalid_action_penalty",
    "compute_advantages",
    "compute_drgrpo_advantages",
    "compute_gae_advantages",
    "compute_gigpo_advantages",
    "compute_grpo_advantages",
    "compute_hgpo_advantages",
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

"""Groups of environments that share an initial state, as GRPO and GiGPO compare returns within a group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from envs.registry import make

_SPLIT_PARITY = {"train": 0, "val": 1}


def group_seeds(base_seed: int, index: int, n_groups: int, split: Literal["train", "val"]) -> np.ndarray:
    """`n_groups` distinct reset seeds for iteration (or evaluation round) `index` of a run seeded `base_seed`.

    Training seeds are even and validation seeds odd, so the two splits can never share an initial state.
    `base_seed` and `index` must be non-negative.
    """
    if split not in _SPLIT_PARITY:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    # Mixing the split into the seed sequence keeps the two splits' draws independent, not shifted by one.
    rng = np.random.default_rng([base_seed, index, _SPLIT_PARITY[split]])
    halves = rng.choice(2**31, size=n_groups, replace=False).astype(np.int64)
    return 2 * halves + _SPLIT_PARITY[split]


class EnvGroups:
    """`n_groups * group_size` environments; env i belongs to group ``i // group_size``.

    `reset` gives all members of a group the same seed (so the same initial state); `step` steps only the envs
    still running and reports None for the others. `done` marks finished envs.
    """

    def __init__(self, env: str, n_groups: int, group_size: int, env_kwargs: dict[str, Any] | None = None):
        if n_groups < 1 or group_size < 1:
            raise ValueError(f"n_groups and group_size must be >= 1, got {n_groups} and {group_size}")
        self.n_groups = n_groups
        self.group_size = group_size
        self.envs = [make(env, **(env_kwargs or {})) for _ in range(n_groups * group_size)]
        self.group_ids = np.repeat(np.arange(n_groups), group_size)
        self.done = np.ones(len(self.envs), dtype=bool)

    def __len__(self) -> int:
        return len(self.envs)

    @property
    def all_done(self) -> bool:
        return bool(self.done.all())

    def reset(self, seeds: Sequence[int]) -> tuple[list[str], list[dict[str, Any]]]:
        """Reset every env; `seeds` holds one seed per group."""
        if len(seeds) != self.n_groups:
            raise ValueError(f"expected {self.n_groups} seeds (one per group), got {len(seeds)}")
        results = [env.reset(seed=int(seeds[g])) for env, g in zip(self.envs, self.group_ids, strict=True)]
        self.done[:] = False
        return [obs for obs, _ in results], [info for _, info in results]

    def step(
        self, replies: Sequence[str | None]
    ) -> tuple[list[str | None], np.ndarray, np.ndarray, np.ndarray, list[dict[str, Any] | None]]:
        """Step each running env with its reply. Finished envs are skipped and yield None, reward 0 and
        terminated/truncated False; a None reply to a running env counts as an invalid action."""
        if len(replies) != len(self.envs):
            raise ValueError(f"expected {len(self.envs)} replies, got {len(replies)}")
        n = len(self.envs)
        observations: list[str | None] = [None] * n
        infos: list[dict[str, Any] | None] = [None] * n
        rewards = np.zeros(n, dtype=np.float64)
        terminated = np.zeros(n, dtype=bool)
        truncated = np.zeros(n, dtype=bool)
        for i in np.flatnonzero(~self.done):
            observations[i], rewards[i], terminated[i], truncated[i], infos[i] = self.envs[i].step(replies[i])
        self.done |= terminated | truncated
        return observations, rewards, terminated, truncated, infos

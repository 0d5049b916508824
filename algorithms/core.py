"""Shared, vectorized building blocks for every advantage estimator.

Everything here works on flat per-row arrays (one row = one environment step of one trajectory) and turns ids into
dense integer codes once, so that every "group-by" is an `np.bincount` over those codes: O(N) after one sort, with no
Python loop over rows. The only Python loops are over time steps (bounded by the longest episode) in `reverse_scan`.

Conventions used by all estimators:
- `group_ids[i]`: the group of row i (trajectories that started from the same initial state).
- `traj_ids[i]`: the trajectory of row i. A trajectory is identified by the pair (group id, trajectory id), so
  trajectory ids may restart at 0 in every group or be globally unique; both work.
- Rows of one trajectory appear in time order; rows of different trajectories may be interleaved.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

NORM_MODES = ("mean_norm", "mean_std_norm")


# ----------------------------------------------------------------------------------------------------------------
# Input handling
# ----------------------------------------------------------------------------------------------------------------
def as_key_array(values: Iterable, name: str = "ids") -> np.ndarray:
    """A 1-D array of hashable keys. Numpy arrays pass through, array-likes (torch, pandas) are converted, anything
    else becomes an object array."""
    if values is None:
        raise ValueError(f"{name} is required (got None)")
    if isinstance(values, np.ndarray):
        arr = values
    elif hasattr(values, "__array__"):
        arr = np.asarray(values)  # e.g. a torch tensor: its elements would hash by identity, its values do not
    else:
        # fromiter(dtype=object) keeps tuples and mixed types as single elements (np.asarray would make them 2-D).
        seq = values if hasattr(values, "__len__") else list(values)
        arr = np.fromiter(seq, dtype=object, count=len(seq))
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    return arr


def as_float_array(values: Iterable, name: str) -> np.ndarray:
    """A 1-D, finite float64 array (float64 so that sums over long batches do not lose precision)."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    return arr


def check_same_length(**arrays: np.ndarray) -> int:
    """Raise a ValueError naming the arrays if their lengths differ; return the common length."""
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"inputs must have one value per row; got lengths {lengths}")
    return next(iter(lengths.values()), 0)


def check_mode(mode: str) -> None:
    if mode not in NORM_MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {NORM_MODES}")


# ----------------------------------------------------------------------------------------------------------------
# Factorization: ids -> dense integer codes
# ----------------------------------------------------------------------------------------------------------------
def _factorize_ints(key: np.ndarray) -> tuple[np.ndarray, int]:
    """Dense codes for integer keys: a lookup table when their range is small (O(N), no sort), else np.unique."""
    if len(key) == 0:
        return np.zeros(0, dtype=np.int64), 0
    low, high = int(key.min()), int(key.max())
    if high - low <= 4 * len(key) + 1024:
        present = np.zeros(high - low + 1, dtype=bool)
        present[key - low] = True
        table = np.cumsum(present) - 1  # key -> rank among the keys present
        return table[key - low], int(table[-1]) + 1
    uniques, codes = np.unique(key, return_inverse=True)
    return codes.astype(np.int64, copy=False), len(uniques)


def factorize(values: Iterable, name: str = "ids") -> tuple[np.ndarray, int]:
    """Dense integer codes for arbitrary hashable keys: `(codes, n_unique)`, `codes[i]` in [0, n_unique).

    Equal keys (by `==` and `hash`, as in a dict) get equal codes; the numbering itself carries no meaning.
    Integer arrays use a lookup table or `np.unique`, other numeric arrays `np.unique` (C sorts). Object keys
    (strings, tuples, mixed types) are hashed with the builtin `hash` (a C-level `map`, no Python bytecode per row),
    the 64-bit hashes are factorized, and the result is checked element-wise against the keys: sorting 1M Python
    strings takes ~1.5 s, this ~0.2 s. Only if the check fails (a hash collision, or NaN keys, which are never equal
    to themselves) does it fall back to a dict, one Python step per row.
    """
    arr = as_key_array(values, name)
    if arr.dtype.kind in "biu":
        return _factorize_ints(arr.astype(np.int64, copy=False))
    if arr.dtype.kind in "fcmM":
        uniques, codes = np.unique(arr, return_inverse=True)
        return codes.astype(np.int64, copy=False), len(uniques)
    if arr.dtype.kind != "O":
        arr = arr.astype(object)  # fixed-width 'U'/'S' arrays sort slowly; hash them as Python objects instead
    try:
        hashes = np.fromiter(map(hash, arr), dtype=np.int64, count=len(arr))
    except TypeError as err:
        raise ValueError(f"{name} must be hashable (str, int, tuple, ...): {err}") from None
    uniques, codes = np.unique(hashes, return_inverse=True)
    codes = codes.astype(np.int64, copy=False)
    if bool(np.all(arr[representatives(codes, len(uniques))][codes] == arr)):
        return codes, len(uniques)
    table: dict = {}
    codes = np.fromiter((table.setdefault(v, len(table)) for v in arr), dtype=np.int64, count=len(arr))
    return codes, len(table)


def representatives(codes: np.ndarray, n: int) -> np.ndarray:
    """One row index holding each code (which one, among equal keys, does not matter)."""
    rep = np.zeros(n, dtype=np.int64)
    rep[codes] = np.arange(len(codes))  # repeated indices: some write wins, any is a valid representative
    return rep


def combine_codes(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
    """Dense codes for the pair (a[i], b[i]) of two non-negative code arrays, like `factorize`."""
    key = a.astype(np.int64) * (int(b.max(initial=-1)) + 1) + b  # a bijection of pairs onto int64 (N^2 << 2^63)
    return _factorize_ints(key)


def stable_argsort_codes(codes: np.ndarray) -> np.ndarray:
    """Stable argsort of non-negative integer codes.

    numpy's stable sort is a radix sort for 16-bit keys (several times faster than its merge sort for int64), so
    codes below 2^32 are sorted as two 16-bit digits, least significant first (LSD radix sort: stable by design).
    """
    if len(codes) == 0 or codes.max() < 1 << 16:
        return np.argsort(codes.astype(np.uint16), kind="stable")
    if codes.max() < 1 << 32:
        order = np.argsort((codes & 0xFFFF).astype(np.uint16), kind="stable")
        return order[np.argsort((codes[order] >> 16).astype(np.uint16), kind="stable")]
    return np.argsort(codes, kind="stable")


@dataclass(frozen=True)
class TrajectoryIndex:
    """Integer codes for the rows of a batch: which group and which trajectory each row belongs to."""

    row_group: np.ndarray  # [N] group code of each row
    row_traj: np.ndarray  # [N] trajectory code of each row
    traj_group: np.ndarray  # [n_traj] group code of each trajectory
    n_groups: int
    n_traj: int


def index_trajectories(group_ids: Iterable, traj_ids: Iterable) -> TrajectoryIndex:
    """Codes for groups and for trajectories, a trajectory being the pair (group id, trajectory id)."""
    row_group, n_groups = factorize(group_ids, "group_ids")
    traj_local, _ = factorize(traj_ids, "traj_ids")
    check_same_length(group_ids=row_group, traj_ids=traj_local)
    row_traj, n_traj = combine_codes(row_group, traj_local)
    traj_group = np.zeros(n_traj, dtype=np.int64)
    traj_group[row_traj] = row_group  # all rows of a trajectory share its group, so any write is the right one
    return TrajectoryIndex(
        row_group=row_group, row_traj=row_traj, traj_group=traj_group, n_groups=n_groups, n_traj=n_traj
    )


# ----------------------------------------------------------------------------------------------------------------
# Group-bys over integer codes
# ----------------------------------------------------------------------------------------------------------------
def group_sum(values: np.ndarray, codes: np.ndarray, n: int) -> np.ndarray:
    """Per-group sum (float64); `codes` in [0, n)."""
    return np.bincount(codes, weights=values, minlength=n)


def group_count(codes: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(codes, minlength=n)


def group_mean(values: np.ndarray, codes: np.ndarray, n: int) -> np.ndarray:
    """Per-group mean; 0 for an empty group."""
    count = group_count(codes, n)
    return group_sum(values, codes, n) / np.maximum(count, 1)


def group_std(values: np.ndarray, codes: np.ndarray, n: int, mean: np.ndarray | None = None, ddof: int = 1
              ) -> np.ndarray:
    """Per-group standard deviation, unbiased by default (ddof=1, like `torch.std`); 0 for groups of size <= ddof.

    Two passes (mean, then squared deviations) instead of E[x^2] - E[x]^2, which cancels catastrophically when the
    spread is small next to the mean.
    """
    if mean is None:
        mean = group_mean(values, codes, n)
    count = group_count(codes, n)
    sq_dev = group_sum((values - mean[codes]) ** 2, codes, n)
    return np.sqrt(sq_dev / np.maximum(count - ddof, 1))


SINGLETON_MODES = ("zero", "raw")


def group_normalize(values: np.ndarray, codes: np.ndarray, n: int, *, mode: str, epsilon: float, ddof: int = 1,
                    singleton: str = "zero") -> np.ndarray:
    """Group-relative score of every element: x - mean (mean_norm) or (x - mean) / (std + eps) (mean_std_norm).

    An element alone in its group has nothing to be compared with: it gets 0 (`singleton="zero"`), or its raw value
    as if the group had mean 0 and std 1 (`singleton="raw"`, what the public GiGPO code does for a lone episode).
    """
    check_mode(mode)
    if singleton not in SINGLETON_MODES:
        raise ValueError(f"unknown singleton mode {singleton!r}; expected one of {SINGLETON_MODES}")
    mean = group_mean(values, codes, n)
    out = values - mean[codes]
    if mode == "mean_std_norm":
        out = out / (group_std(values, codes, n, mean, ddof)[codes] + epsilon)
    alone = group_count(codes, n)[codes] < 2
    # A singleton's deviation is already exactly 0; set it explicitly so the rule does not hinge on rounding.
    if singleton == "zero":
        out[alone] = 0.0
    else:
        out[alone] = values[alone] / (1.0 + epsilon) if mode == "mean_std_norm" else values[alone]
    return out


@dataclass(frozen=True)
class Moments:
    """Count, mean and sum of squared deviations of some values: statistics of a whole batch gathered from its parts
    (e.g. the blocks of a Ray Dataset) without moving the values (Chan et al.'s pairwise merge, exact up to
    rounding)."""

    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    @classmethod
    def of(cls, values: np.ndarray) -> Moments:
        values = np.asarray(values, dtype=np.float64)
        if len(values) == 0:
            return cls()
        mean = float(values.mean())
        return cls(float(len(values)), mean, float(((values - mean) ** 2).sum()))

    def merge(self, other: Moments) -> Moments:
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        count = self.count + other.count
        delta = other.mean - self.mean
        return Moments(count, self.mean + delta * other.count / count,
                       self.m2 + other.m2 + delta**2 * self.count * other.count / count)

    def std(self, ddof: int = 1) -> float:
        return float(np.sqrt(self.m2 / max(self.count - ddof, 1)))


# ----------------------------------------------------------------------------------------------------------------
# Time structure inside trajectories
# ----------------------------------------------------------------------------------------------------------------
def trajectory_layout(row_traj: np.ndarray, n_traj: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Time layout of interleaved trajectories.

    Returns `(position, next_row, length)`: `position[i]` is row i's time step within its trajectory (0-based),
    `next_row[i]` the row of the following step (-1 at a trajectory's last step), `length[k]` trajectory k's
    number of steps.
    """
    n = len(row_traj)
    # A stable sort by trajectory keeps each trajectory's rows in their given (time) order.
    order = stable_argsort_codes(row_traj)
    sorted_traj = row_traj[order]
    length = group_count(row_traj, n_traj)
    start = np.cumsum(length) - length
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n) - start[sorted_traj]
    next_row = np.full(n, -1, dtype=np.int64)
    same_traj = sorted_traj[1:] == sorted_traj[:-1]
    next_row[order[:-1][same_traj]] = order[1:][same_traj]
    return position, next_row, length


def reverse_scan(x: np.ndarray, decay: float, position: np.ndarray, next_row: np.ndarray) -> np.ndarray:
    """y_t = x_t + decay * y_{t+1} within each trajectory, with y = 0 after a trajectory's last step.

    Vectorized across trajectories: one Python iteration per time step (at most the longest episode, e.g. 50),
    each updating all rows at that step at once, so the cost is O(N + T) numpy work and O(N) memory (no padding).
    """
    n = len(x)
    y = np.zeros(n + 1)  # slot n stays 0: a last step (next_row == -1) reads it, i.e. nothing comes after it
    nxt = np.where(next_row >= 0, next_row, n)
    by_position = stable_argsort_codes(position)
    bounds = np.concatenate([[0], np.cumsum(np.bincount(position))])
    for t in range(len(bounds) - 2, -1, -1):  # last time step first, so y_{t+1} is ready when y_t needs it
        rows = by_position[bounds[t] : bounds[t + 1]]
        y[rows] = x[rows] + decay * y[nxt[rows]]
    return y[:n]


def discounted_returns_to_go(
    rewards: np.ndarray, gamma: float, position: np.ndarray, next_row: np.ndarray
) -> np.ndarray:
    """R_t = r_t + gamma * R_{t+1}, R after the last step = 0 (GiGPO paper, Eq. 5)."""
    return reverse_scan(rewards, gamma, position, next_row)


def trajectory_returns(
    group_ids: Iterable, traj_ids: Iterable, step_rewards: Iterable[float]
) -> tuple[TrajectoryIndex, np.ndarray]:
    """Validated trajectory index and each trajectory's undiscounted return R(tau) = sum_t r_t (float64)."""
    rewards = as_float_array(step_rewards, "step_rewards")
    idx = index_trajectories(group_ids, traj_ids)
    check_same_length(group_ids=idx.row_group, step_rewards=rewards)
    return idx, group_sum(rewards, idx.row_traj, idx.n_traj)

"""The iteration's batch as a Ray Dataset: the env-group actors' blocks (never gathered on the controller),
advantages computed where the rows are (each block holds whole groups), whole-batch statistics merged from the
blocks where an estimator needs them, and one shard per training worker that keeps every row.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import ray

from actors.config import AlgorithmConfig
from algorithms import WHOLE_BATCH, Moments, apply_invalid_action_penalty, compute_advantages, dynamic_sampling_mask

_DATA_CPUS = 0.25  # Ray Data tasks need a CPU share of their own, or they wait behind the long-lived actors


def _rewards_and_ids(batch: pa.Table, penalty: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rewards = apply_invalid_action_penalty(batch["reward"].to_numpy(), batch["valid"].to_numpy(), penalty)
    return rewards, batch["group_id"].to_numpy(), batch["traj_id"].to_numpy()


def _keep_informative_groups(table: pa.Table, group_ids, traj_ids, rewards, dynamic_sampling: bool) -> pa.Table:
    if not dynamic_sampling:
        return table
    return table.filter(pa.array(dynamic_sampling_mask(group_ids, traj_ids, rewards)))


def add_advantages(batch: pa.Table, *, estimator: str, params: dict[str, Any], penalty: float,
                   dynamic_sampling: bool) -> pa.Table:
    """map_batches over one block (whole groups): the estimator's advantage of every row."""
    rewards, group_ids, traj_ids = _rewards_and_ids(batch, penalty)
    anchors = np.asarray(batch["anchor"].to_pylist(), dtype=object)
    actions = np.asarray(batch["action"].to_pylist(), dtype=object) if "action" in batch.column_names else None
    advantages = compute_advantages(estimator, group_ids, traj_ids, anchors, rewards, actions=actions, **params)
    table = batch.append_column("advantage", pa.array(advantages, pa.float32()))
    return _keep_informative_groups(table, group_ids, traj_ids, rewards, dynamic_sampling)


def add_batch_values(batch: pa.Table, *, estimator: str, params: dict[str, Any], penalty: float,
                     dynamic_sampling: bool) -> pa.Table:
    """First pass of a whole-batch estimator over one block: each row's value and whether the statistics count it."""
    rewards, group_ids, traj_ids = _rewards_and_ids(batch, penalty)
    values, counted = WHOLE_BATCH[estimator].values(group_ids, traj_ids, rewards, **params)
    table = batch.append_column("_value", pa.array(values, pa.float64())).append_column(
        "_counted", pa.array(counted, pa.bool_()))
    return _keep_informative_groups(table, group_ids, traj_ids, rewards, dynamic_sampling)


def block_moments(batch: pa.Table) -> pa.Table:
    """The counted values' moments of one block: one row, merged on the controller (a few numbers per block)."""
    values = batch["_value"].to_numpy()[batch["_counted"].to_numpy(zero_copy_only=False)]
    m = Moments.of(values)
    return pa.table({"count": [m.count], "mean": [m.mean], "m2": [m.m2]})


def finish_advantages(batch: pa.Table, *, estimator: str, params: dict[str, Any], moments: dict[str, float]
                      ) -> pa.Table:
    advantages = WHOLE_BATCH[estimator].finish(batch["_value"].to_numpy(), Moments(**moments), **params)
    table = batch.drop_columns(["_value", "_counted"])
    return table.append_column("advantage", pa.array(advantages, pa.float32()))


def build_batch(tables: list[Any], algo: AlgorithmConfig) -> ray.data.MaterializedDataset:
    """The iteration's Dataset with an `advantage` column, from the actors' blocks (object refs of arrow tables)."""
    kwargs = {"estimator": algo.estimator, "params": algo.params, "penalty": algo.invalid_action_penalty,
              "dynamic_sampling": algo.dynamic_sampling}
    map_args = {"batch_size": None, "batch_format": "pyarrow", "zero_copy_batch": True, "num_cpus": _DATA_CPUS}
    ds = ray.data.from_arrow_refs(tables)
    if algo.estimator not in WHOLE_BATCH:
        return ds.map_batches(add_advantages, fn_kwargs=kwargs, **map_args).materialize()
    ds = ds.map_batches(add_batch_values, fn_kwargs=kwargs, **map_args).materialize()
    moments = Moments()
    for part in ds.map_batches(block_moments, **map_args).take_all():
        moments = moments.merge(Moments(part["count"], part["mean"], part["m2"]))
    finish = {"estimator": algo.estimator, "params": algo.params, "moments": moments.__dict__}
    return ds.map_batches(finish_advantages, fn_kwargs=finish, **map_args).materialize()


def shard_sizes(n_rows: int, n_shards: int) -> list[int]:
    """Rows per training worker: as equal as possible (sizes differ by at most one), none dropped."""
    return [len(part) for part in np.array_split(np.arange(n_rows), n_shards)]


def split_for_workers(ds: ray.data.Dataset, n_workers: int) -> list[ray.data.Dataset]:
    """One shard per worker that together hold every row (`Dataset.split(equal=True)` drops the remainder)."""
    bounds = np.cumsum(shard_sizes(ds.count(), n_workers))[:-1].tolist()
    return ds.split_at_indices(bounds) if bounds else [ds]

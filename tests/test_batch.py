"""The iteration's Ray Dataset (actors/batch.py) on a real local Ray cluster: whole-batch statistics do not depend on
how the rollout cut the batch into blocks (one per group as it streams), sync mode drops whole stale groups, and the
shards of the training workers keep every row."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from actors.config import AlgorithmConfig
from actors.env_group import RECORD_SCHEMA

pytestmark = pytest.mark.slow


def _records(n_groups: int, group_size: int, seed: int = 0) -> pa.Table:
    """Step records of `n_groups` groups, trajectories of 1-3 steps with random rewards."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {name: [] for name in RECORD_SCHEMA.names}
    for g in range(n_groups):
        for m in range(group_size):
            for step in range(int(rng.integers(1, 4))):
                rows["prompt_ids"].append([1, 2, 3])
                rows["response_ids"].append([4, 5])
                rows["rollout_logprobs"].append([-1.0, -1.0])
                rows["reward"].append(float(rng.integers(0, 3)))
                rows["valid"].append(bool(rng.random() < 0.8))
                rows["anchor"].append(f"s{rng.integers(0, 3)}")
                rows["action"].append("up")
                rows["group_id"].append(g)
                rows["traj_id"].append(g * group_size + m)
                rows["step"].append(step)
                rows["weight_version"].append(0)
                rows["env_seed"].append(2 * g)
                rows["sampling_seed"].append(g * group_size + m)
    return pa.table(rows, schema=RECORD_SCHEMA)


def _advantages(ds) -> dict[tuple[int, int], float]:
    df = ds.to_pandas()
    return {(int(t), int(s)): float(a) for t, s, a in zip(df["traj_id"], df["step"], df["advantage"], strict=True)}


def _batch(ray_cluster, blocks: list[pa.Table], algo: AlgorithmConfig, version: int | None = None):
    """As the controller builds it: each block prepared where it was made (its env-group actor), then the Dataset."""
    from actors.batch import build_batch, prepare_block

    return build_batch([ray_cluster.put(prepare_block(b, algo, version)) for b in blocks], algo)


def _per_group(table: pa.Table) -> list[pa.Table]:
    group = table["group_id"].to_numpy()
    return [table.filter(pa.array(group == g)) for g in np.unique(group)]


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline", "gigpo"])
def test_same_advantages_from_one_block_or_one_per_group(ray_cluster, estimator):
    """A rollout streams one block per group; advantages must not depend on it, whole-batch statistics
    included."""
    table = _records(n_groups=6, group_size=4)
    algo = AlgorithmConfig(estimator=estimator)
    one = _batch(ray_cluster, [table], algo)
    streamed = _batch(ray_cluster, _per_group(table)[::-1], algo)  # groups arrive in any order
    a, b = _advantages(one), _advantages(streamed)
    assert a.keys() == b.keys() and len(a) == len(table)
    np.testing.assert_allclose([a[k] for k in sorted(a)], [b[k] for k in sorted(a)], rtol=1e-6, atol=1e-7)
    if estimator.startswith("reinforce_pp"):  # whitened over the whole batch, not per block
        values = np.array(list(a.values()))
        assert abs(values.mean()) < 0.3 and values.std() > 0.5


def test_sync_mode_leaves_out_whole_groups_with_rows_of_other_weights(ray_cluster):
    table = _records(n_groups=3, group_size=2, seed=2)
    versions = np.zeros(table.num_rows, dtype=np.int64)
    versions[np.flatnonzero(table["group_id"].to_numpy() == 1)[-1]] = 7  # one row of group 1 from a lagging replica
    table = table.set_column(table.schema.get_field_index("weight_version"), "weight_version", pa.array(versions))
    kept = _batch(ray_cluster, _per_group(table), AlgorithmConfig(estimator="gigpo"), version=0).to_pandas()
    assert set(kept["group_id"]) == {0, 2}
    assert len(kept) == int((table["group_id"].to_numpy() != 1).sum())


@pytest.mark.parametrize("workers", [2, 3])
def test_shards_keep_every_row(ray_cluster, workers):
    from actors.batch import shard_sizes, split_for_workers

    ds = ray_cluster.data.from_arrow(_records(n_groups=3, group_size=3, seed=1))
    n = ds.count()
    shards = split_for_workers(ds, workers)
    sizes = [s.count() for s in shards]
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1 and sizes == shard_sizes(n, workers)
    assert sorted(r["traj_id"] * 10 + r["step"] for s in shards for r in s.take_all()) == sorted(
        r["traj_id"] * 10 + r["step"] for r in ds.take_all())

"""Throughput of the advantage estimators: rows per second of GiGPO (both modes, and with similarity-matched
anchors) and GRPO.

Synthetic batches shaped like agent RL: groups of 8 trajectories, episode lengths uniform in 1..50, one reward per
step (mostly 0, a success bonus at some episodes' last step, small penalties for invalid actions), and anchor
observations drawn from a small per-group pool of text states (every trajectory of a group starts in the same state,
and states recur within and across trajectories, as in Sokoban or ALFWorld).

Usage (from the repo root):  python benchmarks/bench_advantages.py [--quick]
Writes benchmarks/results/bench_advantages.json and prints a table. Best of 3 runs per setting.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run as a script from anywhere without installing the package

from algorithms import compute_gigpo_advantages, compute_grpo_advantages, step_group_stats  # noqa: E402

GROUP_SIZE = 8  # GiGPO paper's group size
MAX_STEPS = 50  # ALFWorld's step limit in the paper
STATES_PER_GROUP = 24  # size of each group's pool of anchor states
REPEATS = 3


def make_batch(n_rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A batch of about `n_rows` step rows (whole trajectories), rows of different trajectories interleaved."""
    rng = np.random.default_rng(seed)
    n_traj = max(GROUP_SIZE, int(n_rows / ((1 + MAX_STEPS) / 2)))
    n_traj -= n_traj % GROUP_SIZE
    lengths = rng.integers(1, MAX_STEPS + 1, size=n_traj)
    traj = np.repeat(np.arange(n_traj), lengths)
    group = traj // GROUP_SIZE
    position = np.arange(len(traj)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    # Anchor: the initial state at t = 0, then a state from the group's pool (skewed, so some states are common).
    state = np.where(position == 0, 0, 1 + np.minimum(rng.geometric(0.15, size=len(traj)), STATES_PER_GROUP - 1))
    board = "#######\n#  .  #\n#  $  #\n#  @  #\n#######\n"  # realistic text length (~50 chars)
    anchors = np.array(
        [f"{board}room {g} state {s}" for g, s in zip(group.tolist(), state.tolist(), strict=True)], dtype=object
    )
    is_last = np.zeros(len(traj), dtype=bool)
    is_last[np.cumsum(lengths) - 1] = True
    rewards = np.where(is_last & (rng.random(len(traj)) < 0.4), 10.0, 0.0) - 0.1 * (rng.random(len(traj)) < 0.1)
    # Interleave trajectories like a batch assembled from concurrent env workers: sort by (time step, random key);
    # a stable sort on the time step keeps each trajectory's rows in time order.
    order = np.lexsort((rng.random(len(traj)), position))
    return {
        "group_ids": group[order],
        "traj_ids": traj[order],
        "anchor_keys": anchors[order],
        "step_rewards": rewards[order],
    }


def best_of(fn, size: int, repeats: int = REPEATS) -> float:
    """Best wall time of `fn(batch)` over `repeats` runs, each on a freshly built (identical) batch: new string
    objects, so Python's cached string hashes do not flatter the later runs. Building the batch is not timed."""
    best = float("inf")
    for _ in range(repeats):
        batch = make_batch(size)
        start = time.perf_counter()
        fn(batch)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10k and 100k rows only")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "bench_advantages.json"))
    args = parser.parse_args()

    sizes = [10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000]
    settings = {
        "gigpo_mean_norm": lambda b: compute_gigpo_advantages(**b, mode="mean_norm"),
        "gigpo_mean_std_norm": lambda b: compute_gigpo_advantages(**b, mode="mean_std_norm"),
        "grpo": lambda b: compute_grpo_advantages(b["group_ids"], b["traj_ids"], b["step_rewards"]),
        # Near-duplicate anchor matching (MinHash). This batch's anchors differ by a few characters, so at 0.9 they
        # merge into few, large step groups: the number measures cost, not a realistic grouping.
        "gigpo_similarity_0.9": lambda b: compute_gigpo_advantages(**b, anchor_similarity=0.9),
    }
    results = []
    print(f"{'setting':<22}{'rows':>10}{'seconds':>10}{'rows/s':>14}")
    for size in sizes:
        batch = make_batch(size)
        stats = step_group_stats(batch["group_ids"], batch["anchor_keys"])
        for name, fn in settings.items():
            seconds = best_of(fn, size)
            n = len(batch["step_rewards"])
            results.append(
                {
                    "setting": name,
                    "rows": n,
                    "seconds": round(seconds, 4),
                    "rows_per_s": round(n / seconds),
                    "step_group_share": round(stats["step_group_share"], 3),
                }
            )
            print(f"{name:<22}{n:>10}{seconds:>10.3f}{n / seconds:>14,.0f}")

    report = {
        "benchmark": "bench_advantages",
        "quick": args.quick,
        "best_of": REPEATS,
        "group_size": GROUP_SIZE,
        "episode_lengths": f"uniform 1..{MAX_STEPS}",
        "anchor_pool_per_group": STATES_PER_GROUP,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

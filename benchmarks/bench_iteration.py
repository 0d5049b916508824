"""Where one training iteration's time goes, on the real training app (`serve run CONFIG`, as `make train`).

RL iterations of the config after a short warm start (600 steps; not part of any iteration), validation and
checkpoints at their configured cadence, then the split of the mean iteration (the first one, which warms things
up, is left out): rollout (of which generation: the slowest env-group actor's time waiting on the policy), dataset
build with advantages, training (of which forward + backward + optimizer step on the workers), weight broadcast,
and the validation and checkpoint time spread over the iterations. Goal: everything outside generation and the
forward/backward/optimizer step is at most 20% of an iteration.

Usage (from the repo root):  python benchmarks/bench_iteration.py [--config ...] [--iterations 20]
Writes benchmarks/results/bench_iteration.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import yaml
from bench_learning import REPO_ROOT, RESULTS, run_training


def split(records: list[dict]) -> dict[str, float]:
    rl = [r for r in records if r.get("phase") == "train"][1:]
    if not rl:
        raise RuntimeError("no RL iterations past the first one were recorded")

    def mean(key: str) -> float:
        return float(np.mean([r.get(key) or 0.0 for r in rl]))

    parts = {
        "generation": mean("time/generate_s"),
        "rollout_other": mean("time/rollout_s") - mean("time/generate_s"),
        "dataset_and_advantages": mean("time/dataset_s"),
        "train_update": mean("train/update_seconds"),
        "train_read_shard": mean("train/read_seconds"),
        "train_old_logprobs": mean("train/old_logprob_seconds"),
        "train_other": mean("time/train_s") - mean("train/update_seconds") - mean("train/read_seconds")
        - mean("train/old_logprob_seconds"),
        "broadcast": mean("time/broadcast_s"),
        "validation": mean("time/validation_s"),
        "checkpoint": mean("time/checkpoint_s"),
    }
    total = sum(parts.values())
    return {"seconds": parts, "share": {k: v / total for k, v in parts.items()}, "iteration_s": total,
            "outside_generation_and_update": 1 - (parts["generation"] + parts["train_update"]) / total,
            "iterations_measured": len(rl)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "serve_configs" / "train.yaml")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--name", default="bench_iteration")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    # A short warm start puts the policy in the regime RL runs in (short valid replies, episodes that end); an
    # untrained policy writes max_tokens of noise for max_steps steps and weighs generation and training differently.
    overrides = {"warm_start.steps": 600, "warm_start.eval_every": 600, "iterations": args.iterations, **{k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}}
    work = Path(tempfile.mkdtemp(prefix="raygent-bench-iteration-"))
    records, run = run_training(args.config, args.name, overrides, 1e6, work)
    result = {"config": str(args.config), "overrides": overrides, "run": run, **split(records)}
    for k, v in result["seconds"].items():
        print(f"{k:24s} {v:7.3f} s  {100 * result['share'][k]:5.1f}%")
    print(f"iteration {result['iteration_s']:.2f} s; outside generation and the update: "
          f"{100 * result['outside_generation_and_update']:.1f}% (goal <= 20%)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote benchmarks/results/{args.name}.json")


if __name__ == "__main__":
    main()

"""The GPU recipes (serve_configs/gpu/*.yaml) run on this CPU, at CPU size: each recipe as written, with the model
swapped for the built-in real one (`smollm2-135m`) and only sizes, devices and engine settings overridden (the
`--set` pairs below, in `args` and in `deployments`; `raygent train RECIPE --set ...` takes the same), trained for
2 iterations with a checkpoint each. What cannot run without CUDA is swapped for its CPU twin and listed in the
results (docs/real-model.md has the table):

    python benchmarks/bench_gpu_recipes_on_cpu.py                  # every recipe
    python benchmarks/bench_gpu_recipes_on_cpu.py --recipes sokoban --lora    # + the recipe with a LoRA adapter

Writes benchmarks/results/gpu_recipes_on_cpu.json: per recipe, whether it finished, its wall time, each iteration's
time split (rollout and its generation, dataset, update, weight sync, checkpoint, validation), the trainer/engine log-prob gap, held-out success and
the checkpoint's size. One recipe also runs in the suite (tests/test_train_e2e.py, through its lifecycle)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.launch import apply_overrides  # noqa: E402
from benchmarks.serve_process import serve_run  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "serve_configs" / "gpu"
RESULTS = REPO / "benchmarks" / "results" / "gpu_recipes_on_cpu.json"

# Every recipe, at CPU size: sizes (model, lengths, groups, steps, batches), devices (no GPU: the weight group's
# backend nccl -> gloo, its CPU twin) and engine settings (a KV cache in bytes, as vLLM's CPU backend sizes it).
# The algorithm, estimator, loss, optimizer settings, precision, rollout mode and memory stay as the recipe has them.
CPU_SIZE: dict[str, Any] = {
    "iterations": 2,
    "policy.model": "smollm2-135m",
    "policy.max_model_len": 1024,
    "policy.kv_cache_bytes": 256 * 2**20,
    "policy.max_batch_size": 16,
    "env.kwargs.max_steps": 2,
    "rollout.n_groups": 2,
    "rollout.group_size": 2,
    "rollout.num_env_actors": 1,
    "rollout.env_actor_cpus": 0.05,
    "rollout.max_tokens": 32,
    "rollout.requests_per_step": 1,
    "optim.minibatch_size": 16,
    "optim.micro_batch_size": 4,
    "trainer.use_gpu": False,
    "trainer.cpus_per_worker": 0.2,
    "weight_sync.backend": "gloo",
    "validation.every": 1,
    "validation.n_envs": 4,
    "validation.baseline_envs": 0,
    "checkpoint.every": 1,
    "checkpoint.keep": 1,
    "deployments.Policy.num_replicas": 1,
    "deployments.Policy.ray_actor_options": {"num_cpus": 0.25, "num_gpus": 0},
}
# Deployments some recipes add (the search recipe's retriever) shrink too.
EXTRA_DEPLOYMENTS: dict[str, Any] = {"Retriever": {"ray_actor_options": {"num_cpus": 0.1}}}
# What each recipe asks that this CPU replaces, and with what.
CUDA_ONLY = {
    "weight_sync.backend nccl": "gloo (the same collective path over TCP)",
    "vLLM CUDA graphs": "eager mode (vLLM's CPU backend always runs eagerly)",
    "policy.gpu_memory_utilization": "policy.kv_cache_bytes (the CPU backend's KV cache is sized in bytes)",
    "trainer.use_gpu / num_gpus": "CPU Train workers and CPU policy replicas",
}


def cpu_sized(recipe: Path, extra: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Serve config of `recipe` at CPU size, and the overrides that made it (`extra` on top of CPU_SIZE)."""
    spec = yaml.safe_load(recipe.read_text())
    (app,) = [a for a in spec["applications"] if a.get("import_path") == "app.train:build_train_app"]
    names = {d["name"] for d in app.get("deployments", [])}
    overrides = dict(CPU_SIZE)
    for name, fields in EXTRA_DEPLOYMENTS.items():
        if name in names:
            overrides.update({f"deployments.{name}.{k}": v for k, v in fields.items()})
    overrides.update(extra or {})
    return apply_overrides(spec, overrides), overrides


# `--lora`: the recipe trains a LoRA adapter instead of the full weights (only the adapter goes to the replicas).
LORA = {"policy.lora": {"rank": 8, "alpha": 16.0}}


def run_recipe(recipe: Path, work: Path, timeout_s: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    import httpx

    spec, overrides = cpu_sized(recipe, extra)
    args = spec["applications"][0]["args"]
    args["output_dir"] = str(work / "runs")
    started = time.perf_counter()
    result: dict[str, Any] = {"recipe": str(recipe.relative_to(REPO)), "overrides": overrides}
    try:
        with serve_run(spec, work, "/status", timeout_s=900) as url:
            while True:
                status = httpx.get(f"{url}/status", timeout=30).json()
                if status["done"]:
                    break
                if time.perf_counter() - started > timeout_s:
                    status = {**status, "phase": f"timed out after {timeout_s:.0f} s"}
                    break
                time.sleep(5)
            history = httpx.get(f"{url}/metrics/history", timeout=30).json()
    except SystemExit as e:  # the endpoint never came up
        return {**result, "phase": "failed", "error": str(e), "wall_s": time.perf_counter() - started}
    train = [r for r in history if r.get("phase") == "train"]
    checkpoint = Path(status["last_checkpoint"]) if status.get("last_checkpoint") else None
    return {**result, "phase": status["phase"], "error": status.get("error"), "iterations": status["iteration"],
            "wall_s": round(time.perf_counter() - started, 1),
            "weight_version": status.get("weight_version"),
            "checkpoint_mb": round(sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()) / 2**20, 1)
            if checkpoint and checkpoint.exists() else None,
            "per_iteration": [{k: r.get(k) for k in (
                "iteration", "time/iteration_s", "time/rollout_s", "time/generate_s", "time/dataset_s", "time/train_s",
                "time/broadcast_s", "time/checkpoint_s", "time/validation_s",
                "train/rollout_trainer_logprob_gap", "train/success_rate", "val/success_rate", "data/rows")}
                for r in train]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default=",".join(sorted(p.stem for p in RECIPES.glob("*.yaml"))))
    parser.add_argument("--lora", action="store_true", help="each recipe also with a LoRA adapter (NAME+lora)")
    parser.add_argument("--timeout-s", type=float, default=1800, help="per recipe")
    parser.add_argument("--work", default="/tmp/raygent-gpu-recipes-on-cpu")
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"recipes": {}}
    results["cpu_size"], results["cuda_only"] = CPU_SIZE, CUDA_ONLY
    runs = [(name, name, None) for name in args.recipes.split(",")]
    if args.lora:
        runs += [(f"{name}+lora", name, LORA) for name in args.recipes.split(",")]
    for name, recipe, extra in runs:
        work = Path(args.work) / name
        shutil.rmtree(work, ignore_errors=True)  # a run folder left from before would be resumed (resume: auto)
        work.mkdir(parents=True)
        print(f"{name}: running at CPU size ...", flush=True)
        results["recipes"][name] = result = run_recipe(RECIPES / f"{recipe}.yaml", work, args.timeout_s, extra)
        print(f"{name}: {result['phase']} after {result.get('iterations')} iterations in {result['wall_s']:.0f} s "
              f"{result.get('error') or ''}", flush=True)
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

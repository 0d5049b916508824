"""Rollout speed of the actor system, measured as ratios in one run:

1. Env steps/s through the full system (env-group actors + Policy replicas on Ray Serve) vs a single-process loop
   with the same engine and the same envs (one batched `generate` per step over every live env). Scaling with 1, 2
   and 4 env-group actors and 1 and 2 replicas, each the median of 3 rounds after a warm-up round (with their sample
   std and every round's ratio). Goal: the actor system reaches >= 0.8x the single process.
2. Prompt tokens per step against the step index: step-independent memory (what training uses) vs concatenating the
   full history, on a long episode (no Ray).

The envs, memory, model and sampling come from the training config (default: serve_configs/train.yaml, the embedded
default). Usage (from the repo root):  python benchmarks/bench_rollout.py [--config ...] [--quick]
Writes benchmarks/results/bench_rollout.json (and bench_rollout.png: prompt tokens vs step).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import envs  # noqa: E402
import memory  # noqa: E402
from actors.config import TrainConfig  # noqa: E402
from actors.episodes import Coalescer, play_all, policy_decider, run_sync  # noqa: E402
from actors.prompting import encode_prompt  # noqa: E402
from app.default_model import resolve_model  # noqa: E402
from app.engines import in_process_send, make_engine  # noqa: E402
from app.sft import build_config  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"


def load_config(path: Path) -> TrainConfig:
    return build_config(str(path), None, {})


def round_seeds(cfg: TrainConfig, n_groups: int, index: int) -> np.ndarray:
    """The rooms of round `index` (round 0 warms up), as iteration `index` of a run draws them: every round on new
    rooms, whose first prompts no engine has cached, in both the single process and the actor system."""
    return envs.group_seeds(cfg.seed, index, n_groups, "train")


def single_process(cfg: TrainConfig, model_path: str, n_groups: int, repeats: int) -> dict[str, Any]:
    """The baseline: one process, the same engine and the same episode runner (every env its own coroutine, the
    prompts waiting at one moment batched into one engine call), no actors and no Serve."""
    engine = make_engine(cfg.policy.engine, model_path, max_model_len=cfg.policy.max_model_len)
    sampling = {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                "max_tokens": cfg.rollout.max_tokens}
    def episodes(index: int):
        seeds = np.repeat(round_seeds(cfg, n_groups, index), cfg.rollout.group_size)  # members share the seed
        coalescer = Coalescer(in_process_send(engine))

        def make(i: int):
            decide = policy_decider(engine.tokenizer, coalescer.generate, sampling,
                                    max_model_len=cfg.policy.max_model_len, sampling_seed=i)
            return (envs.make(cfg.env.name, **cfg.env_kwargs), memory.make(cfg.memory.name, **cfg.memory.kwargs),
                    decide, int(seeds[i]), i)

        return run_sync(play_all(make, len(seeds)))

    rates = []
    for index in range(repeats + 1):  # round 0 warms the engine up
        started = time.perf_counter()
        steps = sum(len(e.steps) for e in episodes(index))
        if index:
            rates.append(steps / (time.perf_counter() - started))
    return {"env_steps_per_s": statistics.median(rates), "std": _std(rates), "runs": rates}


def actor_system(ray, cfg: TrainConfig, model_path: str, n_groups: int, actors: int, replicas: int, repeats: int,
                 route_by_group: bool | None = None) -> dict[str, Any]:
    """Env steps/s of `repeats` rollouts after a warm-up (`round_seeds`), the replicas' prefix-cache hit rate over
    them, and the share of a trajectory's later steps answered by its previous step's replica."""
    from ray import serve

    from actors.env_group import EnvGroupActor, read_rollout
    from app.policy import Policy

    route_by_group = cfg.rollout.route_by_group if route_by_group is None else route_by_group
    policy = serve.run(Policy.options(num_replicas=replicas, ray_actor_options={"num_cpus": 0.25}).bind(
        {"model": model_path, "engine": cfg.policy.engine, "max_model_len": cfg.policy.max_model_len}),
        name="bench-rollout", route_prefix=None)
    env_actors = [EnvGroupActor.options(num_cpus=cfg.rollout.env_actor_cpus).remote(
        cfg.env.name, cfg.env_kwargs, cfg.memory.name, cfg.memory.kwargs, model_path, policy,
        cfg.policy.max_model_len) for _ in range(actors)]
    ray.get([a.ready.remote() for a in env_actors])
    sampling = {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                "max_tokens": cfg.rollout.max_tokens}
    slices = [s for s in np.array_split(np.arange(n_groups), actors) if len(s)]

    def prefix_cache() -> dict[str, int]:
        # key k reaches replica k of the router's order: one `info` per replica
        infos = [policy.options(method_name="info").remote(affinity=k).result() for k in range(replicas)]
        caches = [i["prefix_cache"] or {"queries": 0, "hits": 0} for i in infos]
        return {key: sum(c[key] for c in caches) for key in ("queries", "hits")}

    async def one_round(index: int) -> tuple[list[dict[str, Any]], float]:
        seeds = round_seeds(cfg, n_groups, index)
        started = time.perf_counter()
        groups: list[dict[str, Any]] = []  # each group's counts, as its block streams in
        streams = [a.rollout.remote(seeds[s].tolist(), s.tolist(), cfg.rollout.group_size, sampling,
                                    cfg.rollout.requests_per_step, cfg.seed, index, route_by_group=route_by_group)
                   for a, s in zip(env_actors, slices, strict=False)]
        await asyncio.gather(*(read_rollout(s, lambda head, _: groups.append(head)) for s in streams))
        return groups, time.perf_counter() - started

    asyncio.run(one_round(0))  # warm-up
    before = prefix_cache()
    rounds = [asyncio.run(one_round(index)) for index in range(1, repeats + 1)]
    after = prefix_cache()
    for a in env_actors:
        ray.kill(a)
    serve.delete("bench-rollout")
    rates = [sum(m["steps"] for m in metrics) / seconds for metrics, seconds in rounds]
    parts = [m for metrics, _ in rounds for m in metrics]
    later, same = (sum(m[key] for m in parts) for key in ("later_steps", "same_replica_steps"))
    queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
    return {"actors": actors, "replicas": replicas, "route_by_group": route_by_group,
            "env_steps_per_s": statistics.median(rates), "std": _std(rates), "runs": rates,
            "prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else None,
            "same_replica_share": same / max(later, 1)}


def prompt_growth(cfg: TrainConfig, model_path: str, steps: int) -> dict[str, Any]:
    """Prompt tokens at each step of one long episode (random admissible actions), with the config's memory and
    the paper's SimpleMemory(k=2) vs the full history (every past observation and action in the prompt)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # The env's own prompt template, which shows the memory (the compact CPU-default template has no memory slot).
    kwargs = {k: v for k, v in cfg.env_kwargs.items() if k not in ("prompt_template", "task_description")}
    kwargs["max_steps"] = steps
    variants = {"config memory": (cfg.memory.name, cfg.memory.kwargs), "simple k=2": ("simple", {"k": 2}),
                "full history": ("simple", {"k": steps + 1})}
    out: dict[str, list[int]] = {}
    for label, (name, mem_kwargs) in variants.items():
        env, mem = envs.make(cfg.env.name, **kwargs), memory.make(name, **mem_kwargs)
        rng = np.random.default_rng(0)
        observation, info = env.reset(seed=0)
        lengths = []
        for _ in range(steps):
            lengths.append(len(encode_prompt(tokenizer, env, observation, mem.render())))
            actions = info.get("admissible_actions") or [""]
            next_observation, reward, terminated, truncated, info = env.step(
                f"<action>{actions[rng.integers(len(actions))]}</action>")
            mem.store(observation, info.get("action"), float(reward), info)
            observation = next_observation
            if terminated or truncated:
                observation, info = env.reset(seed=int(rng.integers(1 << 30)))  # keep the history, new room
        out[label] = lengths
    return out


def plot_growth(growth: dict[str, list[int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, lengths in growth.items():
        ax.plot(range(1, len(lengths) + 1), lengths, label=label)
    ax.set_xlabel("step index")
    ax.set_ylabel("prompt tokens")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("prompt length per step: step-independent memory vs full history")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _std(values: list[float]) -> float | None:
    """Sample std of the repeats (None for one)."""
    return statistics.stdev(values) if len(values) > 1 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "serve_configs" / "train.yaml")
    parser.add_argument("--quick", action="store_true", help="1 repeat, fewer layouts")
    args = parser.parse_args()
    cfg = load_config(args.config)
    model_path = resolve_model(cfg.policy.model)
    n_groups = cfg.rollout.n_groups
    repeats = 1 if args.quick else 3
    layouts = [(2, 2)] if args.quick else [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)]

    growth = prompt_growth(cfg, model_path, steps=50)
    results: dict[str, Any] = {"config": str(args.config), "env": cfg.env.name, "model": cfg.policy.model,
                               "episodes_per_round": n_groups * cfg.rollout.group_size, "machine_cpus": os.cpu_count(),
                               "prompt_tokens_by_step": growth}
    for label, lengths in growth.items():
        print(f"[prompt tokens] {label}: step 5 {lengths[4]}, step 50 {lengths[49]} "
              f"({lengths[49] / lengths[4]:.2f}x)", flush=True)

    single = single_process(cfg, model_path, n_groups, repeats)
    results["single_process"] = single
    print(f"[rollout] single process: {single['env_steps_per_s']:.0f} env steps/s", flush=True)

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        systems = []
        for actors, replicas in layouts:
            r = actor_system(ray, cfg, model_path, n_groups, actors, replicas, repeats)
            r["ratio_to_single_process"] = r["env_steps_per_s"] / single["env_steps_per_s"]
            r["ratio_runs"] = [rate / single["env_steps_per_s"] for rate in r["runs"]]
            systems.append(r)
            print(f"[rollout] {actors} env actors x {replicas} replicas: {r['env_steps_per_s']:.0f} env steps/s "
                  f"-> {r['ratio_to_single_process']:.2f}x single process (goal >= 0.8)", flush=True)
        results["actor_system"] = systems
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_rollout.json").write_text(json.dumps(results, indent=1) + "\n")
    plot_growth(growth, RESULTS / "bench_rollout.png")
    print("wrote benchmarks/results/bench_rollout.json and .png")


if __name__ == "__main__":
    main()

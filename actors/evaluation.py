"""What held-out episodes add up to, in one place: training's validation, `raygent eval` and the benchmarks read the
same report. No Ray in it.

Per episode (`episode_result`): seed, sample, won, return, steps, valid steps, how it ended, and what the env
reports of the task (ALFWorld's `task_type`, WebShop's `score`). Over many (`summarize`): success rate, mean
return, valid-action ratio, pass@k for every k up to the samples per seed (the unbiased estimator of Chen et al.,
2021, arXiv 2107.03374), and the same per task type.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from math import comb
from typing import Any

import numpy as np

from actors.conversation import STEP, AgentLoop
from actors.episodes import Episode, episode_sampling_seed


def episode_result(episode: Episode, sample: int = 0) -> dict[str, Any]:
    info = episode.final_info or {}
    result = {"seed": episode.seed, "sample": sample, "sampling_seed": episode.sampling_seed, "won": bool(episode.won),
              "return": float(episode.return_), "steps": len(episode.steps), "valid_steps": episode.valid_steps,
              "ended": episode.ended, "task_type": info.get("task_type")}
    if "score" in info:  # WebShop: the purchase's score out of 100
        result["score"] = float(info["score"])
    return result


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn from n, of which c succeeded, succeeds)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _summary(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    steps = sum(r["steps"] for r in results)
    out: dict[str, Any] = {
        "episodes": len(results), "success_rate": float(np.mean([r["won"] for r in results])) if results else 0.0,
        "return": float(np.mean([r["return"] for r in results])) if results else 0.0,
        "episode_length": steps / max(1, len(results)),
        "valid_action_ratio": sum(r["valid_steps"] for r in results) / max(1, steps),
        "prompt_too_long": sum(r["ended"] == "prompt_too_long" for r in results)}
    scores = [r["score"] for r in results if "score" in r]
    if scores:
        out["score"] = float(np.mean(scores))
    by_seed: dict[int, list[bool]] = defaultdict(list)
    for r in results:
        by_seed[r["seed"]].append(r["won"])
    n = min((len(v) for v in by_seed.values()), default=0)
    for k in range(1, n + 1):
        out[f"pass@{k}"] = float(np.mean([pass_at_k(len(v), sum(v), k) for v in by_seed.values()]))
    return out


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The report's numbers: over all episodes, and per task type where the env reports one."""
    out = _summary(results)
    tasks = sorted({r["task_type"] for r in results if r.get("task_type")})
    if tasks:
        out["per_task"] = {t: _summary([r for r in results if r.get("task_type") == t]) for t in tasks}
    return out


async def play_heldout(make_env: Any, make_memory: Any, tokenizer: Any, generate: Any, seeds: Sequence[int], *,
                       samples: int, sampling: dict[str, Any], max_model_len: int, run_seed: int = 0,
                       seed_offset: int = 0, max_steps: int | None = None,
                       on_episode: Any = None, loop: AgentLoop = STEP) -> list[dict[str, Any]]:
    """Held-out episodes of a policy, `samples` per seed, all concurrent (the episode runner); one result each.
    Seed k of the whole evaluation (`seed_offset + k`) and sample j fix the episode's sampling seed, so the same
    evaluation replays wherever it runs: in training's validation, `raygent eval`, `raygent sft`, `/v1/episodes`.
    `make_env(i)` gives the env for episode i (a pool may reuse them), `make_memory()` a fresh memory; `loop` is the
    agent loop training used (step or conversation)."""
    from actors.episodes import play_all, policy_decider

    env_seeds = [int(s) for s in seeds for _ in range(samples)]
    index = [seed_offset + k for k in range(len(seeds)) for _ in range(samples)]
    sample = [j for _ in seeds for j in range(samples)]
    sampling_seeds = [heldout_sampling_seed(run_seed, k, j) for k, j in zip(index, sample, strict=True)]

    def make(i: int):
        decide = policy_decider(tokenizer, generate, sampling, max_model_len=max_model_len,
                                sampling_seed=sampling_seeds[i], loop=loop)
        return make_env(i), make_memory(), decide, env_seeds[i], sampling_seeds[i]

    episodes = await play_all(make, len(env_seeds), max_steps=max_steps, on_episode=on_episode)
    return [episode_result(e, sample=j) for e, j in zip(episodes, sample, strict=True)]


def heldout_sampling_seed(run_seed: int, seed_index: int, sample: int) -> int:
    """The sampling seed of held-out episode (seed k, sample j) of a run: the same in every validation round, so
    checkpoints of one run are compared on the same draws (common random numbers)."""
    return episode_sampling_seed(run_seed, 0, seed_index, sample, split=1)

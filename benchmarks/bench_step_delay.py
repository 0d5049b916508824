"""Lockstep vs event-driven episodes on envs whose step time varies, in one process with the same engine.

The envs of the training config, each step followed by a random wait (exponential, mean `--delays` ms): what a
step that calls a service costs (a search engine, a tool server, ALFWorld's planner). Both sides run the one episode
runner (`actors.episodes.play_all`) on the same rooms and sampling seeds; only the scheduling of the policy calls
differs:

- event-driven (what rollouts do): each env sends its next prompt as soon as its own step is done; the prompts
  waiting at one moment go out together (`Coalescer`);
- lockstep (the old runner): one batched call per step, sent once every live env has finished its step, so every
  step waits for the slowest env.

Usage (from the repo root):  python benchmarks/bench_step_delay.py [--delays 0,20,100] [--rounds 3]
Writes benchmarks/results/bench_step_delay.json: env steps/s per delay and side (median of the rounds, all rounds)
and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from actors.episodes import Coalescer, play_all, policy_decider  # noqa: E402
from app.default_model import resolve_model  # noqa: E402
from app.engines import in_process_send, make_engine  # noqa: E402
from app.sft import build_config  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"


class DelayedEnv:
    """An env whose every step ends with a wait of `rng.exponential(mean_s)` that does not block the event loop."""

    def __init__(self, env: Any, mean_s: float, rng: np.random.Generator):
        self._env, self._mean_s, self._rng = env, mean_s, rng

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    async def astep(self, reply: str):
        result = await self._env.astep(reply)
        if self._mean_s > 0:
            await asyncio.sleep(float(self._rng.exponential(self._mean_s)))
        return result


class Lockstep:
    """`generate` for the lockstep runner: the prompts are held until no live episode is still stepping, then sent
    as one batch. `stepping` counts episodes between a reply (or their start) and their next prompt (or their end)."""

    def __init__(self, send: Any, n: int):
        self.send, self.stepping, self._pending = send, n, []

    async def generate(self, prompt: list[int], sampling: dict[str, Any]) -> dict[str, Any]:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((prompt, sampling, future))
        self.stepping -= 1
        self._maybe_flush()
        return await future

    def episode_ended(self, _index: int, _episode: Any) -> None:
        self.stepping -= 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if self.stepping == 0 and self._pending:
            items, self._pending = self._pending, []
            self.stepping = len(items)
            asyncio.ensure_future(self._request(items))

    async def _request(self, items: list[tuple[list[int], dict[str, Any], asyncio.Future]]) -> None:
        replies = await self.send([p for p, _, _ in items], [s for _, s, _ in items])
        for (_, _, future), reply in zip(items, replies, strict=True):
            future.set_result(reply)


def one_round(cfg: Any, engine: Any, seeds: np.ndarray, delay_s: float, lockstep: bool) -> float:
    sampling = {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                "max_tokens": cfg.rollout.max_tokens}
    send = in_process_send(engine)
    scheduler = Lockstep(send, len(seeds)) if lockstep else Coalescer(send)

    def make(i: int):
        decide = policy_decider(engine.tokenizer, scheduler.generate, sampling,
                                max_model_len=cfg.policy.max_model_len, sampling_seed=i)
        env = DelayedEnv(envs.make(cfg.env.name, **cfg.env_kwargs), delay_s, np.random.default_rng(i))
        return env, memory.make(cfg.memory.name, **cfg.memory.kwargs), decide, int(seeds[i]), i

    async def play() -> list[Any]:
        return await play_all(make, len(seeds), on_episode=scheduler.episode_ended if lockstep else None)

    started = time.perf_counter()
    episodes = asyncio.run(play())
    return sum(len(e.steps) for e in episodes) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "serve_configs" / "train.yaml")
    parser.add_argument("--delays", default="0,20,100", help="mean extra step time, ms")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cfg = build_config(str(args.config), None, {})
    engine = make_engine(cfg.policy.engine, resolve_model(cfg.policy.model), max_model_len=cfg.policy.max_model_len)
    n = cfg.rollout.n_groups * cfg.rollout.group_size
    results: dict[str, Any] = {"config": str(args.config), "episodes_per_round": n, "engine": engine.name,
                               "rounds": args.rounds, "delays_ms": {}}
    one_round(cfg, engine, np.arange(n) // cfg.rollout.group_size, 0.0, False)  # warm-up
    for delay_ms in (float(d) for d in args.delays.split(",")):
        rates: dict[str, list[float]] = {"event_driven": [], "lockstep": []}
        for r in range(args.rounds):  # alternating sides, each round on new rooms, the same for both sides
            seeds = envs.group_seeds(cfg.seed, r + 1, cfg.rollout.n_groups, "train")
            seeds = np.repeat(seeds, cfg.rollout.group_size)
            for side in rates:
                rates[side].append(one_round(cfg, engine, seeds, delay_ms / 1000, side == "lockstep"))
        medians = {side: statistics.median(v) for side, v in rates.items()}
        results["delays_ms"][str(int(delay_ms))] = {
            "env_steps_per_s": medians, "rounds": rates,
            "event_driven_over_lockstep": medians["event_driven"] / medians["lockstep"]}
        print(f"delay {delay_ms:.0f} ms: event-driven {medians['event_driven']:.0f}, lockstep "
              f"{medians['lockstep']:.0f} env steps/s ({medians['event_driven'] / medians['lockstep']:.2f}x)",
              flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_step_delay.json").write_text(json.dumps(results, indent=1) + "\n")
    print("wrote benchmarks/results/bench_step_delay.json")


if __name__ == "__main__":
    main()

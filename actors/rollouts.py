"""The run's env-group actors and the work the controller spreads over them: rollouts (each group's block streams
back as it finishes, prepared for the trainer by the actor that played it), held-out validation, demonstrations for
the warm start. A failed actor's share is redone once on the restarted actor (a streamed rollout keeps the groups it
delivered), then dropped and counted; the run goes on with what the others produced."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import ray

import envs
from actors.config import TrainConfig
from actors.env_group import EnvGroupActor, read_rollout
from actors.evaluation import summarize

logger = logging.getLogger("raygent")


def overlap_share(spans: list[list[float | None]], start: float, end: float) -> float:
    """The share of [start, end] covered by the union of `spans` ([begin, end], end None while still running)."""
    covered, reach = 0.0, start
    for a, b in sorted((max(a, start), min(end if b is None else b, end)) for a, b in spans):
        if b > max(a, reach):
            covered += b - max(a, reach)
            reach = b
    return covered / max(end - start, 1e-9)


def rollout_metrics(parts: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    """One record of a rollout's (or validation's) closing records: one per group, per actor, and the rollout's
    own (its seconds, its redone and dropped groups)."""

    def total(key: str) -> float:
        return float(sum(p.get(key, 0) for p in parts))

    episodes, steps = max(total("episodes"), 1), max(total("steps"), 1)
    seconds = max(max((p.get("seconds", 0.0) for p in parts), default=0.0), 1e-9)
    out = {f"{prefix}/success_rate": total("won") / episodes, f"{prefix}/return": total("return_sum") / episodes,
           f"{prefix}/episode_length": total("steps") / episodes,
           f"{prefix}/valid_action_ratio": total("valid_steps") / steps, f"{prefix}/episodes": int(total("episodes"))}
    if prefix == "train":
        out.update({"perf/env_steps_per_s": total("steps") / seconds,
                    # the slowest actor's time waiting on the policy: generation as the rollout saw it
                    "time/generate_s": max((p.get("generate_seconds", 0.0) for p in parts), default=0.0),
                    "perf/tokens_per_s": total("generated_tokens") / seconds,
                    "perf/prompt_tokens_per_step": total("prompt_tokens") / steps,
                    # a trajectory's steps kept on one replica (`rollout.route_by_group`): its prefix cache hits
                    "perf/same_replica_share": total("same_replica_steps") / max(total("later_steps"), 1),
                    # replicas that answered this rollout (autoscaling adds and removes them mid-run)
                    "perf/replicas_answering": len({r for p in parts for r in p.get("replica_steps", {})}),
                    "faults/rerolled_groups": int(total("rerolled_groups")),
                    "faults/dropped_groups": int(total("dropped_groups")),
                    "faults/prompt_too_long": int(total("prompt_too_long")),
                    "train/token_budget_endings": int(total("token_budget")),
                    "faults/env_errors": int(total("env_errors")),
                    "faults/agent_errors": int(total("agent_errors")),
                    "faults/agent_timeouts": int(total("agent_timeouts")),
                    "faults/agent_no_calls": int(total("agent_no_calls")),
                    "faults/stale_rows": int(total("stale_rows"))})
        if total("agent_trajectories"):
            out["train/gateway_merged_share"] = total("agent_merged") / total("agent_trajectories")
    return out


class EnvGroupPool:
    """`rollout.num_env_actors` env-group actors (Ray restarts a dead one; one that cannot come back is replaced)
    that load their tokenizer from `model_path` and sample from the `policy` deployment."""

    def __init__(self, cfg: TrainConfig, model_path: str, policy: Any, retriever: Any = None):
        self.cfg, self.model_path, self.policy, self.retriever = cfg, model_path, policy, retriever
        self.actors: list[Any] = []
        self._revivals: dict[int, asyncio.Lock] = {}
        self._spans: list[list[float | None]] = []  # each rollout's [start, end or None while running]

    async def start(self) -> None:
        self.actors = [self._make() for _ in range(self.cfg.rollout.num_env_actors)]
        await asyncio.gather(*(a.ready.remote() for a in self.actors))

    def stop(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []

    def _make(self) -> Any:
        cfg = self.cfg
        return EnvGroupActor.options(num_cpus=cfg.rollout.env_actor_cpus, resources=cfg.placement.env_actors,
                                     runtime_env={"env_vars": {
                                         "RAYGENT_FRAMEWORK_LOG_LEVEL": cfg.logging.framework_level}}).remote(
            cfg.env.name, cfg.env_kwargs, cfg.memory.name, cfg.memory.kwargs, self.model_path, self.policy,
            cfg.policy.max_model_len, self.retriever, cfg.rollout.policy_timeout_s, cfg.agent_loop,
            cfg.agent.model_dump() if cfg.agent else None)

    async def _revive(self, k: int) -> None:
        """Wait for Ray to restart actor `k` (max_restarts=-1); replace it if it cannot come back. One revival per
        actor at a time: in async mode two rollouts may have lost the same actor."""
        async with self._revivals.setdefault(k, asyncio.Lock()):
            try:
                await asyncio.wait_for(self.actors[k].ready.remote(), timeout=60)
            except Exception:
                self.actors[k] = self._make()
                await asyncio.wait_for(self.actors[k].ready.remote(), timeout=300)

    async def _on_actors(self, n: int, call: Callable[[Any, np.ndarray], Awaitable[Any]], what: str,
                         pending: Callable[[np.ndarray], np.ndarray] | None = None) -> tuple[list[Any], list[int]]:
        """Spread items 0..n-1 over the actors: `call(actor, part)` for each slice. A failed actor's slice is redone
        once on the restarted actor, then dropped and counted. `pending(part)`: the items of a slice still to do (a
        streamed rollout keeps the groups a failed actor finished, and its `call` plays only the rest). Returns the
        results of the calls that finished and (redone, dropped) item counts."""
        slices = [s for s in np.array_split(np.arange(n), len(self.actors)) if len(s)]
        faults = [0, 0]

        async def one(k: int, part: np.ndarray):
            for attempt in range(2):
                try:
                    return await call(self.actors[k], part)
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                    lost = len(part if pending is None else pending(part))
                    logger.warning("env-group actor %d failed (%s); %s %d of its %d %s", k, type(e).__name__,
                                   "redoing" if attempt == 0 else "dropping", lost, len(part), what)
                    faults[0 if attempt == 0 else 1] += lost
                    if isinstance(e, ray.exceptions.RayActorError):
                        await self._revive(k)
            return None

        done = await asyncio.gather(*(one(k, part) for k, part in enumerate(slices)))
        return [d for d in done if d is not None], faults

    def _sampling(self, temperature: float) -> dict[str, Any]:
        r = self.cfg.rollout
        return {"temperature": temperature, "top_p": r.top_p, "max_tokens": r.max_tokens}

    # ---- the work --------------------------------------------------------------------------------------------
    async def rollout(self, it: int, expected_version: int | None) -> tuple[list[Any], list[dict[str, Any]],
                                                                            tuple[float, float]]:
        """Iteration `it`'s groups, spread over the actors. Each group's block streams back as the group finishes,
        prepared for the trainer by its actor (`actors.batch.prepare_block`: its advantages) while the other groups
        still play; `expected_version`: the weight version every row must carry (sync mode; rows of other weights
        are left out and counted), None when versions move during the rollout (async). Returns the prepared blocks
        (object refs, never fetched here), the rollout's closing records (`rollout_metrics` reads them), and when it
        ran."""
        cfg = self.cfg
        seeds = envs.group_seeds(cfg.seed, it, cfg.rollout.n_groups, "train")
        span = [time.perf_counter(), None]
        self._spans.append(span)
        prepared: dict[int, Any] = {}
        parts: list[dict[str, Any]] = []

        def on_group(head: dict[str, Any], block: Any) -> None:
            prepared[head["group"]] = block
            parts.append(head)

        def pending(part: np.ndarray) -> np.ndarray:
            return np.array([g for g in part if g not in prepared], dtype=np.int64)

        async def call(actor: Any, part: np.ndarray):
            todo = pending(part)  # a redo plays only the groups the failed actor had not finished
            if not len(todo):
                return
            stream = actor.rollout.remote(
                seeds[todo].tolist(), todo.tolist(), cfg.rollout.group_size, self._sampling(cfg.rollout.temperature),
                cfg.rollout.requests_per_step, cfg.seed, it, expected_version, cfg.rollout.route_by_group,
                cfg.algorithm)
            parts.append(await read_rollout(stream, on_group))

        try:
            _, faults = await self._on_actors(len(seeds), call, "groups", pending)
        finally:
            span[1] = time.perf_counter()
        # the rollout's own span times it (an actor that failed sent no closing record with its seconds)
        parts.append({"rerolled_groups": faults[0], "dropped_groups": faults[1], "seconds": span[1] - span[0]})
        return [prepared[g] for g in sorted(prepared)], parts, (span[0], span[1])

    def overlap(self, start: float, end: float) -> float:
        """The share of [start, end] (an update) during which some rollout was running."""
        share = overlap_share(self._spans, start, end)
        # the same span objects stay: a running rollout sets its end in place
        self._spans = [s for s in self._spans if s[1] is None or s[1] > end]
        return share

    async def validate(self, seeds: np.ndarray) -> dict[str, Any]:
        """The held-out evaluation (`actors.evaluation`, as `raygent eval` runs it) on `seeds`: its `val/` record."""
        t0 = time.perf_counter()
        cfg = self.cfg

        async def call(actor: Any, part: np.ndarray):
            return await actor.evaluate.remote(seeds[part].tolist(), cfg.validation.samples,
                                               self._sampling(cfg.validation.temperature), cfg.validation_env_kwargs,
                                               cfg.seed, int(part[0]))

        parts, faults = await self._on_actors(len(seeds), call, "held-out seeds")
        report = summarize([r for part in parts for r in part])
        record = {f"val/{k}": v for k, v in report.items() if k != "per_task"}
        for task, numbers in report.get("per_task", {}).items():
            record[f"val/{task}/success_rate"] = numbers["success_rate"]
        record["faults/dropped_val_seeds"] = faults[1]
        record["time/validation_s"] = time.perf_counter() - t0
        return record

    async def random_policy_success(self, seeds: np.ndarray) -> float:
        """A uniformly random admissible action's success on `seeds`: the floor RL must beat."""
        return await self.actors[0].random_policy_success.remote(seeds.tolist(), self.cfg.seed,
                                                                  self.cfg.validation_env_kwargs)

    async def demonstrations(self, players: list[tuple[Any, int]]) -> tuple[list[Any], int]:
        """Warm-start demonstrations, `players[k]` = (seeds, rng seed) on actor k: their Arrow tables (object refs)
        and how many rows they hold."""
        ws = self.cfg.warm_start
        calls = [a.demonstrations.remote(seeds, ws.expert_prob, rng_seed)
                 for a, (seeds, rng_seed) in zip(self.actors, players, strict=False)]
        n_rows = sum(m["rows"] for m in await asyncio.gather(*(m for _, m in calls)))
        return [t for t, _ in calls], n_rows

"""Env-group actors: long-lived Ray actors that each host a slice of the environment groups with their memory
modules, play them against the policy deployment with the one episode runner (`actors.episodes`), and emit one
step record per (env, step).

Every env is its own coroutine: it sends its next prompt as soon as its own reply has come back and its own step is
done. The prompts waiting at one moment go to the policy together (`Coalescer`), split over a few concurrent
requests so the replicas share the work. A rollout streams (a Ray generator): each group's records leave as one
pyarrow block the moment the group's last episode ends, so the controller prepares them for the trainer while the
other groups still play, and an actor that dies mid-rollout has lost only the groups it had not finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import ray

import envs
import memory
from actors.batch import prepare_block
from actors.config import AlgorithmConfig
from actors.conversation import STEP, AgentLoop
from actors.demonstrations import play_demonstrations
from actors.episodes import (
    Coalescer,
    Episode,
    Lanes,
    episode_metrics,
    episode_sampling_seed,
    play,
    play_all,
    policy_decider,
    random_decider,
)
from actors.evaluation import episode_result, play_heldout
from actors.gateway import AgentTrajectory, Gateway, load_function, play_agent
from actors.metrics import quiet_frameworks
from actors.retrieval import attach_retriever
from actors.storage import local_folder

logger = logging.getLogger("raygent")

RECORD_SCHEMA = pa.schema([
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("rollout_logprobs", pa.list_(pa.float32())),
    ("reward", pa.float32()),
    ("valid", pa.bool_()),
    ("anchor", pa.string()),
    ("action", pa.string()),  # the parsed action (None when invalid): HGPO's history keys may include it
    ("group_id", pa.int64()),
    ("traj_id", pa.int64()),
    ("step", pa.int32()),
    ("weight_version", pa.int64()),
    ("env_seed", pa.int64()),  # with sampling_seed and the weights: the episode replays exactly (/v1/episodes)
    ("sampling_seed", pa.int64()),
])


class EnvPool:
    """Env instances reused across rollouts (some are costly to build), one episode at a time each: `take(n,
    kwargs)` lends n envs that no other running rollout or evaluation holds (async mode runs several at once on one
    actor), building more when none is free, and takes them back when the block ends."""

    def __init__(self, build: Callable[[dict[str, Any]], Any]):
        self._build = build
        self._free: dict[str, list[Any]] = {}

    @contextlib.contextmanager
    def take(self, n: int, kwargs: dict[str, Any]) -> Iterator[list[Any]]:
        free = self._free.setdefault(repr(sorted(kwargs.items())), [])
        lent = [free.pop() if free else self._build(kwargs) for _ in range(n)]
        try:
            yield lent
        finally:
            free.extend(lent)


# Conversation mode: one row per assistant turn, the conversation's token lists on its first turn's row (the others'
# lists are empty) and each turn's span in them; `actors.batch.conversation_rows` makes them one row per conversation.
# A user's agent through the gateway may make several conversations of one trajectory: each starts a row of its own.
TURN_SCHEMA = RECORD_SCHEMA.append(pa.field("loss_mask", pa.list_(pa.int8()))).append(
    pa.field("turn_start", pa.int32())).append(pa.field("turn_end", pa.int32()))


def _turn_places(episode: Episode, group_id: int) -> dict[int, tuple[Any, tuple[int, int], list[int] | None]]:
    """Each step's conversation, its span there, and on the conversation's first step its loss mask (replies of a
    step the env never took, a loop that replied and then hit a limit, stay as context, untrained)."""
    places: dict[int, tuple[Any, tuple[int, int], list[int] | None]] = {}
    for conversation in episode.conversations:
        steps = sorted(set(conversation.steps))
        spans = dict(zip(steps, conversation.step_spans(), strict=True))
        taken = [k for k in steps if k < len(episode.steps)]
        if not taken:
            continue
        end = spans[taken[-1]][1]
        mask = conversation.loss_mask[:end] + [0] * (len(conversation.loss_mask) - end)
        for k in taken:
            places[k] = (conversation, spans[k], mask if k == taken[0] else None)
    if len(places) < len(episode.steps):
        raise ValueError(f"episode of group {group_id} has {len(episode.steps)} steps but its conversations "
                         f"answer {len(places)}")
    return places


def records_table(episodes: Sequence[Episode], group_id: int, group_size: int) -> pa.Table:
    """One group's step records (its episodes in member order) as a block of the iteration's Dataset; in
    conversation mode, and for a user's agent, its turn records (TURN_SCHEMA)."""
    turns = any(e.conversations for e in episodes)
    schema = TURN_SCHEMA if turns else RECORD_SCHEMA
    rows: dict[str, list] = {name: [] for name in schema.names}
    for member, episode in enumerate(episodes):
        places = _turn_places(episode, group_id) if turns and episode.steps else {}
        for k, s in enumerate(episode.steps):
            if turns:
                conversation, (start, end), mask = places[k]
                first = mask is not None
                rows["prompt_ids"].append(conversation.prompt_ids if first else [])
                rows["response_ids"].append(conversation.response_ids if first else [])
                rows["rollout_logprobs"].append(conversation.logprobs if first else [])
                rows["loss_mask"].append(mask if first else [])
                rows["turn_start"].append(start)
                rows["turn_end"].append(end)
            else:
                rows["prompt_ids"].append(s.prompt_ids)
                rows["response_ids"].append(s.response_ids)
                rows["rollout_logprobs"].append(s.logprobs)
            rows["reward"].append(s.reward)
            rows["valid"].append(s.valid)
            rows["anchor"].append(s.anchor)
            rows["action"].append(s.action)
            rows["group_id"].append(group_id)
            rows["traj_id"].append(group_id * group_size + member)
            rows["step"].append(s.step)
            rows["weight_version"].append(s.weight_version)
            rows["env_seed"].append(episode.seed)
            rows["sampling_seed"].append(episode.sampling_seed)
    return pa.table(rows, schema=schema)


async def read_rollout(stream: Any, on_group: Callable[[dict[str, Any], Any], None]) -> dict[str, Any]:
    """Read an `EnvGroupActor.rollout` stream of (block, header) pairs: `on_group(header, block_ref)` for each
    group the moment its header arrives (the rows stay in the object store; the caller owns the ref, so a block
    outlives the actor that made it); returns the rollout's closing record (the pair without a block). A block
    is stored before its header is sent, so a header that arrived names a block that exists. If the actor dies,
    its error is raised here after the groups it finished."""
    async for block in stream:
        head_ref = await anext(stream, None)
        if head_ref is None:  # the stream ended where a header was due: the item it ended on holds the error
            await block
            raise ray.exceptions.RayActorError(error_msg="the rollout stream ended without its closing record")
        head = await head_ref
        if "group" not in head:
            return head
        on_group(head, block)
    raise ray.exceptions.RayActorError(error_msg="the rollout stream ended without its closing record")


@ray.remote(max_restarts=-1, max_task_retries=0)
class EnvGroupActor:
    def __init__(self, env_name: str, env_kwargs: dict[str, Any], memory_name: str, memory_kwargs: dict[str, Any],
                 model_path: str, policy: Any, max_model_len: int, retriever: Any = None,
                 policy_timeout_s: float = 300.0, loop: AgentLoop = STEP, agent: dict[str, Any] | None = None):
        import os

        from transformers import AutoTokenizer

        quiet_frameworks(os.environ.get("RAYGENT_FRAMEWORK_LOG_LEVEL", "WARNING"))
        self.env_name, self.env_kwargs = env_name, env_kwargs
        self.memory_name, self.memory_kwargs = memory_name, memory_kwargs
        self.tokenizer = AutoTokenizer.from_pretrained(local_folder(model_path))
        self.policy = policy
        self.max_model_len = max_model_len
        self.loop = loop  # step or conversation (actors/conversation.py)
        self.policy_timeout_s = policy_timeout_s
        self.retriever = retriever  # the Retriever deployment's handle, for envs with `retriever: serve`
        self.agent = agent  # a user's agent (actors/gateway.py): its function plays the env's tasks
        self._gateway = Gateway()
        self._pool = EnvPool(lambda kwargs: attach_retriever(envs.make(self.env_name, **kwargs), kwargs,
                                                             self.retriever))

    def ready(self) -> bool:
        return True

    async def _send(self, prompts: list[list[int]], samplings: list[dict[str, Any]],
                    affinity: int | None = None) -> list[dict[str, Any]]:
        for attempt in range(2):  # one retry: a replica may be restarting
            try:
                # a deadline: an engine that stopped answering must not hang the rollout (and the run) forever
                reply = self.policy.generate.remote(prompts, samplings, affinity=affinity)
                return await asyncio.wait_for(reply, self.policy_timeout_s)
            except Exception as e:
                if attempt == 1:
                    raise
                logger.warning("policy call failed (%s); retrying once", e)
                await asyncio.sleep(1.0)
        raise AssertionError("unreachable")

    async def _play(self, seeds: Sequence[int], sampling_seeds: Sequence[int], groups: Sequence[int],
                    sampling: dict[str, Any], env_kwargs: dict[str, Any], chunks: int, route_by_group: bool,
                    on_episode: Callable[[int, Episode], None] | None = None) -> tuple[list[Episode], float]:
        if route_by_group or self.loop.kind == "conversation":  # a conversation stays on its prefix's replica
            lanes = Lanes(self._send, chunks)
            generate, busy = [lanes.for_group(g) for g in groups], lanes
        else:
            coalescer = Coalescer(self._send, chunks)
            generate, busy = [coalescer.generate] * len(seeds), coalescer
        with self._pool.take(len(seeds), env_kwargs) as games:
            if self.agent is not None:
                episodes = await self._play_agent(games, seeds, sampling_seeds, generate, sampling, on_episode)
                return episodes, busy.busy_seconds

            def make(i: int):
                decide = policy_decider(self.tokenizer, generate[i], sampling, max_model_len=self.max_model_len,
                                        sampling_seed=sampling_seeds[i], loop=self.loop)
                return (games[i], memory.make(self.memory_name, **self.memory_kwargs), decide, int(seeds[i]),
                        int(sampling_seeds[i]))

            episodes = await play_all(make, len(seeds), on_episode=on_episode)
        return episodes, busy.busy_seconds

    async def _play_agent(self, games: list[Any], seeds: Sequence[int], sampling_seeds: Sequence[int],
                          generate: Sequence[Any], sampling: dict[str, Any],
                          on_episode: Callable[[int, Episode], None] | None = None) -> list[Episode]:
        """The user's agent on each env's task (`actors.gateway.play_agent`), all at once, its calls through this
        actor's gateway."""
        await self._gateway.start()
        entrypoint = load_function(self.agent["entrypoint"], "agent.entrypoint")
        reward = load_function(self.agent["reward"], "agent.reward") if self.agent.get("reward") else None

        async def one(i: int) -> Episode:
            games[i].reset(seed=int(seeds[i]))
            task = games[i].task_row()
            task["extra_info"] = {**task.get("extra_info", {}), "seed": int(seeds[i])}  # it replays the task
            trajectory = AgentTrajectory(self.tokenizer, generate[i], sampling, budget=self.loop.max_tokens,
                                         max_model_len=self.max_model_len, sampling_seed=int(sampling_seeds[i]))
            episode = await play_agent(self._gateway, entrypoint, reward, trajectory, task,
                                       seed=int(seeds[i]), timeout_s=float(self.agent["timeout_s"]))
            if on_episode is not None:
                on_episode(i, episode)
            return episode

        episodes = list(await asyncio.gather(*(one(i) for i in range(len(seeds)))))
        failed = [e.final_info["agent_error"] for e in episodes if "agent_error" in e.final_info]
        if failed:
            logger.warning("%d of %d agent trajectories failed, e.g. %s", len(failed), len(episodes), failed[0])
        return episodes

    @ray.method(num_returns="streaming")
    async def rollout(self, seeds: Sequence[int], group_ids: Sequence[int], group_size: int,
                      sampling: dict[str, Any], requests_per_step: int = 2, run_seed: int = 0, round_index: int = 0,
                      expected_version: int | None = None, route_by_group: bool = False,
                      algorithm: AlgorithmConfig | None = None) -> AsyncIterator[Any]:
        """One episode per env of `len(seeds)` groups x `group_size` with the policy: group `group_ids[k]` starts
        every env from `seeds[k]`; trajectory id = group id * group_size + member; each episode's sampling seed
        comes from (run_seed, round_index, group id, member), so a group redone elsewhere plays the same draws.
        `route_by_group`: each group's requests keep to one replica (`Lanes`). With `algorithm`, each block is
        prepared for the trainer here (`actors.batch.prepare_block`: its advantages, and in sync mode the groups of
        other weights left out), milliseconds per group in a process that is already running, where a task of its
        own would first wait for a worker and a CPU share (seconds on a busy node).

        Streams, in the order groups finish, one pair per group: its block (the step records of its episodes,
        RECORD_SCHEMA), then its header (`{"group": id}` with the group's `episode_metrics` and its stale rows);
        last the pair (None, the rollout's own timing). `read_rollout` reads the stream."""
        started = time.perf_counter()
        groups = [int(g) for g in group_ids for _ in range(group_size)]
        members = [m for _ in group_ids for m in range(group_size)]
        env_seeds = [int(s) for s in seeds for _ in range(group_size)]
        sampling_seeds = [episode_sampling_seed(run_seed, round_index, g, m) for g, m in zip(groups, members,
                                                                                          strict=True)]
        ended: dict[int, Episode] = {}
        finished: asyncio.Queue[int] = asyncio.Queue()

        def on_episode(i: int, episode: Episode) -> None:
            ended[i] = episode
            first = i - i % group_size
            if all(j in ended for j in range(first, first + group_size)):
                finished.put_nowait(first // group_size)

        playing = asyncio.ensure_future(self._play(env_seeds, sampling_seeds, groups, sampling, self.env_kwargs,
                                                   requests_per_step, route_by_group, on_episode))
        for _ in range(len(group_ids)):
            next_group = asyncio.ensure_future(finished.get())
            await asyncio.wait([next_group, playing], return_when=asyncio.FIRST_COMPLETED)
            if next_group.done():
                k = next_group.result()
            else:
                next_group.cancel()
                await playing  # the episodes failed (the policy call's retry too): the error goes up from here
                k = finished.get_nowait()  # or they all ended: every group left is queued
            episodes = [ended[i] for i in range(k * group_size, (k + 1) * group_size)]
            block = records_table(episodes, int(group_ids[k]), group_size)
            # a replica that restarted and could not sync answers with other weights: counted here, dropped later
            stale = 0 if expected_version is None else int((block["weight_version"].to_numpy()
                                                            != expected_version).sum())
            yield block if algorithm is None else prepare_block(block, algorithm, expected_version)
            yield {"group": int(group_ids[k]), **episode_metrics(episodes), "stale_rows": stale}
        episodes, generate_seconds = await playing
        errors = [s.env_error for e in episodes for s in e.steps if s.env_error]
        if errors:
            logger.warning("%d env errors in this rollout, e.g. %s", len(errors), errors[0])
        yield None
        yield {"generate_seconds": generate_seconds, "seconds": time.perf_counter() - started}

    async def evaluate(self, seeds: Sequence[int], samples: int, sampling: dict[str, Any], env_kwargs: dict[str, Any],
                       run_seed: int = 0, seed_offset: int = 0) -> list[dict[str, Any]]:
        """Held-out episodes (`actors.evaluation.play_heldout`, the same as `raygent eval`): `samples` per seed with
        the held-out `env_kwargs`; one result per episode. Seed k of this slice is seed `seed_offset + k` of the whole
        evaluation, which fixes its sampling seeds."""
        coalescer = Coalescer(self._send, chunks=2)
        with self._pool.take(len(seeds) * samples, env_kwargs) as games:
            if self.agent is not None:
                env_seeds = [int(s) for s in seeds for _ in range(samples)]
                sampling_seeds = [episode_sampling_seed(run_seed, 0, seed_offset + k, j, split=1)
                                  for k in range(len(seeds)) for j in range(samples)]
                episodes = await self._play_agent(games, env_seeds, sampling_seeds,
                                                  [coalescer.generate] * len(env_seeds), sampling)
                return [episode_result(e, i % samples) for i, e in enumerate(episodes)]
            return await play_heldout(games.__getitem__,
                                      lambda: memory.make(self.memory_name, **self.memory_kwargs), self.tokenizer,
                                      coalescer.generate, seeds, samples=samples, sampling=sampling,
                                      max_model_len=self.max_model_len, run_seed=run_seed, seed_offset=seed_offset,
                                      loop=self.loop)

    @ray.method(num_returns=2)
    async def demonstrations(self, seeds: Sequence[int], expert_prob: float, rng_seed: int) -> tuple[pa.Table, dict]:
        """Warm-start data: states visited by a player that follows the env's expert with probability
        `expert_prob` (else a random admissible action), each labelled with the expert's action as the reply; in
        conversation mode whole conversations with the expert's turns masked in
        (`actors.demonstrations.make_demonstrations`, shared with `raygent sft`)."""
        rows = await play_demonstrations(self.tokenizer, self.env_name, self.env_kwargs, self.memory_name,
                                         self.memory_kwargs, seeds, expert_prob, rng_seed, loop=self.loop)
        types = {"prompt_ids": pa.list_(pa.int32()), "response_ids": pa.list_(pa.int32()),
                 "loss_mask": pa.list_(pa.int8())}
        table = pa.table({k: pa.array(v, types[k]) for k, v in rows.items()})
        return table, {"rows": table.num_rows, "episodes": len(seeds)}

    async def random_policy_success(self, seeds: Sequence[int], rng_seed: int, env_kwargs: dict[str, Any]) -> float:
        """Success rate of a uniformly random admissible action on these seeds: the floor RL must beat."""
        decide = random_decider(np.random.default_rng(rng_seed))
        wins = 0
        with self._pool.take(1, env_kwargs) as (env,):
            for seed in seeds:
                wins += (await play(env, memory.make("none"), decide, seed=int(seed))).won
        return wins / max(1, len(seeds))

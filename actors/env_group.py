"""Env-group actors: long-lived Ray actors that each host a slice of the environment groups with their memory
modules, play them against the policy deployment, and emit one step record per (env, step).

Prompts are step-independent (observation + bounded memory), tokenized here with the model's chat template, and sent
to the policy deployment as token ids: several concurrent requests per step so the replicas share the work. The
records of one rollout come back as one pyarrow block, which becomes a block of the iteration's Ray Dataset.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import ray

import envs
import memory
from actors.demonstrations import make_demonstrations
from actors.prompting import encode_prompt

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
])


@ray.remote(max_restarts=-1, max_task_retries=0)
class EnvGroupActor:
    def __init__(self, env_name: str, env_kwargs: dict[str, Any], memory_name: str, memory_kwargs: dict[str, Any],
                 model_path: str, policy: Any, max_model_len: int):
        from transformers import AutoTokenizer

        self.env_name, self.env_kwargs = env_name, env_kwargs
        self.memory_name, self.memory_kwargs = memory_name, memory_kwargs
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.policy = policy
        self.max_model_len = max_model_len

    def ready(self) -> bool:
        return True

    def _encode(self, env: Any, observation: str, mem: Any) -> list[int]:
        return encode_prompt(self.tokenizer, env, observation, mem.render())

    async def _generate(self, prompts: list[list[int]], sampling: dict[str, Any], chunks: int) -> list[dict]:
        parts = [p.tolist() for p in np.array_split(np.arange(len(prompts)), min(chunks, len(prompts)))]
        for attempt in range(2):  # one retry: a replica may be restarting
            try:
                replies = await asyncio.gather(*(self.policy.generate.remote([prompts[i] for i in part], sampling)
                                                 for part in parts if part))
                return [r for chunk in replies for r in chunk]
            except Exception as e:
                if attempt == 1:
                    raise
                logger.warning("policy call failed (%s); retrying once", e)
                await asyncio.sleep(1.0)
        raise AssertionError("unreachable")

    @ray.method(num_returns=2)
    async def rollout(self, seeds: Sequence[int], group_size: int, group_offset: int, sampling: dict[str, Any],
                      requests_per_step: int = 2, record: bool = True) -> tuple[pa.Table, dict[str, Any]]:
        """Play one episode per env of `len(seeds)` groups x `group_size` with the policy. Returns the step records
        (group ids start at `group_offset`; trajectory id = group_id * group_size + member) and rollout metrics."""
        started = time.perf_counter()
        groups = envs.EnvGroups(self.env_name, len(seeds), group_size, self.env_kwargs)
        observations, infos = groups.reset(seeds)
        mems = [memory.make(self.memory_name, **self.memory_kwargs) for _ in groups.envs]
        rows: dict[str, list] = {name: [] for name in RECORD_SCHEMA.names}
        n = len(groups)
        returns, lengths = np.zeros(n), np.zeros(n, dtype=np.int64)
        won, valid_steps = np.zeros(n, dtype=bool), 0
        too_long = 0
        gen_seconds, gen_tokens, prompt_tokens = 0.0, 0, 0
        while not groups.all_done:
            live = np.flatnonzero(~groups.done)
            prompts = [self._encode(groups.envs[i], observations[i], mems[i]) for i in live]
            fits = np.array([len(p) + sampling["max_tokens"] <= self.max_model_len for p in prompts])
            if not fits.all():  # counted and ended, never silently cut: the config's memory is too long
                too_long += int((~fits).sum())
                groups.done[live[~fits]] = True
                live, prompts = live[fits], [p for p, ok in zip(prompts, fits, strict=True) if ok]
                if len(live) == 0:
                    break
            t0 = time.perf_counter()
            replies = await self._generate(prompts, sampling, requests_per_step)
            gen_seconds += time.perf_counter() - t0
            step_replies: list[str | None] = [None] * n
            for i, r in zip(live, replies, strict=True):
                step_replies[i] = r["text"]
            next_obs, rewards, terminated, truncated, step_infos = groups.step(step_replies)
            for k, (i, r) in enumerate(zip(live, replies, strict=True)):
                info = step_infos[i]
                mems[i].store(observations[i], info.get("action"), float(rewards[i]), info)
                returns[i] += rewards[i]
                lengths[i] += 1
                valid_steps += bool(info["is_action_valid"])
                won[i] |= bool(info.get("won", False))
                gen_tokens += len(r["token_ids"])
                prompt_tokens += len(prompts[k])
                if record:
                    rows["prompt_ids"].append(prompts[k])
                    rows["response_ids"].append(r["token_ids"])
                    rows["rollout_logprobs"].append(r["logprobs"])
                    rows["reward"].append(float(rewards[i]))
                    rows["valid"].append(bool(info["is_action_valid"]))
                    rows["anchor"].append(str(infos[i]["anchor"]))
                    rows["action"].append(info.get("action"))
                    rows["group_id"].append(group_offset + i // group_size)
                    rows["traj_id"].append((group_offset + i // group_size) * group_size + i % group_size)
                    rows["step"].append(int(lengths[i] - 1))
                    rows["weight_version"].append(int(r["weight_version"]))
                observations[i], infos[i] = next_obs[i], info
        steps = int(lengths.sum())
        metrics = {
            "episodes": n, "won": int(won.sum()), "return_sum": float(returns.sum()), "steps": steps,
            "valid_steps": valid_steps, "prompt_too_long": too_long, "generate_seconds": gen_seconds,
            "generated_tokens": gen_tokens, "prompt_tokens": prompt_tokens,
            "seconds": time.perf_counter() - started, "won_per_env": won.tolist(),
        }
        return pa.table(rows, schema=RECORD_SCHEMA), metrics

    @ray.method(num_returns=2)
    def demonstrations(self, seeds: Sequence[int], expert_prob: float, rng_seed: int) -> tuple[pa.Table, dict]:
        """Warm-start data: states visited by a player that follows the env's expert with probability
        `expert_prob` (else a random admissible action), each labelled with the expert's action as the reply
        (`actors.demonstrations.make_demonstrations`, shared with `raygent sft`)."""
        prompts, responses = make_demonstrations(self.tokenizer, self.env_name, self.env_kwargs, self.memory_name,
                                                  self.memory_kwargs, seeds, expert_prob, rng_seed)
        table = pa.table({"prompt_ids": pa.array(prompts, pa.list_(pa.int32())),
                          "response_ids": pa.array(responses, pa.list_(pa.int32()))})
        return table, {"rows": len(prompts), "episodes": len(seeds)}

    def random_policy_success(self, seeds: Sequence[int], rng_seed: int) -> float:
        """Success rate of a uniformly random admissible action on these seeds: the floor RL must beat."""
        rng = np.random.default_rng(rng_seed)
        wins = 0
        for seed in seeds:
            env = envs.make(self.env_name, **self.env_kwargs)
            _, info = env.reset(seed=int(seed))
            for _ in range(env.max_steps):
                actions = info["admissible_actions"]
                action = actions[rng.integers(len(actions))] if actions else ""
                _, _, terminated, truncated, info = env.step(f"<action>{action}</action>")
                if terminated or truncated:
                    break
            wins += bool(info.get("won", False))
        return wins / max(1, len(seeds))

"""Warm-start data, without Ray: the env-group actors (the training app's warm start) and `raygent sft` both call
`make_demonstrations`, so the supervised stage sees the same states, prompts and labels wherever it runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

import envs
import memory
from actors.episodes import demonstration_decider, play, run_sync

# Demonstrations draw training seeds from an iteration index RL never reaches (`envs.group_seeds`).
DEMO_SEED_INDEX = 1_000_000


def demo_seeds(base_seed: int, n: int) -> np.ndarray:
    """The `n` reset seeds whose episodes become demonstrations in a run seeded `base_seed` (training split)."""
    return envs.group_seeds(base_seed, DEMO_SEED_INDEX, n, "train")


def demo_players(base_seed: int, n: int, n_players: int) -> list[tuple[list[int], int]]:
    """The demonstration seeds split over `n_players` players (the env-group actors), each with its own rng seed:
    the training app and `raygent sft` build the same demonstrations from the same config."""
    parts = [p for p in np.array_split(demo_seeds(base_seed, n), n_players) if len(p)]
    return [(part.tolist(), base_seed + k) for k, part in enumerate(parts)]


def expert_label(tokenizer: Any, action: str) -> list[int]:
    """The supervised reply: the expert's action in the env's tags, then EOS (where the engines stop)."""
    return tokenizer.encode(f"<action>{action}</action>", add_special_tokens=False) + [tokenizer.eos_token_id]


async def play_demonstrations(tokenizer: Any, env_name: str, env_kwargs: dict[str, Any], memory_name: str,
                              memory_kwargs: dict[str, Any], seeds: Sequence[int], expert_prob: float,
                              rng_seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, reply ids) for every state visited by a player that follows the env's expert with probability
    `expert_prob` (else a uniformly random admissible action, for state variety); each state is labelled with the
    expert's action. Episodes (the episode runner's, one after another) end when the env ends them or the expert
    has nothing to say. Deterministic in (`seeds`, `rng_seed`)."""
    decide = demonstration_decider(tokenizer, expert_prob, np.random.default_rng(rng_seed))
    env = envs.make(env_name, **env_kwargs)
    steps = []
    for seed in seeds:
        steps += (await play(env, memory.make(memory_name, **memory_kwargs), decide, seed=int(seed))).steps
    return [s.prompt_ids for s in steps], [expert_label(tokenizer, s.label) for s in steps]


def make_demonstrations(*args: Any) -> tuple[list[list[int]], list[list[int]]]:
    """`play_demonstrations` from synchronous code (`raygent sft`, benchmarks)."""
    return run_sync(play_demonstrations(*args))

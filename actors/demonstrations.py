"""Warm-start data, without Ray: the env-group actors (the training app's warm start) and `raygent sft` both call
`make_demonstrations`, so the supervised stage sees the same states, prompts and labels wherever it runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

import envs
import memory
from actors.conversation import STEP, AgentLoop, ConversationOver, next_turn
from actors.episodes import (
    ConversationDecider,
    Decision,
    Turn,
    action_reply,
    demonstration_decider,
    play,
    run_sync,
)

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


class ConversationDemonstrator(ConversationDecider):
    """`demonstration_decider` in conversation mode: the chosen action's reply (`expert_label`'s tokens) goes into the
    conversation; the turn is trained only where the expert chose it."""

    def __init__(self, tokenizer: Any, expert_prob: float, rng: np.random.Generator, budget: int):
        super().__init__(tokenizer, None, {"max_tokens": 1 << 20}, max_model_len=1 << 30, budget=budget)
        self.tokenizer, self.expert_prob, self.rng = tokenizer, expert_prob, rng

    async def __call__(self, turn: Turn) -> Decision | None:
        expert = turn.env.expert_action()
        if expert is None:
            return None
        actions = turn.info["admissible_actions"]
        follows = self.rng.random() < self.expert_prob or not actions
        action = expert if follows else actions[self.rng.integers(len(actions))]
        self.conversation, _ = next_turn(self.chat, self.conversation, self.messages(turn), budget=self.budget,
                                         reply_tokens=1, max_model_len=self.max_model_len, tools=self.tools(turn))
        ids = expert_label(self.tokenizer, action)
        if len(self.conversation.response_ids) + len(ids) > self.budget:
            raise ConversationOver("token_budget", "the demonstration's next reply does not fit")
        self.conversation.add_reply(ids, [0.0] * len(ids), 0, trained=bool(follows or action == expert))
        return Decision(action_reply(action), label=expert)


async def play_demonstrations(tokenizer: Any, env_name: str, env_kwargs: dict[str, Any], memory_name: str,
                              memory_kwargs: dict[str, Any], seeds: Sequence[int], expert_prob: float,
                              rng_seed: int, loop: AgentLoop = STEP) -> dict[str, list[list[int]]]:
    """Supervised rows from a player that follows the env's expert with probability `expert_prob` (else a uniformly
    random admissible action, for state variety). Step mode: one row per visited state, `prompt_ids` and as
    `response_ids` the expert's action there. Conversation mode (`loop`): one row per episode, the conversation as
    played, its `loss_mask` on the expert's turns only (a random turn stays in the history, untrained). Episodes
    (the episode runner's, one after another) end when the env ends them or the expert has nothing to say.
    Deterministic in (`seeds`, `rng_seed`)."""
    rng = np.random.default_rng(rng_seed)
    env = envs.make(env_name, **env_kwargs)
    if loop.kind == "conversation":
        rows: dict[str, list[list[int]]] = {"prompt_ids": [], "response_ids": [], "loss_mask": []}
        for seed in seeds:
            decide = ConversationDemonstrator(tokenizer, expert_prob, rng, budget=loop.max_tokens)
            c = (await play(env, memory.make("none"), decide, seed=int(seed))).conversation
            if c is not None and any(c.loss_mask):
                rows["prompt_ids"].append(c.prompt_ids)
                rows["response_ids"].append(c.response_ids)
                rows["loss_mask"].append(c.loss_mask)
        return rows
    decide = demonstration_decider(tokenizer, expert_prob, rng)
    steps = []
    for seed in seeds:
        steps += (await play(env, memory.make(memory_name, **memory_kwargs), decide, seed=int(seed))).steps
    return {"prompt_ids": [s.prompt_ids for s in steps],
            "response_ids": [expert_label(tokenizer, s.label) for s in steps]}


def make_demonstrations(*args: Any, **kwargs: Any) -> dict[str, list[list[int]]]:
    """`play_demonstrations` from synchronous code (`raygent sft`, benchmarks)."""
    return run_sync(play_demonstrations(*args, **kwargs))

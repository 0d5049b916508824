"""The one episode runner. Every place an agent plays an env uses it: training rollouts, validation and `raygent
eval`, the random-action baseline, the warm-start demonstrations, `raygent sft`'s evaluation, the agent endpoint's
`/v1/episodes` and `/v1/act`, `raygent play`, and the corpus the default tokenizer is trained on. No Ray in it.

An episode: reset (with its seed) -> for every step: show the decider a `Turn` (env, observation, memory), get a
`Decision` (the reply text, and for a policy its prompt / reply tokens, log-probs and weight version), step the env
with the raw reply (the env's own parser decides what it means, and penalises what it cannot read), store the step
in memory, record it -> until the env ends the episode, its step limit, or the decider has nothing to say.

`play` is a coroutine: run many episodes concurrently (`play_all`) and each sends its next request as soon as its
own step is done, no env waiting for the slowest of a batch. A policy decider (`policy_decider`) builds the prompt
with the one prompt encoder (`actors.prompting`) and calls an async `generate(prompt_ids, sampling)`; its sampling
seed per step comes from the episode's sampling seed, which includes the group member, so the G envs of a group
never sample alike, and the same (env seed, sampling seed) replays the same episode wherever it runs.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.conversation import STEP, AgentLoop, Conversation, ConversationOver, chat_deltas, next_turn
from actors.prompting import agent_messages, encode_prompt
from envs.tools import run_sync  # noqa: F401  (the runner's callers import it from here)

Generate = Callable[[list[int], dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass
class Turn:
    """What a decider sees at one step."""

    env: Any
    observation: str
    info: dict[str, Any]
    memory: Any
    step: int

    @property
    def prompt_text(self) -> str:
        return self.env.build_prompt(self.observation, self.memory.render())


@dataclass
class Decision:
    """A reply to one turn. A policy fills in its tokens; `label` is what a demonstration teaches at this state."""

    reply: str
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_version: int = 0
    label: str | None = None
    replica: str | None = None  # the Policy replica that answered (routing checks)


class PromptTooLong(Exception):
    """The prompt and the reply budget do not fit the model's context: the episode ends there, counted, never cut."""


Decide = Callable[[Turn], Awaitable[Decision | None]]


@dataclass
class StepRecord:
    step: int
    observation: str
    reply: str
    action: str | None
    valid: bool
    reward: float
    anchor: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    weight_version: int
    label: str | None = None
    env_error: str | None = None  # a service the env depends on failed at this step (counted, never fatal)
    replica: str | None = None


@dataclass
class Episode:
    seed: int
    steps: list[StepRecord]
    won: bool
    return_: float
    ended: str  # "terminated", "truncated", "prompt_too_long" or "no_decision"
    final_observation: str
    final_info: dict[str, Any]
    sampling_seed: int | None = None
    conversation: Conversation | None = None  # conversation mode: the episode's token list (actors/conversation.py)
    segments: list[Conversation] | None = None  # a user's agent (actors/gateway.py): one conversation per row

    @property
    def conversations(self) -> list[Conversation]:
        """The token lists its rows are made of (none in step mode)."""
        return self.segments if self.segments is not None else [self.conversation] if self.conversation else []

    @property
    def valid_steps(self) -> int:
        return sum(s.valid for s in self.steps)


def _seed(*parts: int) -> int:
    """A 31-bit seed mixed from integers (numpy's SeedSequence: nearby inputs give unrelated seeds)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0] >> 1)


def episode_sampling_seed(run_seed: int, round_index: int, group: int, member: int, split: int = 0) -> int:
    """The sampling seed of one episode of a run: its round (iteration, or validation round), group and member."""
    return _seed(run_seed, split, round_index, group, member)


def step_sampling_seed(sampling_seed: int, step: int) -> int:
    """The engine's per-request seed at `step` of an episode whose sampling seed is `sampling_seed`."""
    return _seed(sampling_seed, step)


async def play(env: Any, memory: Any, decide: Decide, *, seed: int, max_steps: int | None = None,
               options: dict[str, Any] | None = None, sampling_seed: int | None = None,
               on_step: Callable[[StepRecord, str, bool], None] | None = None) -> Episode:
    """One episode of `env` from `reset(seed=seed)`, each step decided by `decide`; `on_step(record, next
    observation, episode over)` hears of every step as it happens (the agent endpoint's sessions)."""
    observation, info = env.reset(seed=int(seed), options=options)
    memory.reset()
    steps: list[StepRecord] = []
    total, won, ended = 0.0, False, "truncated"
    for t in range(max_steps or env.max_steps):
        anchor = str(info["anchor"])
        try:
            decision = await decide(Turn(env, observation, info, memory, t))
        except PromptTooLong:
            ended = "prompt_too_long"
            break
        except ConversationOver as e:
            ended = e.reason
            break
        if decision is None:
            ended = "no_decision"
            break
        next_observation, reward, terminated, truncated, step_info = await env.astep(decision.reply)
        memory.store(observation, step_info.get("action"), reward, step_info)
        steps.append(StepRecord(
            step=t, observation=observation, reply=decision.reply, action=step_info.get("action"),
            valid=bool(step_info["is_action_valid"]), reward=float(reward), anchor=anchor,
            prompt_ids=decision.prompt_ids, response_ids=decision.response_ids, logprobs=decision.logprobs,
            weight_version=decision.weight_version, label=decision.label, env_error=step_info.get("env_error"),
            replica=decision.replica))
        total += float(reward)
        won = won or bool(step_info.get("won", False))
        observation, info = next_observation, step_info
        over = terminated or truncated or t + 1 >= (max_steps or env.max_steps)
        if on_step is not None:
            on_step(steps[-1], observation, over)
        if terminated or truncated:
            ended = "terminated" if terminated else "truncated"
            break
    return Episode(seed=int(seed), steps=steps, won=won, return_=total, ended=ended, final_observation=observation,
                   final_info=info, sampling_seed=sampling_seed, conversation=getattr(decide, "conversation", None))


async def play_all(make: Callable[[int], tuple[Any, Any, Decide, int, int | None]], n: int,
                   max_concurrent: int | None = None, max_steps: int | None = None,
                   on_episode: Callable[[int, Episode], None] | None = None) -> list[Episode]:
    """`n` episodes, one coroutine each (at most `max_concurrent` at a time); `make(i)` gives episode i's
    (env, memory, decide, seed, sampling seed); `on_episode(i, episode)` hears of each as it ends (a progress
    bar, a group that is complete)."""
    limit = asyncio.Semaphore(max_concurrent or n or 1)

    async def one(i: int) -> Episode:
        async with limit:
            env, memory, decide, seed, sampling_seed = make(i)
            episode = await play(env, memory, decide, seed=seed, max_steps=max_steps, sampling_seed=sampling_seed)
        if on_episode is not None:
            on_episode(i, episode)
        return episode

    return list(await asyncio.gather(*(one(i) for i in range(n))))


class BusyClock:
    """Seconds with at least one request in flight, over all the coalescers that share it."""

    def __init__(self) -> None:
        self._in_flight, self._since, self.seconds = 0, 0.0, 0.0

    def start(self) -> None:
        if self._in_flight == 0:
            self._since = time.perf_counter()
        self._in_flight += 1

    def stop(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self.seconds += time.perf_counter() - self._since


Send = Callable[[list[list[int]], list[dict[str, Any]]], Awaitable[list[dict[str, Any]]]]


class Coalescer:
    """Many coroutines' single-prompt `generate` calls become few batched requests, at most `chunks` in flight
    (one per replica). Prompts that arrive while every slot is busy wait for the next free slot, so the episodes a
    reply wakes go out together: a fixed split of every flush would halve the requests at each step as replies come
    back at different times (64, 32, 16, ... prompts per request). `send(prompts, samplings)` makes one request.
    Also measures the time with a request in flight (`clock`, which coalescers may share)."""

    def __init__(self, send: Send, chunks: int = 1, clock: BusyClock | None = None):
        self.send, self.chunks = send, max(1, chunks)
        self.clock = clock or BusyClock()
        self._pending: list[tuple[list[int], dict[str, Any], asyncio.Future]] = []
        self._scheduled = False
        self._in_flight = 0

    @property
    def busy_seconds(self) -> float:
        return self.clock.seconds

    async def generate(self, prompt: list[int], sampling: dict[str, Any]) -> dict[str, Any]:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((prompt, sampling, future))
        self._schedule()
        return await future

    def _schedule(self) -> None:
        if not self._scheduled and self._pending and self._in_flight < self.chunks:
            # call_soon runs after every coroutine already woken by the last replies: they all join this request
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False  # scheduled only with prompts waiting and a slot free; nothing took them since
        free = self.chunks - self._in_flight
        items, self._pending = self._pending, []
        for part in np.array_split(np.arange(len(items)), min(free, len(items))):
            if len(part):
                self.clock.start()
                self._in_flight += 1
                asyncio.ensure_future(self._request([items[i] for i in part]))

    async def _request(self, items: list[tuple[list[int], dict[str, Any], asyncio.Future]]) -> None:
        try:
            replies = await self.send([p for p, _, _ in items], [s for _, s, _ in items])
            for (_, _, future), reply in zip(items, replies, strict=True):
                if not future.done():
                    future.set_result(reply)
        except BaseException as e:  # every waiting episode sees the failure
            for _, _, future in items:
                if not future.done():
                    future.set_exception(e)
        finally:
            self._in_flight -= 1
            self.clock.stop()
            self._schedule()  # prompts that waited for a free slot


class Lanes:
    """Group affinity: the prompts of group g go out on lane g % lanes, one request in flight per lane, each request
    naming its lane (`send(prompts, samplings, affinity=lane)`), which the Policy's router (`app.routing`) maps to one
    replica. So the G envs of a group, which share their first prompt, and every later step of their trajectories
    reach the replica whose prefix cache holds their earlier prompts."""

    def __init__(self, send: Callable[..., Awaitable[list[dict[str, Any]]]], lanes: int):
        self.clock = BusyClock()
        self._lanes = [Coalescer(functools.partial(send, affinity=k), 1, self.clock) for k in range(max(1, lanes))]

    def for_group(self, group: int) -> Generate:
        return self._lanes[group % len(self._lanes)].generate

    @property
    def busy_seconds(self) -> float:
        return self.clock.seconds


# ---- deciders ---------------------------------------------------------------------------------------------------
def policy_decider(tokenizer: Any, generate: Generate, sampling: dict[str, Any], *, max_model_len: int,
                   sampling_seed: int | None = None, loop: AgentLoop = STEP) -> Decide:
    """The policy: the prompt as training builds it, one `generate` call per step, seeded per step when the episode
    has a sampling seed (greedy decoding needs none). `loop` conversation: one growing conversation per episode
    (`ConversationDecider`)."""
    if loop.kind == "conversation":
        decider = load_agent_loop(loop.custom) if loop.custom else ConversationDecider
        settings = {"max_model_len": max_model_len, "budget": loop.max_tokens, "sampling_seed": sampling_seed}
        if loop.named:
            named = {name: ConversationDecider if path == "conversation" else load_agent_loop(path)
                     for name, path in loop.named}
            return TaskRowLoop(named, decider, tokenizer, generate, sampling, **settings)
        return decider(tokenizer, generate, sampling, **settings)

    async def decide(turn: Turn) -> Decision:
        prompt = encode_prompt(tokenizer, turn.env, turn.observation, turn.memory.render())
        if len(prompt) + int(sampling["max_tokens"]) > max_model_len:
            raise PromptTooLong(f"{len(prompt)} prompt tokens + max_tokens {sampling['max_tokens']} > "
                                f"max_model_len {max_model_len}")
        seed = None if sampling_seed is None else step_sampling_seed(sampling_seed, turn.step)
        reply = await generate(prompt, {**sampling, "seed": seed})
        return Decision(reply["text"], prompt, list(reply["token_ids"]), list(reply["logprobs"]),
                        int(reply.get("weight_version", 0)), replica=reply.get("replica_id"))

    return decide


class ConversationDecider:
    """The policy in conversation mode, one per episode: the first prompt is the env's prompt as one user message;
    each later turn appends the env's answer to the last reply (`env.followup_messages`: a user or tool message) as a
    template delta, then the engine's reply tokens as they are (`actors.conversation`). `conversation` is the
    episode's token list so far, kept when a limit ends the episode."""

    def __init__(self, tokenizer: Any, generate: Generate, sampling: dict[str, Any], *, max_model_len: int,
                 budget: int, sampling_seed: int | None = None):
        self.chat = chat_deltas(tokenizer)
        self.generate, self.sampling, self.sampling_seed = generate, sampling, sampling_seed
        self.max_model_len, self.budget = max_model_len, budget
        self.conversation: Conversation | None = None

    def messages(self, turn: Turn) -> list[dict[str, Any]]:
        if self.conversation is None:
            first = getattr(turn.env, "first_messages", None)
            native = self.chat.tool_messages == "native"
            return first(turn.observation, native) if first else agent_messages(turn.env, turn.observation, "")
        follow = getattr(turn.env, "followup_messages", None)
        return follow(turn.observation, turn.info) if follow else agent_messages(turn.env, turn.observation, "")

    def tools(self, turn: Turn) -> list[dict[str, Any]] | None:
        """The env's tool schemas for the first prompt's `tools=` (a template that does not read them ignores
        them); None once the conversation has started."""
        schemas = getattr(turn.env, "tool_schemas", None)
        return schemas() if schemas and self.conversation is None else None

    async def reply(self, turn: Turn, messages: list[dict[str, Any]], attempt: int = 0) -> Decision:
        """Append `messages` (what answers the last reply; the first prompt's message at the start) and one reply
        of the policy to the conversation, as part of `turn`'s step; its sampling seed comes from the step and
        `attempt` (a loop that asks twice in one step)."""
        self.conversation, room = next_turn(self.chat, self.conversation, messages, budget=self.budget,
                                            reply_tokens=int(self.sampling["max_tokens"]),
                                            max_model_len=self.max_model_len, tools=self.tools(turn))
        seed = None if self.sampling_seed is None else step_sampling_seed(self.sampling_seed, turn.step + 1000 * attempt)
        prompt = self.conversation.ids
        reply = await self.generate(prompt, {**self.sampling, "max_tokens": room, "seed": seed})
        version = int(reply.get("weight_version", 0))
        self.conversation.add_reply(list(reply["token_ids"]), list(reply["logprobs"]), version, step=turn.step)
        return Decision(reply["text"], prompt, list(reply["token_ids"]), list(reply["logprobs"]), version,
                        replica=reply.get("replica_id"))

    async def __call__(self, turn: Turn) -> Decision:
        """One env step: the env's message, one reply. A custom loop (`rollout.agent_loop: "package.module:Class"`)
        subclasses this and overrides `__call__` (and `messages`), calling `reply` as often as it needs."""
        return await self.reply(turn, self.messages(turn))


class TaskRowLoop:
    """verl's `agent_name` column: the episode plays the loop its task row names (`env.agent_name`, read at the
    first step, after the env has drawn its task), or `default` where the row names none. The config refuses rows
    that name a loop `rollout.agent_loops` does not map; here such a row plays `default`."""

    def __init__(self, named: dict[str, type[ConversationDecider]], default: type[ConversationDecider],
                 *args: Any, **kwargs: Any):
        self.named, self.default, self._args, self._kwargs = named, default, args, kwargs
        self.loop: ConversationDecider | None = None

    @property
    def conversation(self) -> Conversation | None:
        return self.loop.conversation if self.loop else None

    async def __call__(self, turn: Turn) -> Decision:
        if self.loop is None:
            name = getattr(turn.env, "agent_name", None)
            self.loop = self.named.get(name, self.default)(*self._args, **self._kwargs)
        return await self.loop(turn)


def load_agent_loop(path: str) -> type[ConversationDecider]:
    """A custom conversation loop by import path ("package.module:Class", a ConversationDecider subclass); raises
    ValueError saying what is wrong."""
    module_name, _, attr = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr) if module_name and attr else None
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load agent loop {path!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, ConversationDecider)):
        raise ValueError(f"agent loop {path!r} must name a subclass of actors.episodes.ConversationDecider "
                         "(\"package.module:Class\"), or be 'step' or 'conversation'")
    return cls


def action_reply(action: str) -> str:
    """A canonical action as a reply the env parses: envs with their own tags (<search>, <answer>, tool calls)
    take them as they are, the others inside <action></action>."""
    return action if action.startswith("<") else f"<action>{action}</action>"


def random_decider(rng: np.random.Generator) -> Decide:
    """A uniformly random admissible action: the floor RL must beat."""

    async def decide(turn: Turn) -> Decision:
        actions = turn.info["admissible_actions"]
        return Decision(f"<action>{actions[rng.integers(len(actions))] if actions else ''}</action>")

    return decide


def demonstration_decider(tokenizer: Any, expert_prob: float, rng: np.random.Generator) -> Decide:
    """Warm-start data: every visited state labelled with the env's expert action; the player follows the expert
    with probability `expert_prob`, else a random admissible action (state variety). Ends when the expert has
    nothing to say."""

    async def decide(turn: Turn) -> Decision | None:
        expert = turn.env.expert_action()
        if expert is None:
            return None
        actions = turn.info["admissible_actions"]
        action = expert if (rng.random() < expert_prob or not actions) else actions[rng.integers(len(actions))]
        prompt = encode_prompt(tokenizer, turn.env, turn.observation, turn.memory.render())
        return Decision(f"<action>{action}</action>", prompt_ids=prompt, label=expert)

    return decide


def scripted_decider(choose: Callable[[Turn], str | None]) -> Decide:
    """Replies from plain code (a person at the terminal, a fixed script): `choose(turn)` -> reply or None."""

    async def decide(turn: Turn) -> Decision | None:
        reply = choose(turn)
        return None if reply is None else Decision(reply)

    return decide


# ---- what episodes add up to ------------------------------------------------------------------------------------
def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Counts over episodes that add up across actors: episodes, wins, returns, steps, valid steps, token counts,
    and of the steps after a first, those answered by the replica that answered the step before (routing)."""
    steps = [s for e in episodes for s in e.steps]
    follows = [(a.replica, b.replica) for e in episodes for a, b in zip(e.steps, e.steps[1:], strict=False)
               if a.replica is not None and b.replica is not None]
    return {"episodes": len(episodes), "won": sum(e.won for e in episodes),
            "return_sum": float(sum(e.return_ for e in episodes)), "steps": len(steps),
            "valid_steps": sum(s.valid for s in steps),
            "prompt_too_long": sum(e.ended == "prompt_too_long" for e in episodes),
            "token_budget": sum(e.ended == "token_budget" for e in episodes),
            # a user's agent (actors/gateway.py): how its trajectories ended, and those that stayed one row
            "agent_errors": sum(e.ended == "agent_error" for e in episodes),
            "agent_timeouts": sum(e.ended == "agent_timeout" for e in episodes),
            "agent_no_calls": sum(e.ended == "no_calls" for e in episodes),
            "agent_trajectories": sum(e.segments is not None and bool(e.steps) for e in episodes),
            "agent_merged": sum(e.segments is not None and len(e.segments) == 1 for e in episodes),
            "env_errors": sum(s.env_error is not None for s in steps),
            "generated_tokens": sum(len(s.response_ids) for s in steps),
            "prompt_tokens": sum(len(s.prompt_ids) for s in steps),
            "later_steps": len(follows), "same_replica_steps": sum(a == b for a, b in follows),
            "replica_steps": dict(Counter(s.replica for s in steps if s.replica is not None))}

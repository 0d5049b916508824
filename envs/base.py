"""The text-environment base class and the reply parser every environment shares.

An LLM agent talks to a `TextEnv` in plain text: the observation is a string, and `step` takes the model's raw
reply. The env projects the reply onto one of its actions with `parse_action` and never raises on bad text: an
unparseable or unknown action leaves the state unchanged, still costs a step, and is flagged in
`info["is_action_valid"]` so the trainer can penalise it.

A subclass fills in five hooks (`_new_episode`, `_observe`, `admissible_actions`, `_apply`, `expert_action`) and
a few class attributes; `envs/treasure_hunt.py` is the worked example.
"""

from __future__ import annotations

import re
import string
from collections.abc import Hashable
from typing import Any, ClassVar, NamedTuple

import gymnasium as gym
from gymnasium import spaces

# Every character an observation may contain: printable ASCII (with space), newline, and the few symbols the
# built-in envs draw. Kept as one constant so observations always lie inside `observation_space`.
CHARSET: str = "".join(sorted(set(string.printable) - set("\t\r\x0b\x0c"))) + "√"

# Tags are matched case-insensitively but ASCII-only, so Unicode case folding can never shift a match.
_OPEN_TAG = re.compile(r"<action>", re.IGNORECASE | re.ASCII)
_CLOSE_TAG = re.compile(r"</action>", re.IGNORECASE | re.ASCII)


def parse_action(reply: str) -> str | None:
    """Return the stripped text inside the first ``<action>...</action>`` of `reply`, or None.

    Two plain searches rather than one non-greedy regex keep this linear in the reply length, even for
    adversarial replies full of opening tags.
    """
    if not isinstance(reply, str):
        return None
    opened = _OPEN_TAG.search(reply)
    if opened is None:
        return None
    closed = _CLOSE_TAG.search(reply, opened.end())
    if closed is None:
        return None
    return reply[opened.end() : closed.start()].strip()


POOL_SPLITS = ("train", "test", "all")
TEST_EVERY = 10  # every 10th item of a data pool is held out


def split_pool(items: list, split: str) -> list:
    """The part of a data pool (questions, goals, problems) a split draws from: "test" is every 10th item, "train"
    the rest, "all" everything; disjoint, and the same in every process."""
    if split not in POOL_SPLITS:
        raise ValueError(f"split must be one of {POOL_SPLITS}, got {split!r}")
    if split == "all" or len(items) < 2:
        return items
    held_out = split == "test"
    return [x for i, x in enumerate(items) if (i % TEST_EVERY == 0) == held_out]


class Outcome(NamedTuple):
    """What one valid action did: the reward, whether the episode ended, whether it was won, and an optional
    milestone sentence (`key_event`) that memory modules may show the agent later."""

    reward: float
    terminated: bool = False
    won: bool = False
    key_event: str | None = None


class TextEnv(gym.Env[str, str]):
    """Base class of raygent's text environments (gymnasium API, string observations and actions).

    Subclasses set `name`, `task_description`, `max_steps`, `example_action`, and implement the hooks below.
    `invalid_reward` is what a step with an unparseable or inadmissible reply earns (the env does not move).
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"]}
    render_mode = "ansi"

    name: ClassVar[str] = "text_env"
    task_description: ClassVar[str] = ""
    example_action: ClassVar[str] = "up"
    max_steps: int = 15
    invalid_reward: ClassVar[float] = 0.0
    # Held-out splits for evaluation: name -> the env kwargs that select it. Procedurally generated envs need none:
    # validation seeds are odd and training seeds even, so no initial state is shared (`envs.group_seeds`). Envs that
    # draw from a data pool (questions, goals, games) select a held-out part of it.
    heldout_splits: ClassVar[dict[str, dict[str, Any]]] = {"val": {}}

    # Prompt pieces are class-level format strings so an env (or a user subclass) can restyle its prompt.
    prompt_template: ClassVar[str] = (
        "{task}\n"
        "{memory}"
        "Current state:\n{observation}\n"
        "Admissible actions: {actions}\n"
        "Reply with your chosen action inside <action></action>, e.g. <action>{example}</action>"
    )
    memory_template: ClassVar[str] = "Recent history:\n{memory}\n"
    # Conversation mode (actors/conversation.py): the first user message is `build_prompt`; each later observation
    # is one more message, in this shape (the task and the reply format are already in the conversation).
    followup_template: ClassVar[str] = "Current state:\n{observation}\nAdmissible actions: {actions}"

    def __init__(self, max_steps: int | None = None, max_obs_chars: int = 1024, max_reply_chars: int = 1024):
        if max_steps is not None:
            if max_steps < 1:
                raise ValueError(f"max_steps must be >= 1, got {max_steps}")
            self.max_steps = max_steps
        self.observation_space = spaces.Text(max_length=max_obs_chars, charset=CHARSET)
        # A reply may be empty or anything at all; the space only documents the usual size.
        self.action_space = spaces.Text(max_length=max_reply_chars, min_length=0, charset=CHARSET)
        self._steps = 0
        self._won = False

    # ---- hooks a subclass implements --------------------------------------------------------------------------
    def _new_episode(self, options: dict[str, Any] | None) -> None:
        """Draw a fresh initial state, using only `self.np_random` so that `reset(seed=...)` is deterministic."""
        raise NotImplementedError

    def _observe(self) -> str:
        """The current state as text (no history, no instructions)."""
        raise NotImplementedError

    def admissible_actions(self) -> list[str]:
        """The canonical actions legal in the current state (a fresh list)."""
        raise NotImplementedError

    def _apply(self, action: str) -> Outcome:
        """Carry out `action`, one of `admissible_actions()`."""
        raise NotImplementedError

    def expert_action(self) -> str | None:
        """A good action from the current state (planner or script), or None when there is none."""
        return None

    def anchor(self) -> Hashable:
        """The raw state GiGPO groups steps by. Observations here carry no history, so the text itself."""
        return self._observe()

    # ---- gymnasium API ----------------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self._steps = 0
        self._won = False
        self._new_episode(options)
        return self._observe(), self._info(action=None, valid=True, key_event=None)

    def step(self, reply: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Advance one turn with the model's raw reply; any string is accepted, none raises."""
        self._steps += 1
        action = self.match_action(reply)
        if action is None:
            outcome = Outcome(self.invalid_reward)
        else:
            outcome = self._apply(action)
            self._won = self._won or outcome.won
        # Truncation only when the episode did not end on its own this step.
        truncated = not outcome.terminated and self._steps >= self.max_steps
        info = self._info(action=action, valid=action is not None, key_event=outcome.key_event)
        return self._observe(), float(outcome.reward), outcome.terminated, truncated, info

    async def astep(self, reply: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """`step` for an event loop (the episode runner awaits this): envs that wait on a remote service during a
        step (a retrieval server, a tool server) override it so the wait does not block the other episodes."""
        return self.step(reply)

    def render(self) -> str:
        return self._observe()

    # ---- helpers ----------------------------------------------------------------------------------------------
    def match_action(self, reply: str) -> str | None:
        """Project a raw reply onto an admissible action (case-insensitive, stripped), or None."""
        parsed = parse_action(reply)
        if parsed is None:
            return None
        wanted = parsed.lower()
        return next((a for a in self.admissible_actions() if a.lower() == wanted), None)

    def build_prompt(self, observation: str, memory_text: str = "") -> str:
        """The model's prompt for one step: task, optional memory, current state, legal actions, reply format."""
        memory = self.memory_template.format(memory=memory_text) if memory_text else ""
        return self.prompt_template.format(
            task=self.task_description,
            memory=memory,
            observation=observation,
            actions=", ".join(self.admissible_actions()),
            example=self.example_action,
        )

    def first_messages(self, observation: str, tools_in_template: bool) -> list[dict[str, str]]:
        """Conversation mode: the messages that open the conversation, one `user` message with the env's prompt
        here. `tools_in_template`: the model's chat template renders `tool_schemas()` itself (they go to its
        `tools=`); where it does not, the messages must say what the tools are and how to call them."""
        return [{"role": "user", "content": self.build_prompt(observation, "")}]

    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI function schemas of the env's tools, handed to chat templates that read `tools=` (none here)."""
        return []

    def followup_messages(self, observation: str, info: dict[str, Any]) -> list[dict[str, str]]:
        """Conversation mode: the messages that answer the agent's last reply (`info` is that step's info). A
        `user` message with the new state here; envs whose step ran a tool answer with a `tool` message."""
        return [{"role": "user", "content": self.followup_template.format(
            observation=observation, actions=", ".join(self.admissible_actions()))}]

    agent_name: str | None = None  # the conversation loop this episode's task row names (verl's agent_name)

    def task_agent_names(self) -> set[str]:
        """Every loop name the env's task rows give (`agent_name`); empty for envs without task files."""
        return set()

    def task_row(self) -> dict[str, Any]:
        """The episode just reset as a task for an agent of the user's own (actors/gateway.py), in verl's row
        layout: the chat `prompt` and `extra_info`. Envs with a checkable answer add `reward_model.ground_truth`."""
        return {"data_source": f"raygent/{self.name}",
                "prompt": [{"role": "user", "content": self.build_prompt(self._observe())}],
                "extra_info": {"env": self.name}}

    def _info(self, action: str | None, valid: bool, key_event: str | None) -> dict[str, Any]:
        info: dict[str, Any] = {
            "won": self._won,
            "is_action_valid": valid,
            "admissible_actions": self.admissible_actions(),
            "anchor": self.anchor(),
            "action": action,
        }
        if key_event is not None:
            info["key_event"] = key_event
        return info

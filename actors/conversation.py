"""Conversation mode: a whole episode as one growing conversation, trained as one row. No Ray in it.

Step mode (the default) gives the policy a fresh, bounded prompt at every step (the env's prompt with what the
memory module shows of the past) and trains one (prompt, reply) row per step. Conversation mode keeps every turn:

    prompt_ids   = the chat template's rendering of the env's first prompt (one user message) + generation header
    response_ids = reply 1's engine tokens | delta 1 | reply 2's engine tokens | delta 2 | ... | reply n's tokens
    loss_mask    =         1 ...           |  0 ...  |         1 ...           |  0 ...  | ... |   1 ...

A reply's tokens are exactly those the engine sampled (never decoded and re-encoded: the trainer scores the tokens
that were sampled). A delta is what the chat template adds between two replies: the end of the assistant turn the
engine did not write (its EOS when it stopped on length, and the template's turn separator after it), the next
observation as a `user` message, or a `tool` message where it answers a tool call, and the next generation
header. Deltas are rendered against a fixed stand-in history (`ChatDeltas`), so the history itself is never
rendered again; for an append-only template (ChatML, the built-in models') the ids equal the template's rendering
of the whole conversation, which the tests check token for token.

Limits, each ending the episode with its reason recorded (`Episode.ended`), never a silent cut:
- `token_budget`: the response (every token after the first prompt, the model's and the env's) holds at most
  `max_tokens` tokens. A delta that would pass it ends the episode before it is appended; one that fills it
  exactly is kept, and the episode ends there (no room to reply);
- `prompt_too_long`: the whole conversation plus the next reply's room would pass the model's context;
- the env's own step limit is the limit on assistant turns, as in step mode.

The first messages are the env's (`env.first_messages`); its tools' schemas (`env.tool_schemas`) go to the
template's `tools=`. Templates that do not read `tools` (both built-in models' templates use only role and content)
get the tools described in the env's messages, and tool results the hermes way: a `user` turn holding
`<tool_response>...</tool_response>`; `tool_messages` says which is used.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Literal

AgentLoopKind = Literal["step", "conversation"]
_STAND_IN = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
_PROBE_TOOL = {"type": "function", "function": {"name": "raygent_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class AgentLoop:
    """How an episode meets the policy: `step` (a bounded prompt per step, one row per step) or `conversation`
    (one growing conversation, one row per episode; `max_tokens` bounds its response, all turns together).
    `custom`: the import path of a conversation-mode decider class of the user's (`load_agent_loop`). `named`:
    (name, loop) pairs, the loops that task rows name (verl's `agent_name` column; a loop is "conversation" or an
    import path); a row that names none plays `custom` (or the plain conversation)."""

    kind: AgentLoopKind = "step"
    max_tokens: int = 1024
    custom: str | None = None
    named: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_config(cls, name: str, max_tokens: int, named: dict[str, str] | None = None) -> AgentLoop:
        """`name` as configured: "step", "conversation" or "package.module:Class" (a custom conversation loop);
        `named`: `rollout.agent_loops` (conversation mode only)."""
        pairs = tuple(sorted((named or {}).items()))
        if name == "step":
            return cls("step", max_tokens)
        if name == "conversation":
            return cls("conversation", max_tokens, None, pairs)
        return cls("conversation", max_tokens, name, pairs)


STEP = AgentLoop()


class ConversationOver(Exception):
    """The conversation cannot go on (`reason`: token_budget, prompt_too_long): the episode ends there."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def hermes_tool_result(content: str) -> dict[str, str]:
    """A tool's result for a template that knows no `tool` role: a user turn holding <tool_response>."""
    return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}


def template_reads_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders the `tools=` it is given (a tool's name shows in the text)."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "U"}], tools=[_PROBE_TOOL],
                                             add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001  templates that refuse a `tools` argument read none
        return False
    return "raygent_probe_tool" in text


class ChatDeltas:
    """Token ids of a conversation's pieces under one tokenizer's chat template: the first prompt, and the delta
    that follows a reply (`after_reply`). Raises ValueError, naming the problem, for a template that conversation
    mode cannot extend (one that does not close an assistant turn with the EOS token, or re-renders earlier turns)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self.tool_messages: Literal["native", "hermes"] = "native" if template_reads_tools(tokenizer) else "hermes"
        eos = tokenizer.eos_token
        closed = self._render(_STAND_IN, generation=False)
        end = closed.rfind("A" + eos)
        if end < 0:
            raise ValueError(f"conversation mode needs a chat template that ends an assistant turn with the EOS "
                             f"token {eos!r}; this one renders it as {closed[-80:]!r}")
        self._turn_tail = closed[end + len("A" + eos):]  # what the template writes after the EOS (ChatML: "\n")
        self._closed_stand_in = closed

    def _render(self, messages: list[dict[str, Any]], generation: bool,
                tools: list[dict[str, Any]] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation,
                                                  tokenize=False)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def as_template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Tool results as the template takes them: as they are, or as hermes `<tool_response>` user turns."""
        if self.tool_messages == "native":
            return messages
        return [hermes_tool_result(m["content"]) if m["role"] == "tool" else m for m in messages]

    def first_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation's first prompt; `tools` (OpenAI function schemas) go to a template that reads them (the
        env's `first_messages` describe them to one that does not)."""
        tools = tools if self.tool_messages == "native" else None
        return self._encode(self._render(self.as_template_messages(messages), generation=True, tools=tools))

    def after_reply(self, reply_ids: list[int], messages: list[dict[str, Any]]) -> list[int]:
        """The ids between a reply (the engine's `reply_ids`) and the next one: the EOS if the reply stopped on
        length, the template's turn tail, then `messages` and the generation header."""
        following = self._render(_STAND_IN + self.as_template_messages(messages), generation=True)
        if not following.startswith(self._closed_stand_in):
            raise ValueError("the chat template re-renders earlier turns when a message is added (it is not "
                             "append-only): conversation mode cannot extend its token list")
        text = self._turn_tail + following[len(self._closed_stand_in):]
        closing = [] if reply_ids and reply_ids[-1] == self.eos_id else [self.eos_id]
        return closing + self._encode(text)


_DELTAS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chat_deltas(tokenizer: Any) -> ChatDeltas:
    """The tokenizer's ChatDeltas, built once per tokenizer (it renders the template a few times)."""
    if tokenizer not in _DELTAS:
        _DELTAS[tokenizer] = ChatDeltas(tokenizer)
    return _DELTAS[tokenizer]


@dataclass
class Conversation:
    """One episode's token list: the first prompt, then replies (mask 1, with the engine's log-probs) and deltas
    (mask 0, log-prob 0) in order; `turns` are the [start, end) spans of the replies in `response_ids`."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # the env step each reply belongs to (a loop may reply twice)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_reply(self, token_ids: list[int], logprobs: list[float], weight_version: int,
                  trained: bool = True, step: int | None = None) -> None:
        """A reply's tokens, in the loss (mask 1) unless `trained` is False (a demonstration's random turn), as part
        of env step `step` (default: the next one)."""
        start = len(self.response_ids)
        self.response_ids += token_ids
        self.loss_mask += [int(trained)] * len(token_ids)
        self.logprobs += [float(x) for x in logprobs]
        self.turns.append((start, len(self.response_ids)))
        self.weight_versions.append(int(weight_version))
        self.steps.append(len(set(self.steps)) if step is None else int(step))

    def step_spans(self) -> list[tuple[int, int]]:
        """Per env step, the span from its first reply's start to its last reply's end (what it says in between,
        masked out, included): the tokens that get the step's advantage."""
        spans: dict[int, tuple[int, int]] = {}
        for step, (start, end) in zip(self.steps, self.turns, strict=True):
            spans[step] = (spans[step][0], end) if step in spans else (start, end)
        return [spans[k] for k in sorted(spans)]

    def add_env(self, token_ids: list[int]) -> None:
        self.response_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)


def next_turn(chat: ChatDeltas, conversation: Conversation | None, messages: list[dict[str, Any]], *,
              budget: int, reply_tokens: int, max_model_len: int,
              tools: list[dict[str, Any]] | None = None) -> tuple[Conversation, int]:
    """The conversation ready for its next reply, and that reply's token room: `messages` are the first messages
    (no conversation yet; `tools` go to the template with them) or what answers the last reply. Raises
    ConversationOver when it cannot go on."""
    if conversation is None:
        conversation = Conversation(chat.first_prompt(messages, tools))
    else:
        delta = chat.after_reply(conversation.response_ids[slice(*conversation.turns[-1])], messages)
        used = len(conversation.response_ids)
        if used + len(delta) > budget:
            raise ConversationOver("token_budget", f"{used} response tokens + {len(delta)} for the next message > "
                                                   f"the conversation's {budget}")
        conversation.add_env(delta)
    room = min(reply_tokens, budget - len(conversation.response_ids),
               max_model_len - len(conversation.prompt_ids) - len(conversation.response_ids))
    if room <= 0:
        reason = "token_budget" if budget <= len(conversation.response_ids) else "prompt_too_long"
        raise ConversationOver(reason, f"{len(conversation.ids)} tokens leave no room to reply")
    return conversation, room

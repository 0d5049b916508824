"""Arithmetic word problems solved with tools: the tool-calling agent loop on a task with a checkable answer.

Each turn the reply holds either a tool call, ``<tool_call>{"name": "calculator", "arguments": {"expression":
"3 * 4"}}</tool_call>`` (its result, or its error, becomes the next observation), or the final ``<answer>N</answer>``
or GSM8K's ``#### N`` (ends the episode: reward 1.0 and `won` when N equals the answer, else 0). Problems are generated here (GSM8K-like,
2-4 operations, whole-number answers) or loaded from a task file (`data=`: GSM8K rows or verl's task rows, JSONL or
Parquet, a local path or a storage URI; `envs.data.arithmetic.write_tasks` writes the generated set as one).

A reply may hold up to `max_parallel_calls` tool calls (later ones are ignored, as verl's tool loop ignores them);
they run concurrently and each result is its own `tool` message in conversation mode. Tools come from `tools`
(names or import paths) and from `tools_config`, a verl tool YAML (`envs.tools.load_tools_config`): classes with
verl's async create / execute / release interface, one instance per episode, created with the task row's
`extra_info.tools_kwargs` (the generated set gives verl's GSM8K reward tool its ground truth), released when the
episode ends.

In conversation mode the first messages are the env's prompt (`prompt="env"`) or the task row's own chat messages
(`prompt="row"`, `first_messages`), and the tools' schemas go to the chat template's `tools=`.

What counts as invalid (nothing moves, `invalid_reward`): no <tool_call> or <answer> tag (or `#### N`), a tool call that is not a
JSON object with a "name", or an answer without a number. A call the tool refuses (unknown tool, arguments that fail
the schema, an error inside the tool) is a valid turn whose observation is the error text, flagged in
`info["tool_error"]`, so the agent can read it and try again.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Literal

from envs.base import Outcome, TextEnv, split_pool
from envs.data import clip, squash, to_charset
from envs.data.arithmetic import GSM8K_ANSWER, Problem, generate_problem, load_problems, parse_number, task_row
from envs.tools import (
    SessionTool,
    Tool,
    ToolCall,
    ToolError,
    ToolRegistry,
    ToolResult,
    ToolSession,
    find_all_tagged,
    find_tagged,
    load_tools_config,
    parse_call,
    render_call,
    run_sync,
)

TAGS = ("tool_call", "answer")


@functools.lru_cache(maxsize=4)
def _problems(path: str) -> list[Problem]:
    return load_problems(path)


class MathTool(TextEnv):
    """Solve an arithmetic word problem; call tools over several turns, then answer."""

    name = "math_tool"
    task_description = ("Math with tools: solve the word problem. You may call a tool; its result is shown next "
                        "turn. Finish with the final number.")
    example_action = '<tool_call>{"name": "calculator", "arguments": {"expression": "(12 + 3) * 4"}}</tool_call>'
    max_steps = 6
    prompt_template = (
        "{task}\n"
        "Tools:\n{tools}\n"
        "{memory}"
        "Current state:\n{observation}\n"
        "Admissible actions: {actions}\n"
        'Reply with one tool call <tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call> or the final answer '
        "<answer>number</answer> (an <action></action> wrapper around either is optional), e.g. {example}"
    )

    # Generated problems are held out by seed parity; a data file's problems by `split` (every 10th is "test").
    heldout_splits = {"test": {"split": "test"}}

    def __init__(self, data: str | None = None, tools: tuple[str | Tool, ...] | list[str | Tool] = ("calculator",),
                 max_steps: int | None = None, max_output_chars: int = 600, registry: ToolRegistry | None = None,
                 split: str = "train", tools_config: str | None = None, max_parallel_calls: int = 1,
                 prompt: Literal["env", "row"] = "env"):
        split_pool([], split)  # a bad split name fails here
        if max_parallel_calls < 1:
            raise ValueError(f"max_parallel_calls must be >= 1, got {max_parallel_calls}")
        if prompt not in ("env", "row"):
            raise ValueError(f"prompt {prompt!r} not allowed; allowed: ['env', 'row']")
        self.prompt = prompt
        super().__init__(max_steps=max_steps, max_obs_chars=(2048 + max_output_chars) * max_parallel_calls)
        self.data, self.split = data, split
        self.registry = registry or ToolRegistry(tools)
        for session_tool in load_tools_config(tools_config) if tools_config else []:
            self.registry.register(session_tool)
        self.max_output_chars = max_output_chars
        self.max_parallel_calls = max_parallel_calls
        # each tool's call with "..." for its arguments, rendered once (admissible_actions runs every step)
        self._call_shapes = [render_call(ToolCall(t.name, dict.fromkeys(
            t.schema()["function"]["parameters"].get("properties", {}), "..."))) for t in self.registry.tools.values()]
        self.problem = Problem("", 0)
        self.session = ToolSession()
        self._last: str | None = None
        self._last_ok = False  # the last tool call succeeded (the expert then answers)
        self._tool_error = False
        self._tool_outputs: list[str] | None = None  # this step's tool results or errors (`tool` messages)
        self._ready: list[ToolResult] | None = None  # results `astep` ran before stepping

    def _new_episode(self, options: dict[str, Any] | None) -> None:
        if self.data:
            problems = split_pool(_problems(str(self.data)), self.split)
            self.problem = problems[int(self.np_random.integers(len(problems)))]
        else:
            self.problem = generate_problem(self.np_random)
        self._last, self._last_ok = None, False
        self.session.close_now()  # an episode left before its end
        self.session = ToolSession(self._tools_kwargs())

    @property
    def agent_name(self) -> str | None:  # type: ignore[override]
        return self.problem.agent_name or None

    def task_agent_names(self) -> set[str]:
        return {p.agent_name for p in _problems(str(self.data)) if p.agent_name} if self.data else set()

    def _tools_kwargs(self) -> dict[str, Any]:
        """The task row's per-sample tool arguments; session tools whose `create` takes a `ground_truth` that the
        row does not give get the problem's answer."""
        kwargs = json.loads(self.problem.tools_kwargs) if self.problem.tools_kwargs else {}
        for t in self.registry.tools.values():
            if isinstance(t, SessionTool) and t.takes("ground_truth"):
                entry = kwargs.setdefault(t.name, {})
                entry.setdefault("create_kwargs", {}).setdefault("ground_truth", str(self.problem.answer))
        return kwargs

    def _observe(self) -> str:
        text = f"Question: {to_charset(self.problem.question)}"
        if self._last is not None:
            text += f"\n{self._last}"
        return clip(text, self.observation_space.max_length)

    def admissible_actions(self) -> list[str]:
        return [*self._call_shapes, "<answer>...</answer>"]

    def match_action(self, reply: str) -> str | None:
        """The canonical action in a raw reply: its tool calls (the first `max_parallel_calls`) re-serialised, one
        per line (tool and argument names as declared, values validated), or ``<answer>N</answer>`` with N as a
        plain number; None when there is neither, or a call is not a JSON object with a name."""
        found = find_tagged(reply, TAGS)
        if found is None:  # GSM8K's "#### N" (verl's task rows ask for it) answers too
            final = GSM8K_ANSWER.search(reply)
            value = None if final is None else parse_number(final.group(1))
            return None if value is None else f"<answer>{_format(value)}</answer>"
        tag, text = found
        if tag == "answer":
            value = parse_number(text)
            return None if value is None else f"<answer>{_format(value)}</answer>"
        rendered = []
        for body in find_all_tagged(reply, "tool_call")[: self.max_parallel_calls]:
            try:
                call = parse_call(body)
            except ToolError:
                return None
            try:
                tool, args = self.registry.validate(call)
                call = ToolCall(tool.name, args if isinstance(tool, SessionTool) else args.model_dump(mode="json"))
            except ToolError:
                pass  # a refused call is still a turn: the error is shown by _apply
            try:
                rendered.append(render_call(call))
            except (TypeError, ValueError):  # arguments JSON cannot re-encode (e.g. NaN oddities): malformed
                return None
        return "\n".join(rendered)

    def _calls(self, action: str | None) -> list[str]:
        """The JSON bodies of a canonical action's tool calls (none for an answer or no action)."""
        return find_all_tagged(action, "tool_call") if action and action.startswith("<tool_call>") else []

    def _apply(self, action: str) -> Outcome:
        tag, text = find_tagged(action, TAGS)  # type: ignore[misc]  # canonical, so always found
        if tag == "answer":
            won = parse_number(text) == float(self.problem.answer)
            return Outcome(1.0 if won else 0.0, terminated=True, won=won, key_event=f"answered {text}")
        results = self._ready if self._ready is not None else run_sync(
            self.registry.arun_many(self._calls(action), self.session))
        self._tool_error, self._last_ok = not all(r.ok for r in results), all(r.ok for r in results)
        self._tool_outputs, lines = [], []
        for result in results:
            name = squash(result.call.name if result.call else "tool")
            output = clip(to_charset(result.output), self.max_output_chars)
            lines.append(f"Tool {name} returned: {output}" if result.ok else f"Tool {name} failed: {output}")
            self._tool_outputs.append(output)  # a failure reads "Error: ..."
        self._last = "\n".join(lines)
        return Outcome(sum(r.reward for r in results))  # session tools' step rewards (0 for plain tools)

    def _step(self, reply: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._tool_error, self._tool_outputs = False, None
        obs, reward, terminated, truncated, info = super().step(reply)
        found = find_tagged(reply, TAGS) if not info["is_action_valid"] else None
        if found is not None and found[0] == "tool_call":  # a call that does not parse: still an invalid step
            errors = []
            for body in find_all_tagged(reply, "tool_call")[: self.max_parallel_calls]:
                try:
                    parse_call(body)
                except ToolError as e:
                    errors.append(f"Error: {e}")
            self._tool_outputs = errors or None
        info["tool_error"] = self._tool_error
        info["tool_outputs"] = self._tool_outputs
        return obs, reward, terminated, truncated, info

    def step(self, reply: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        out = self._step(reply)
        if out[2] or out[3]:
            self.session.close_now()
        return out

    async def astep(self, reply: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """The step with its tool calls run concurrently on this event loop (async tools do not block the other
        episodes); the episode's tool instances are released when it ends."""
        calls = self._calls(self.match_action(reply))
        self._ready = await self.registry.arun_many(calls, self.session) if calls else None
        try:
            out = self._step(reply)
        finally:
            self._ready = None
        if out[2] or out[3]:
            await self.session.close()
        return out

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.registry.tools.values()]

    def first_messages(self, observation: str, tools_in_template: bool) -> list[dict[str, str]]:
        """`prompt: env`: the env's prompt (task, tools, question, reply format) as one user message. `prompt: row`:
        the task row's own chat messages (verl's `prompt`; a generated problem's is its question alone), with a
        system turn that adds what the row does not say: the tools the hermes way where the template does not
        render `tools=`, and the reply format where the row has no system message of its own."""
        if self.prompt == "env":
            return super().first_messages(observation, tools_in_template)
        messages = (json.loads(self.problem.messages) if self.problem.messages
                    else [{"role": "user", "content": self.problem.question}])
        own_system = messages[0]["role"] == "system"
        added = [] if own_system else [ROW_REPLY_FORMAT]
        if not tools_in_template:
            added.append(hermes_tools_block(self.tool_schemas()))
        if not added:
            return messages
        if own_system:
            return [{"role": "system", "content": "\n\n".join([messages[0]["content"], *added])}, *messages[1:]]
        return [{"role": "system", "content": "\n\n".join(added)}, *messages]

    def followup_messages(self, observation: str, info: dict[str, Any]) -> list[dict[str, str]]:
        """Each tool call's result (or its error) as a `tool` message; after a reply that was neither a tool call
        nor an answer, a `user` message with the state and the reply format again."""
        if info.get("tool_outputs"):
            return [{"role": "tool", "content": output} for output in info["tool_outputs"]]
        return [{"role": "user", "content": f"{observation}\nReply with one tool call <tool_call>{{...}}</tool_call> "
                                            "or the final answer <answer>number</answer>."}]

    def task_row(self) -> dict[str, Any]:
        """The problem as verl's GSM8K multi-turn row (the question alone as the prompt, the answer as the ground
        truth): an agent of the user's own brings its own instructions and tools."""
        return task_row(self.problem, 0, self.split)  # the index of a generated set's row: none here

    def expert_action(self) -> str | None:
        """Ask the calculator for the solving expression (generated problems carry it) until it answers, then
        answer."""
        if self.problem.expression and not self._last_ok and "calculator" in self.registry.tools:
            return render_call(ToolCall("calculator", {"expression": self.problem.expression}))
        return f"<answer>{_format(float(self.problem.answer))}</answer>"

    def build_prompt(self, observation: str, memory_text: str = "") -> str:
        memory = self.memory_template.format(memory=memory_text) if memory_text else ""
        return self.prompt_template.format(task=self.task_description, tools=self.registry.describe(), memory=memory,
                                           observation=observation, actions=", ".join(self.admissible_actions()),
                                           example=self.example_action)


ROW_REPLY_FORMAT = ("Solve the problem. You may call a tool; its result comes back in the next turn. Give the "
                    "final answer as <answer>number</answer> (or after ####).")


def hermes_tools_block(schemas: list[dict[str, Any]]) -> str:
    """The tools for a chat template that does not render `tools=`: their schemas in <tools></tools>, and the call
    format, in the hermes style that Qwen-family templates write (raygent's own wording)."""
    listed = "\n".join(json.dumps(s) for s in schemas)
    return ("Tools: you can call the functions whose JSON schemas are listed in <tools></tools>.\n<tools>\n"
            f"{listed}\n</tools>\nTo call one, write <tool_call>{{\"name\": function name, \"arguments\": "
            "{arguments as a JSON object}}</tool_call>; its result comes back inside <tool_response></tool_response>.")


def _format(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))

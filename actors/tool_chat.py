"""Tools through the chat template, in OpenAI's message format: the prompt of a chat that offers tools, and the tool
calls in a reply. No Ray in it. The agent endpoint's `/v1/chat/completions` uses it; conversation mode's tool turns
follow the same hermes convention (`actors.conversation`).

A template that reads `tools=` (Qwen2.5's, Hermes') gets the schemas and the messages as they are. A template that
does not (both built-in models': they read only role and content) gets the hermes convention written out:
- the tools' JSON schemas in the system turn, inside <tools></tools>, with how to call one;
- an assistant message's `tool_calls` as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` after its text;
- a `tool` message as a user turn holding `<tool_response>...</tool_response>`.
Replies are read the hermes way: every `<tool_call>` block outside `<think>...</think>` whose JSON names one of the
offered tools is a call; the rest of the text is the content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from actors.conversation import chat_deltas, hermes_tool_result
from envs.tools import ToolError, parse_call

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)


def _hermes_system(tools: list[dict[str, Any]], forced: str | None) -> str:
    schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = ("# Tools\n\nYou may call one or more functions to help with the request. Their JSON schemas are inside "
            f"<tools></tools>:\n<tools>\n{schemas}\n</tools>\n\nTo call a function, write a JSON object with its name "
            "and arguments inside <tool_call></tool_call> tags, one block per call:\n<tool_call>\n"
            '{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>')
    return text + (f"\n\nCall the function {forced!r} now." if forced else "")


def call_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call's arguments as an object (they may come as a JSON string); ValueError where they are not
    one."""
    args = call["function"].get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"tool call {call['function'].get('name')!r}: arguments are not valid JSON ({e.msg})") \
                from None
    if not isinstance(args, dict):
        raise ValueError(f"tool call {call['function'].get('name')!r}: arguments must be a JSON object")
    return args


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    forced: str | None = None) -> list[dict[str, str]]:
    """OpenAI messages (tool calls, tool results, null contents) as plain role/content messages in the hermes
    convention, with the tools' schemas in the system turn."""
    out: list[dict[str, str]] = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "tool":
            out.append(hermes_tool_result(content))
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join("<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments": call_arguments(c)},
                                                         ensure_ascii=False) + "</tool_call>"
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        else:
            out.append({"role": m["role"], "content": content})
    if tools:
        system = _hermes_system(tools, forced)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def encode_tool_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     tool_choice: Any = "auto") -> tuple[list[int], str]:
    """The prompt's token ids for a chat that may offer tools and carry tool calls and results, and the way tools
    went in ("native": the template's own `tools=`; "hermes": written out). `tool_choice` "none" offers none; a
    named function (`{"type": "function", "function": {"name": ...}}`) or "required" is asked for in the system
    turn."""
    forced = None
    if tool_choice == "none":
        tools = None
    elif isinstance(tool_choice, dict):
        forced = tool_choice["function"]["name"]
    elif tool_choice == "required":
        forced = "one of the functions"
    way = chat_deltas(tokenizer).tool_messages
    if way == "native":
        plain = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": call_arguments(c)}}
                                      for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
        if forced:
            plain = [{"role": "system", "content": f"Call the function {forced!r} now."}, *plain]
        text = tokenizer.apply_chat_template(plain, tools=tools or None, add_generation_prompt=True, tokenize=False)
    else:
        text = tokenizer.apply_chat_template(hermes_messages(messages, tools, forced), add_generation_prompt=True,
                                             tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False)), way


def parse_tool_calls(text: str, tool_names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """The content and the OpenAI `tool_calls` of a reply: `<tool_call>` blocks outside `<think>` whose JSON parses
    and names an offered tool. Blocks that do not stay in the content, so nothing the model wrote is lost."""
    thinking = [m.span() for m in _THINK.finditer(text)]
    calls, keep, last = [], [], 0
    for m in _TOOL_CALL.finditer(text):
        if any(a <= m.start() < b for a, b in thinking):
            continue
        try:
            call = parse_call(m.group(1).strip())
        except ToolError:
            continue
        if call.name not in tool_names:
            continue
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}})
        keep.append(text[last:m.start()])
        last = m.end()
    if not calls:
        return text, []
    keep.append(text[last:])
    content = "".join(keep).strip()
    return content or None, calls

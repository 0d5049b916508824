"""Tools through the chat template (actors/tool_chat.py) and the chat route's tool-call answers, without Ray: the
hermes rendering for templates that read no `tools`, the parser, and the official openai client's own types
reading what `/v1/chat/completions` sends, whole and streamed."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from actors.tool_chat import encode_tool_chat, hermes_messages, parse_tool_calls

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}},
                                                        "required": ["expression"]}}}
CHAT = [
    {"role": "user", "content": "What is 12 * 7?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculator",
                                                          "arguments": '{"expression": "12 * 7"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "84"},
]


@pytest.fixture(scope="module")
def smollm2():
    from app.default_model import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))


def test_a_template_without_tools_gets_them_the_hermes_way(smollm2):
    ids, way = encode_tool_chat(smollm2, CHAT, [CALC])
    text = smollm2.decode(ids)
    assert way == "hermes"
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "calculator"' in text
    assert ('<|im_start|>assistant\n<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}'
            "</tool_call><|im_end|>") in text
    assert "<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # a system message of the user's keeps its text, the tools follow it; "none" offers no tools
    with_system = hermes_messages([{"role": "system", "content": "Be brief."}, *CHAT], [CALC])
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools") and len(with_system) == 4
    none_ids, _ = encode_tool_chat(smollm2, CHAT[:1], [CALC], "none")
    assert "# Tools" not in smollm2.decode(none_ids)
    named, _ = encode_tool_chat(smollm2, CHAT[:1], [CALC], {"type": "function", "function": {"name": "calculator"}})
    assert "Call the function 'calculator' now." in smollm2.decode(named)


def test_a_template_that_reads_tools_gets_them_natively():
    """The schemas go to the template's `tools=`, tool results stay `tool` messages, an assistant's tool calls reach
    the template with their arguments as objects; a forced function is asked for in a system turn."""
    from tests.conftest import load_tokenizer

    native = load_tokenizer("smollm2-135m+tools")
    ids, way = encode_tool_chat(native, CHAT, [CALC])
    text = native.decode(ids)
    assert way == "native"
    assert text.startswith("<|im_start|>system\n\nTools you may call:\n" + json.dumps(CALC)), text
    assert ('<|im_start|>assistant\n<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}'
            "</tool_call><|im_end|>\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n") in text
    assert "tool_response" not in text
    named, _ = encode_tool_chat(native, CHAT[:1], [CALC], {"type": "function", "function": {"name": "calculator"}})
    assert "Call the function 'calculator' now." in native.decode(named)


def test_tool_call_arguments_that_are_not_json_are_refused(smollm2):
    bad = [CHAT[0], {**CHAT[1], "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                                                 "arguments": "{12 * 7"}}]}]
    with pytest.raises(ValueError, match="not valid JSON"):
        encode_tool_chat(smollm2, bad, [CALC])


def test_the_parser_reads_offered_calls_outside_think_and_keeps_everything_else():
    text = ('<think>maybe <tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call></think>'
            'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2 + 2"}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {}}</tool_call><tool_call>{broken</tool_call>'
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3"}}\n</tool_call>')
    content, calls = parse_tool_calls(text, {"calculator"})
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"expression": "2 + 2"}, {"expression": "3"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert "<think>maybe <tool_call>" in content and '"name": "search"' in content and "{broken" in content
    assert "2 + 2" not in content
    only, calls = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>', {"calculator"})
    assert only is None and len(calls) == 1
    assert parse_tool_calls("plain text", {"calculator"}) == ("plain text", [])


def test_the_openai_client_reads_the_routes_tool_calls_whole_and_streamed():
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from app.openai_routes import chat_choice, chat_stream

    reply = {"text": 'Sure. <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>',
             "token_ids": [5, 6], "logprobs": [-0.1, -0.2], "finish_reason": "stop", "prompt_token_ids": [1]}
    choices = [chat_choice(0, reply, {"calculator"}, None), chat_choice(1, {**reply, "text": "84"}, {"calculator"},
                                                                        ["8", "4"])]
    usage = {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    whole = ChatCompletion.model_validate({"id": "chatcmpl-1", "object": "chat.completion", "created": 0,
                                           "model": "m", "choices": choices, "usage": usage})
    call = whole.choices[0].message.tool_calls[0]
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content == "Sure."
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "12 * 7"}
    assert whole.choices[1].finish_reason == "stop" and whole.choices[1].message.tool_calls is None

    async def chunks():
        return [c async for c in chat_stream("chatcmpl-1", 0, "m", choices, usage)]

    events = asyncio.run(chunks())
    assert events[-1] == "data: [DONE]\n\n"
    parsed = [ChatCompletionChunk.model_validate(json.loads(e.removeprefix("data: "))) for e in events[:-1]]
    content, calls, finish = {0: "", 1: ""}, {}, {}
    for chunk in parsed:
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                calls[(c.index, d.index)] = (d.id, d.function.name, d.function.arguments)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert content == {0: "Sure.", 1: "84"} and finish == {0: "tool_calls", 1: "stop"}
    assert calls == {(0, 0): (call.id, "calculator", call.function.arguments)}

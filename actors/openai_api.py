"""The OpenAI chat and completion formats as raygent speaks them: the request bodies (strict pydantic models: a bad
field is a 400 naming it) and the response builders (a choice from a Policy reply, tool calls parsed; the streamed
chunks). One implementation for the two servers that speak it: the agent endpoint (`app/openai_routes.py`) and the
training run's gateway, through which a user's own agent plays (`actors/gateway.py`). No Ray in it."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.tool_chat import parse_tool_calls


def _first_unencodable(value: Any, where: str = "") -> str | None:
    """The path of the first string (key or value) that is not valid UTF-8, e.g. a lone surrogate from a JSON
    escape like "\\ud800": the tokenizer and the response encoder cannot handle it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            bad = _first_unencodable(key, where or "body") or _first_unencodable(item, path)
            if bad:  # a bad key is reported at its parent, so the path itself is always encodable
                return bad
    elif isinstance(value, list):
        for i, item in enumerate(value):
            bad = _first_unencodable(item, f"{where}[{i}]")
            if bad:
                return bad
    return None


class BadRequest(Exception):
    """A request refused: its HTTP status (4xx) and the OpenAI error body's message and parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                   headers: dict[str, str] | None = None) -> Any:
    """The OpenAI error body (`{"error": {message, type, param, code}}`) as a response."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


def add_error_handlers(app: Any) -> None:
    """Every refused request (`BadRequest`) and every invalid body (a 400 naming each bad field, never FastAPI's
    422) in the OpenAI error body."""
    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(BadRequest)
    async def _bad_request(_: Any, exc: BadRequest) -> Any:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Any, exc: RequestValidationError) -> Any:
        problems = []
        for err in exc.errors()[:5]:
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {err.get('msg')}")
        first = exc.errors()[0].get("loc", ()) if exc.errors() else ()
        return error_response(400, "invalid request: " + "; ".join(problems),
                              ".".join(str(p) for p in first if p != "body"))


class StrictModel(BaseModel):
    # strict: a JSON `true` is not the integer 1 and "0" is not 0 (pydantic's lax mode would coerce both);
    # unknown fields are ignored, as OpenAI clients send fields this server does not use
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _utf8_only(cls, data: Any) -> Any:
        bad = _first_unencodable(data)
        if bad:
            raise ValueError(f"{bad} is not valid UTF-8 text (a lone surrogate escape?)")
        return data


class FunctionCall(StrictModel):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCallItem(StrictModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (null is allowed only for an assistant message "
                             "with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self


class FunctionSpec(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolSpec(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(StrictModel):
    name: str = Field(min_length=1)


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: NamedFunction


# An empty stop string would end every reply before its first token (vLLM refuses it): a 400, and said so in the schema.
StopString = Annotated[str, Field(min_length=1)]


class _SamplingRequest(StrictModel):
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: StopString | list[StopString] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="only 0 is supported")
    tools: list[ToolSpec] | None = Field(None, description="functions the model may call (docs/serving.md: how a "
                                                           "template without `tools` gets them)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _named_tool_is_offered(self) -> ChatCompletionRequest:
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools or []}:
                raise ValueError(f"tool_choice names {name!r}, which is not among the request's tools")
        if self.tool_choice in ("required",) and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        return self


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=0, description="only 0 (the sampled token) is supported")
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str | list[str]) -> str | list[str]:
        if (isinstance(v, str) and not v) or (isinstance(v, list) and (not v or any(not p for p in v))):
            raise ValueError("prompt must be a non-empty string or a non-empty list of non-empty strings")
        return v


def token_usage(replies: list[dict[str, Any]]) -> dict[str, int]:
    prompt = sum(len(r["prompt_token_ids"]) for r in replies)
    completion = sum(len(r["token_ids"]) for r in replies)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def chat_stream(rid: str, created: int, model: str, choices: list[dict], usage: dict):
    """Server-sent events in the OpenAI chunk format. The reply is produced by one batched engine call and then
    sent as a role chunk, a content chunk, one chunk per tool call and a finish chunk per choice."""
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    for c in choices:
        yield sse({**base, "choices": [{"index": c["index"], "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
        if c["message"]["content"] is not None or c["logprobs"] is not None:
            delta = {"index": c["index"], "delta": {"content": c["message"]["content"] or ""}, "finish_reason": None}
            if c["logprobs"] is not None:
                delta["logprobs"] = c["logprobs"]
            yield sse({**base, "choices": [delta]})
        for k, call in enumerate(c["message"].get("tool_calls") or []):
            yield sse({**base, "choices": [{"index": c["index"], "delta": {"tool_calls": [{"index": k, **call}]},
                                             "finish_reason": None}]})
        yield sse({**base, "choices": [{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}]})
    yield "data: [DONE]\n\n"


def chat_choice(index: int, reply: dict[str, Any], tool_names: set[str], token_strings: list[str] | None
                ) -> dict[str, Any]:
    """One choice of a chat completion from a Policy reply: its tool calls of the offered tools (finish_reason
    "tool_calls") and the rest of the text as the content; log-probs per token when `token_strings` are given."""
    content, calls = parse_tool_calls(reply["text"], tool_names) if tool_names else (reply["text"], [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    choice: dict[str, Any] = {"index": index, "message": message, "logprobs": None,
                              "finish_reason": "tool_calls" if calls else reply["finish_reason"]}
    if token_strings is not None:
        choice["logprobs"] = {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                                          for s, lp in zip(token_strings, reply["logprobs"], strict=False)]}
    return choice


async def completion_stream(rid: str, created: int, model: str, choices: list[dict]):
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    for c in choices:
        yield sse({**base, "choices": [{"index": c["index"], "text": c["text"], "logprobs": c["logprobs"],
                                         "finish_reason": c["finish_reason"]}]})
    yield "data: [DONE]\n\n"


# ---- the Responses API (what the OpenAI Agents SDK speaks by default), as chat underneath -------------------------
class ResponsesRequest(StrictModel):
    """`POST /v1/responses`: input items are read as chat messages (`responses_chat`), the reply is a chat reply
    written back as output items (`response_body`). Fields the servers do not use (`store`, `include`, `reasoning`,
    `metadata`, ...) are ignored."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    stream: bool = False


def _item_text(content: Any, where: str) -> str:
    """The text of a message's content: a string, or parts of type input_text / output_text / text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}: content must be a string or a list of text parts", where)
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}[{k}].type: {kind!r} is not supported; allowed: input_text, output_text "
                             "(text parts with a 'text' string)", f"{where}[{k}]")
        texts.append(part["text"])
    return "".join(texts)


def responses_chat(req: ResponsesRequest, previous: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
    """The chat request a Responses request means: `instructions` as the system message, then `previous` (the
    messages of `previous_response_id`, its own instructions left out, as the Responses API does), then the input
    items: messages (`developer` read as `system`), `function_call` items as the assistant's tool calls (joined to
    the assistant message just before them), `function_call_output` items as tool messages; `reasoning` items are
    skipped. Anything else is a BadRequest naming the item."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += [m for m in previous or [] if m["role"] != "system"]
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    joinable = False  # the last message is an assistant message of these items: function calls join it
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise BadRequest(f"{where}.role: {item.get('role')!r}; allowed: system, developer, user, assistant",
                                 f"{where}.role")
            messages.append({"role": role, "content": _item_text(item.get("content"), f"{where}.content")})
            joinable = role == "assistant"
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise BadRequest(f"{where}: a function_call needs 'name' and 'call_id'", where)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            if joinable:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                joinable = True
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _item_text(output, f"{where}.output")})
            joinable = False
        elif kind == "reasoning":
            continue
        else:
            raise BadRequest(f"{where}.type: {kind!r} is not supported; allowed: message, function_call, "
                             "function_call_output, reasoning", f"{where}.type")
    tools = []
    for i, tool in enumerate(req.tools or []):
        if tool.get("type") != "function":
            raise BadRequest(f"tools[{i}].type: {tool.get('type')!r} is not supported; allowed: function",
                             f"tools[{i}].type")
        tools.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                       if tool.get(k) is not None}})
    choice: Any = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise BadRequest("tool_choice: a function is named as {\"type\": \"function\", \"name\": ...}",
                             "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    body = {"model": req.model, "messages": messages, "tools": tools or None, "tool_choice": choice,
            "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValueError as e:  # pydantic's ValidationError: the chat form of the items is invalid
        errors = getattr(e, "errors", lambda: [])()
        first = errors[0] if errors else {"loc": (), "msg": str(e)}
        raise BadRequest(f"invalid request: {'.'.join(map(str, first['loc']))}: {first['msg']}", "input") from None


def response_body(rid: str, created: int, model: str, choice: dict[str, Any], usage: dict[str, int],
                  req: ResponsesRequest, weight_version: int) -> dict[str, Any]:
    """A Responses API response from a chat choice: its text as a `message` item, each tool call as a
    `function_call` item (the call id kept, so the next request's `function_call_output` names it)."""
    message, output = choice["message"], []
    if message.get("content") or not message.get("tool_calls"):
        output.append({"type": "message", "id": f"msg_{rid[5:]}", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": [],
                                    "logprobs": []}]})
    for k, call in enumerate(message.get("tool_calls") or []):
        output.append({"type": "function_call", "id": f"fc_{rid[5:]}_{k}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    cut = choice["finish_reason"] == "length"
    return {"id": rid, "object": "response", "created_at": created, "model": model, "output": output,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id, "parallel_tool_calls": True,
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "temperature": req.temperature,
            "top_p": req.top_p, "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "metadata": {"weight_version": str(weight_version)},
            "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage["total_tokens"]}}


async def responses_stream(body: dict[str, Any]):
    """The Responses API's server-sent events for a finished response: created, each output item added, its text
    or arguments (one delta each) and done, then completed."""
    n = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal n
        n += 1
        return f"event: {kind}\n" + sse({"type": kind, "sequence_number": n - 1, **fields})

    yield event("response.created", response={**body, "status": "in_progress", "output": []})
    for i, item in enumerate(body["output"]):
        yield event("response.output_item.added", output_index=i,
                    item={**item, "status": "in_progress", **({"content": []} if item["type"] == "message" else
                                                                {"arguments": ""})})
        if item["type"] == "message":
            part = item["content"][0]
            ids = {"item_id": item["id"], "output_index": i, "content_index": 0}
            yield event("response.content_part.added", **ids, part={**part, "text": ""})
            yield event("response.output_text.delta", **ids, delta=part["text"], logprobs=[])
            yield event("response.output_text.done", **ids, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **ids, part=part)
        else:
            ids = {"item_id": item["id"], "output_index": i}
            yield event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **ids, arguments=item["arguments"],
                        name=item["name"])
        yield event("response.output_item.done", output_index=i, item=item)
    yield event("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)

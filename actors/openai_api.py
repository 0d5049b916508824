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

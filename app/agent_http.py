"""The agent endpoint's HTTP surface: its config, the request and error bodies, what the OpenAPI document declares,
and the FastAPI app that every route hangs on (auth and the size limit before any body is read; every bad request
a 4xx with our error body, never FastAPI's 422)."""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.config import PolicyConfig, RetrieverConfig

API_KEY_ENV = "RAYGENT_API_KEY"


class AgentConfig(BaseModel):
    """Args of `serve_configs/agent.yaml`."""

    model_config = ConfigDict(extra="forbid")

    policy: PolicyConfig = PolicyConfig()
    served_model_name: str | None = Field(None, description="name in /v1/models; default: policy.model as given "
                                                             "(a folder: its last part)")
    auth_token: str | None = Field(None, description=f"bearer token; also read from ${API_KEY_ENV}")
    max_request_bytes: int = Field(1 << 20, ge=1024)
    max_tokens_limit: int = Field(512, ge=1, description="largest max_tokens a request may ask for")
    default_max_tokens: int = Field(64, ge=1, description="for chat and completion requests without max_tokens")
    memory: str | None = Field(None, description="memory of agent sessions for a model folder without an agent "
                                                 "card (default simple); a card's memory always wins")
    memory_kwargs: dict[str, Any] = Field(default_factory=dict)
    allowed_envs: list[str] | None = Field(
        None, description="envs a request may name: default the card's env, or every built-in env for a model "
                          "without a card; an import path (package.module:Class) only when listed here")
    allowed_env_kwargs: list[str] = Field(
        default_factory=lambda: ["max_steps"], description="env kwargs a request may set (on top of the card's); "
                                                           "data paths and sizes stay the server's")
    session_ttl_s: float = Field(1800.0, gt=0)
    max_sessions: int = Field(10_000, ge=1)
    max_episode_steps: int = Field(200, ge=1)
    retriever: RetrieverConfig | None = Field(None, description="a retrieval deployment for search envs with "
                                                                "`retriever: serve` (default: the card's)")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorBody(BaseModel):
    """Every 4xx: what is wrong and which parameter."""

    error: ErrorDetail


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorBody(error=ErrorDetail(message=message, type=kind, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


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


class _Strict(BaseModel):
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


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCallItem(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
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


class FunctionSpec(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolSpec(_Strict):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str = Field(min_length=1)


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


# An empty stop string would end every reply before its first token (vLLM refuses it): a 400, and said so in the schema.
StopString = Annotated[str, Field(min_length=1)]


class _SamplingRequest(_Strict):
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


class AgentRequest(_Strict):
    env: str | None = Field(None, min_length=1, max_length=200,
                            description="env name (default: the agent card's); fixes the prompt template and the "
                                        "parser")
    env_kwargs: dict[str, Any] = Field(default_factory=dict, description="on top of the card's; only the keys the "
                                                                         "server allows")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="default: the card's validation sampling")
    max_tokens: int | None = Field(None, ge=1)


class ActRequest(AgentRequest):
    session_id: str | None = Field(None, min_length=8, max_length=128, description="omit to start a new session")
    seed: int | None = Field(None, description="start a server-side session: the server resets its env with this "
                                               "seed and steps it with each reply")
    observation: str | None = Field(None, min_length=1, description="client-side env: the observation to act on")
    admissible_actions: list[str] | None = Field(None, description="client-side env: the actions legal now")
    reward: float = Field(0.0, description="client-side env: the reward the previous action received")
    info: dict[str, Any] = Field(default_factory=dict, description="client-side env: the env's info of that step")
    reply: str | None = Field(None, max_length=4096, description="play this reply instead of the policy's")
    sampling_seed: int | None = None


class EpisodeRequest(AgentRequest):
    seed: int = 0
    split: str | None = Field(None, description="a held-out split of the env (its heldout_splits, e.g. val, test, "
                                                "valid_unseen); default: the training distribution")
    sampling_seed: int | None = Field(None, description="replay: the episode's sampling seed (as recorded in "
                                                        "training rows and evaluation reports)")
    max_steps: int | None = Field(None, ge=1)
    return_tokens: bool = Field(False, description="include each step's prompt and reply token ids")


def error_responses(*codes: int) -> dict[int, dict[str, Any]]:
    text = {400: "invalid request (the message says what to fix)", 401: "missing or wrong bearer token",
            404: "unknown model or session", 409: "the session's episode is over", 411: "no Content-Length",
            413: "request body too large"}
    return {c: {"model": ErrorBody, "description": text[c]} for c in codes}


BODY_ERRORS = error_responses(400, 401, 404, 411, 413)  # routes with a JSON body
GET_ERRORS = error_responses(401)
# `stream: true` answers server-sent events: the OpenAPI document declares both media types of the 200. The
# text/event-stream schema describes one parsed event (OpenAPI 3.0/3.1 have no `itemSchema`; schemathesis checks
# each event against `schema`): its `data` is a JSON chunk, or `[DONE]` last.
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                            "retry": {"type": "integer"}}}
STREAMABLE = {**BODY_ERRORS, 200: {"description": "the reply: JSON, or server-sent events when `stream` is true",
                                   "content": {"text/event-stream": {"schema": SSE_EVENT}}}}


class _AgentOpenAPI(FastAPI):
    """The OpenAPI document tells the truth: a request that fails validation gets a 400 with our error body (the
    handler below), never FastAPI's 422, so 422 is not declared."""

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            schema = super().openapi()
            for methods in schema.get("paths", {}).values():
                for operation in methods.values():
                    operation.get("responses", {}).pop("422", None)
            self.openapi_schema = schema
        return self.openapi_schema


fastapi_app = _AgentOpenAPI(title="raygent agent", version="0.1")


@fastapi_app.middleware("http")
async def _guard(request: Request, call_next):
    """Auth and the size limit, before any body is read or parsed (so a big or unauthenticated body costs nothing)."""
    token, max_bytes = getattr(request.app.state, "guard", (None, 1 << 20))
    if token is not None and request.url.path.startswith("/v1/"):
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return _error(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>'",
                          kind="authentication_error")
    if request.method in ("POST", "PUT", "PATCH"):
        length = request.headers.get("content-length")
        if length is None:
            return _error(411, "send a Content-Length header (chunked request bodies are not accepted)")
        if not length.isdigit() or int(length) > max_bytes:
            return _error(413, f"request body larger than {max_bytes} bytes")
    return await call_next(request)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


@fastapi_app.exception_handler(BadRequest)
async def _bad_request(_: Request, exc: BadRequest) -> JSONResponse:
    return _error(exc.status, exc.message, exc.param)


@fastapi_app.exception_handler(RequestValidationError)
async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    problems = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        problems.append(f"{where or 'body'}: {err.get('msg')}")
    first = exc.errors()[0].get("loc", ()) if exc.errors() else ()
    return _error(400, "invalid request: " + "; ".join(problems), ".".join(str(p) for p in first if p != "body"))


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    # keeps the exception's headers: a 405 says which methods the route allows (Allow, RFC 9110)
    return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

"""The agent endpoint's HTTP surface: its config, the request and error bodies, what the OpenAPI document declares,
and the FastAPI app that every route hangs on (auth and the size limit before any body is read; every bad request
a 4xx with our error body, never FastAPI's 422)."""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.config import PolicyConfig, RetrieverConfig
from actors.openai_api import StrictModel, add_error_handlers, error_response

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





class AgentRequest(StrictModel):
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
            return error_response(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>'",
                                  kind="authentication_error")
    if request.method in ("POST", "PUT", "PATCH"):
        length = request.headers.get("content-length")
        if length is None:
            return error_response(411, "send a Content-Length header (chunked request bodies are not accepted)")
        if not length.isdigit() or int(length) > max_bytes:
            return error_response(413, f"request body larger than {max_bytes} bytes")
    return await call_next(request)


add_error_handlers(fastapi_app)


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    # keeps the exception's headers: a 405 says which methods the route allows (Allow, RFC 9110)
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

"""The trained agent over HTTP (`serve run serve_configs/agent.yaml`).

The model folder says what agent it is (`raygent_agent.json`, written by every checkpoint and by `raygent sft`: the
env and its kwargs, the memory, the exact prompt strings, the sampling its validation used), so `policy.model:
<checkpoint>/model` alone serves the agent as trained. Requests may override only what the config allows.

- OpenAI-compatible: `GET /v1/models`, `POST /v1/chat/completions` (log-probs, streaming), `POST /v1/completions`.
- `GET /v1/agent`: the agent card being served.
- `POST /v1/episodes`: plays a whole episode of the env with the episode runner training uses and returns the
  trajectory; the same env seed and `sampling_seed` replay a training or validation episode.
- `POST /v1/act`: one step of an agent session. With a `seed` the server keeps the session's env (reset with that
  seed), so the prompt shows the state's real admissible actions and the env's own parser reads the reply; with an
  `observation` the client runs the env and the server builds the prompt around it. The session's memory lives on
  the server (sessions expire). `reply` plays a given reply instead of the policy's (a person, a script).

Every bad request gets a 4xx whose message says what to fix; the policy's own refusals (prompt too long) are 400s.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

import envs
import memory
from actors.checkpoint import read_agent_card
from actors.config import AgentCard, PolicyConfig, RetrieverConfig, format_config_error
from actors.episodes import Decision, PromptTooLong, StepRecord, Turn, play, policy_decider
from actors.prompting import encode_prompt
from actors.retrieval import attach_retriever
from actors.storage import is_uri
from app.default_model import resolve_model
from app.policy import Policy
from app.retriever import Retriever

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


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str


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


class _AgentRequest(_Strict):
    env: str | None = Field(None, min_length=1, max_length=200,
                            description="env name (default: the agent card's); fixes the prompt template and the "
                                        "parser")
    env_kwargs: dict[str, Any] = Field(default_factory=dict, description="on top of the card's; only the keys the "
                                                                         "server allows")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="default: the card's validation sampling")
    max_tokens: int | None = Field(None, ge=1)


class ActRequest(_AgentRequest):
    session_id: str | None = Field(None, min_length=8, max_length=128, description="omit to start a new session")
    seed: int | None = Field(None, description="start a server-side session: the server resets its env with this "
                                               "seed and steps it with each reply")
    observation: str | None = Field(None, min_length=1, description="client-side env: the observation to act on")
    admissible_actions: list[str] | None = Field(None, description="client-side env: the actions legal now")
    reward: float = Field(0.0, description="client-side env: the reward the previous action received")
    info: dict[str, Any] = Field(default_factory=dict, description="client-side env: the env's info of that step")
    reply: str | None = Field(None, max_length=4096, description="play this reply instead of the policy's")
    sampling_seed: int | None = None


class EpisodeRequest(_AgentRequest):
    seed: int = 0
    split: str | None = Field(None, description="a held-out split of the env (its heldout_splits, e.g. val, test, "
                                                "valid_unseen); default: the training distribution")
    sampling_seed: int | None = Field(None, description="replay: the episode's sampling seed (as recorded in "
                                                        "training rows and evaluation reports)")
    max_steps: int | None = Field(None, ge=1)
    return_tokens: bool = Field(False, description="include each step's prompt and reply token ids")


@dataclass
class _Session:
    env_name: str
    env: Any
    memory: Any
    last_used: float
    steps: int = 0
    # client-side env: the (observation, action) awaiting its reward
    pending: tuple[str, str | None] | None = None
    # server-side env: the episode runner's coroutine, paused at each decision until a request arrives
    task: asyncio.Task | None = None
    requests: asyncio.Queue | None = None
    results: asyncio.Queue | None = None
    last_turn: tuple[str, list[str]] | None = None  # the prompt and admissible actions of the turn being decided
    over: bool = False
    # the router's key (`app.routing`): every step of the session reaches one replica, whose prefix cache holds it
    affinity: int = field(default_factory=lambda: secrets.randbits(31))


def _errors(*codes: int) -> dict[int, dict[str, Any]]:
    text = {400: "invalid request (the message says what to fix)", 401: "missing or wrong bearer token",
            404: "unknown model or session", 409: "the session's episode is over", 411: "no Content-Length",
            413: "request body too large"}
    return {c: {"model": ErrorBody, "description": text[c]} for c in codes}


BODY_ERRORS = _errors(400, 401, 404, 411, 413)  # routes with a JSON body
GET_ERRORS = _errors(401)
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


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


@fastapi_app.exception_handler(_BadRequest)
async def _bad_request(_: Request, exc: _BadRequest) -> JSONResponse:
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


def _usage(replies: list[dict[str, Any]]) -> dict[str, int]:
    prompt = sum(len(r["prompt_token_ids"]) for r in replies)
    completion = sum(len(r["token_ids"]) for r in replies)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _chat_stream(rid: str, created: int, model: str, choices: list[dict], usage: dict):
    """Server-sent events in the OpenAI chunk format. The reply is produced by one batched engine call and then
    sent as a role chunk, a content chunk and a finish chunk per choice."""
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    for c in choices:
        yield _sse({**base, "choices": [{"index": c["index"], "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
        delta = {"index": c["index"], "delta": {"content": c["message"]["content"]}, "finish_reason": None}
        if c["logprobs"] is not None:
            delta["logprobs"] = c["logprobs"]
        yield _sse({**base, "choices": [delta]})
        yield _sse({**base, "choices": [{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}]})
    yield "data: [DONE]\n\n"


async def _completion_stream(rid: str, created: int, model: str, choices: list[dict]):
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    for c in choices:
        yield _sse({**base, "choices": [{"index": c["index"], "text": c["text"], "logprobs": c["logprobs"],
                                         "finish_reason": c["finish_reason"]}]})
    yield "data: [DONE]\n\n"


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=256,
                  graceful_shutdown_wait_loop_s=0.5)
@serve.ingress(fastapi_app)
class AgentAPI:
    def __init__(self, policy: DeploymentHandle, config: dict[str, Any], retriever: DeploymentHandle | None = None):
        self.config = AgentConfig.model_validate(config)
        self.policy = policy
        self.retriever = retriever
        self.model_path = resolve_model(self.config.policy.model)
        # A folder is named by its last part; "default" or a hub id by itself.
        given = self.config.policy.model
        self.model_name = self.config.served_model_name or (
            given.partition("?")[0].rstrip("/").rsplit("/", 1)[-1] if is_uri(given)
            else os.path.basename(os.path.normpath(given)) if os.path.isdir(given) else given)
        self.token = self.config.auth_token or os.environ.get(API_KEY_ENV) or None
        self.sessions: OrderedDict[str, _Session] = OrderedDict()
        self.created = int(time.time())
        self._tokenizer = None
        # What the served folder is as an agent (None for a plain HF folder or a hub id); a LoRA checkpoint's
        # adapter folder carries the card when the base model is served with it.
        carded = resolve_model(self.config.policy.adapter) if self.config.policy.adapter else self.model_path
        self.card: AgentCard | None = read_agent_card(carded) if os.path.isdir(carded) else None
        if self.card is None:
            memory.make(self.config.memory or "simple", **self.config.memory_kwargs)  # a bad name fails at start-up
        self.allowed_envs = self.config.allowed_envs or ([self.card.env.name] if self.card else envs.list_envs())

        fastapi_app.state.guard = (self.token, self.config.max_request_bytes)

    # ---- helpers -------------------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    def _sampling(self, req: Any, max_tokens: int | None) -> dict[str, Any]:
        wanted = max_tokens or self.config.default_max_tokens
        if wanted > self.config.max_tokens_limit:
            raise _BadRequest(f"max_tokens {wanted} is above this server's limit {self.config.max_tokens_limit}",
                              "max_tokens")
        stop = getattr(req, "stop", None)
        return {"temperature": req.temperature, "top_p": getattr(req, "top_p", 1.0), "max_tokens": wanted,
                "stop": [stop] if isinstance(stop, str) else list(stop or []), "seed": req.seed}

    async def _generate(self, prompts: list[Any], sampling: dict[str, Any],
                        affinity: int | None = None) -> list[dict[str, Any]]:
        try:
            return await self.policy.generate.remote(prompts, sampling, affinity=affinity)
        except ValueError as e:  # the policy refused the input (too long, empty)
            raise _BadRequest(str(e).strip().splitlines()[-1].removeprefix("ValueError: ")) from e

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise _BadRequest(f"unknown model {name!r}; this server serves {self.model_name!r}", "model", 404)

    def _token_strings(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in ids]

    # ---- OpenAI-compatible -----------------------------------------------------------------------------------
    @fastapi_app.get("/v1/models", responses=GET_ERRORS)
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "raygent"}]}

    @fastapi_app.post("/v1/chat/completions", responses=STREAMABLE)
    async def chat_completions(self, req: ChatCompletionRequest):
        self._check_model(req.model)
        sampling = self._sampling(req, req.max_completion_tokens or req.max_tokens)
        messages = [m.model_dump() for m in req.messages]
        replies = await self._generate([messages] * req.n, sampling)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        choices = []
        for i, r in enumerate(replies):
            choice: dict[str, Any] = {"index": i, "message": {"role": "assistant", "content": r["text"]},
                                      "finish_reason": r["finish_reason"], "logprobs": None}
            if req.logprobs:
                choice["logprobs"] = {"content": [
                    {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                    for s, lp in zip(self._token_strings(r["token_ids"]), r["logprobs"], strict=False)]}
            choices.append(choice)
        usage = _usage(replies)
        if req.stream:
            return StreamingResponse(_chat_stream(rid, created, self.model_name, choices, usage),
                                     media_type="text/event-stream")
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": usage, "system_fingerprint": f"v{replies[0]['weight_version']}"}

    @fastapi_app.post("/v1/completions", responses=STREAMABLE)
    async def completions(self, req: CompletionRequest):
        self._check_model(req.model)
        sampling = self._sampling(req, req.max_tokens)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        replies = await self._generate([p for p in prompts for _ in range(req.n)], sampling)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        choices = []
        for i, r in enumerate(replies):
            text = (prompts[i // req.n] + r["text"]) if req.echo else r["text"]
            choice: dict[str, Any] = {"index": i, "text": text, "finish_reason": r["finish_reason"], "logprobs": None}
            if req.logprobs is not None:
                tokens = self._token_strings(r["token_ids"])
                offsets, pos = [], 0
                for t in tokens:
                    offsets.append(pos)
                    pos += len(t)
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": r["logprobs"],
                                      "top_logprobs": [{} for _ in tokens], "text_offset": offsets}
            choices.append(choice)
        usage = _usage(replies)
        if req.stream:
            return StreamingResponse(_completion_stream(rid, created, self.model_name, choices),
                                     media_type="text/event-stream")
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": usage}

    # ---- the agent: its env, memory and sampling ---------------------------------------------------------------
    @fastapi_app.get("/v1/agent", responses=GET_ERRORS)
    async def agent(self) -> dict[str, Any]:
        """The agent card of the served model folder (null for a model without one) and what requests may set."""
        return {"model": self.model_name, "card": self.card.model_dump() if self.card else None,
                "allowed_envs": self.allowed_envs, "allowed_env_kwargs": self.config.allowed_env_kwargs}

    def _env_name(self, requested: str | None) -> str:
        name = requested or (self.card.env.name if self.card else None)
        if name is None:
            raise _BadRequest("env is required: this model folder has no agent card (raygent_agent.json) naming its "
                              f"env; allowed: {self.allowed_envs}", "env")
        if name not in self.allowed_envs:
            raise _BadRequest(f"env {name!r} is not served here; allowed: {self.allowed_envs}", "env")
        return name

    def _make_env(self, name: str, env_kwargs: dict[str, Any], split: str | None = None) -> Any:
        refused = sorted(set(env_kwargs) - set(self.config.allowed_env_kwargs))
        if refused:
            raise _BadRequest(f"env_kwargs {refused} may not be set by a request; allowed: "
                              f"{self.config.allowed_env_kwargs}", "env_kwargs")
        try:
            trained = self.card is not None and name == self.card.env.name
            base = self.card.env.kwargs if trained else {}
            splits = envs.make(name, **base).heldout_splits
            if split is not None and split not in splits:
                raise _BadRequest(f"split {split!r} is not a held-out split of {name!r}; allowed: {sorted(splits)}",
                                  "split")
            overrides = {**env_kwargs, **(splits[split] if split else {})}
            env = self.card.make_env(**overrides) if trained else envs.make(name, **overrides)
            return attach_retriever(env, {**base, **overrides}, self.retriever)
        except (ValueError, TypeError) as e:
            raise _BadRequest(f"env: {e}", "env") from e

    def _make_memory(self) -> Any:
        if self.card is not None:
            return self.card.make_memory()
        return memory.make(self.config.memory or "simple", **self.config.memory_kwargs)

    def _agent_sampling(self, req: _AgentRequest) -> dict[str, Any]:
        """The card's validation sampling (what the agent was measured with) unless the request says otherwise."""
        card = self.card.sampling if self.card else None
        temperature = req.temperature if req.temperature is not None else (card.temperature if card else 1.0)
        max_tokens = req.max_tokens or (card.max_tokens if card else self.config.default_max_tokens)
        if max_tokens > self.config.max_tokens_limit:
            raise _BadRequest(f"max_tokens {max_tokens} is above this server's limit "
                              f"{self.config.max_tokens_limit}", "max_tokens")
        return {"temperature": temperature, "top_p": card.top_p if card else 1.0, "max_tokens": max_tokens}

    def _decider(self, sampling: dict[str, Any], sampling_seed: int | None, affinity: int):
        """The policy for one episode or session: all its steps carry one router key (`affinity`), so they reach
        the replica that has their earlier prompts cached."""

        async def generate_one(prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
            return (await self._generate([prompt], params, affinity))[0]

        return policy_decider(self.tokenizer, generate_one, sampling, max_model_len=self.config.policy.max_model_len,
                              sampling_seed=sampling_seed)

    @staticmethod
    def _step_json(s: StepRecord, tokens: bool) -> dict[str, Any]:
        out = {"step": s.step, "observation": s.observation, "reply": s.reply, "action": s.action,
               "valid": s.valid, "reward": s.reward, "weight_version": s.weight_version}
        if tokens:
            out.update(prompt_token_ids=s.prompt_ids, response_token_ids=s.response_ids, logprobs=s.logprobs)
        return out

    # ---- whole episodes ------------------------------------------------------------------------------------------
    @fastapi_app.post("/v1/episodes", responses=BODY_ERRORS)
    async def episodes(self, req: EpisodeRequest) -> dict[str, Any]:
        name = self._env_name(req.env)
        env = self._make_env(name, req.env_kwargs, req.split)
        sampling = self._agent_sampling(req)
        limit = min(req.max_steps or env.max_steps, self.config.max_episode_steps)
        decide = self._decider(sampling, req.sampling_seed, secrets.randbits(31))
        episode = await play(env, self._make_memory(), decide, seed=req.seed,
                             max_steps=limit, sampling_seed=req.sampling_seed)
        return {"env": name, "seed": req.seed, "split": req.split, "sampling_seed": req.sampling_seed,
                "sampling": sampling, "return": episode.return_, "won": episode.won, "steps": len(episode.steps),
                "ended": episode.ended, "final_observation": episode.final_observation,
                "trajectory": [self._step_json(s, req.return_tokens) for s in episode.steps]}

    # ---- agent sessions ------------------------------------------------------------------------------------------
    def _expire_sessions(self) -> None:
        now = time.monotonic()
        for sid in [s for s, v in self.sessions.items() if now - v.last_used > self.config.session_ttl_s]:
            self._drop(sid)
        while len(self.sessions) > self.config.max_sessions:
            self._drop(next(iter(self.sessions)))

    def _drop(self, sid: str) -> _Session | None:
        session = self.sessions.pop(sid, None)
        if session is not None and session.task is not None:
            session.task.cancel()
        return session

    def _new_session(self, req: ActRequest) -> _Session:
        if req.seed is None and req.observation is None:
            raise _BadRequest("start a session with a seed (the server runs the env) or an observation (the client "
                              "runs it)", "seed")
        name = self._env_name(req.env)
        session = _Session(name, self._make_env(name, req.env_kwargs), self._make_memory(), time.monotonic())
        if req.seed is not None:
            self._start_episode(session, req.seed)
        return session

    def _start_episode(self, session: _Session, seed: int) -> None:
        """The session's episode is the episode runner's coroutine, paused at each decision until the next request
        for the session arrives; its steps are reported back through a queue."""
        session.requests, session.results = asyncio.Queue(), asyncio.Queue()

        async def decide(turn: Turn) -> Decision:
            # what the agent is shown now (the env moves on after this step)
            session.last_turn = (turn.prompt_text, list(turn.info["admissible_actions"]))
            req: ActRequest = await session.requests.get()
            if req.reply is not None:
                prompt = encode_prompt(self.tokenizer, turn.env, turn.observation, turn.memory.render())
                return Decision(req.reply, prompt_ids=prompt)
            return await self._decider(self._agent_sampling(req), req.sampling_seed, session.affinity)(turn)

        def on_step(record: StepRecord, observation: str, over: bool) -> None:
            # runs before the runner asks for the next decision: last_turn is still the turn just played
            session.results.put_nowait(("step", record, observation, over, session.last_turn))

        limit = min(session.env.max_steps, self.config.max_episode_steps)
        session.task = asyncio.get_running_loop().create_task(
            play(session.env, session.memory, decide, seed=seed, max_steps=limit, on_step=on_step))
        session.task.add_done_callback(lambda task: session.results.put_nowait(("end", task)))

    async def _act_server_side(self, sid: str, s: _Session, req: ActRequest) -> dict[str, Any]:
        if s.over:
            raise _BadRequest(f"session {sid}'s episode is over; start a new session", "session_id", 409)
        s.requests.put_nowait(req)
        kind, *rest = await s.results.get()
        if kind == "end":  # the episode ended without a step: an error inside the decision, or a prompt too long
            s.over = True
            (task,) = rest
            error = None if task.cancelled() else task.exception()
            if isinstance(error, _BadRequest | ValueError):
                raise error if isinstance(error, _BadRequest) else _BadRequest(str(error)) from error
            if error is not None:
                raise error
            episode = task.result()
            raise _BadRequest(f"the episode ended ({episode.ended}): the prompt does not fit max_model_len "
                              f"{self.config.policy.max_model_len}" if episode.ended == "prompt_too_long"
                              else f"the episode ended ({episode.ended})", "session_id")
        record, observation, over, turn = rest
        s.over = over
        prompt, actions = turn
        return {"session_id": sid, "step": s.steps, "prompt": prompt, "admissible_actions": actions,
                "reply": record.reply, "action": record.action, "valid": record.valid,
                "valid_format": record.action is not None, "reward": record.reward, "observation": observation,
                "done": over, "weight_version": record.weight_version}

    async def _act_client_side(self, sid: str, s: _Session, req: ActRequest) -> dict[str, Any]:
        if req.observation is None:
            raise _BadRequest(f"session {sid} acts on the client's env: send its observation", "observation")
        if s.pending is not None:  # the previous step's reward is known now: store it as training did
            s.memory.store(s.pending[0], s.pending[1], req.reward, req.info)
        if req.admissible_actions is not None:
            actions = list(req.admissible_actions)
            s.env.admissible_actions = lambda: list(actions)  # the client's env says what is legal now
        info = {"admissible_actions": s.env.admissible_actions()}
        turn = Turn(s.env, req.observation, info, s.memory, s.steps - 1)
        if req.reply is not None:
            decision = Decision(req.reply)
        else:
            try:
                decision = await self._decider(self._agent_sampling(req), req.sampling_seed, s.affinity)(turn)
            except PromptTooLong as e:
                raise _BadRequest(f"prompt too long: {e}", "observation") from e
        action = s.env.match_action(decision.reply)  # the env's own parser
        s.pending = (req.observation, action)
        return {"session_id": sid, "step": s.steps, "prompt": turn.prompt_text,
                "admissible_actions": info["admissible_actions"], "reply": decision.reply, "action": action,
                "valid": action is not None, "valid_format": action is not None,
                "weight_version": decision.weight_version}

    @fastapi_app.post("/v1/act", responses={**BODY_ERRORS, **_errors(409)})
    async def act(self, req: ActRequest) -> dict[str, Any]:
        self._expire_sessions()
        sid = req.session_id
        session = self.sessions.get(sid) if sid else None
        if session is None:
            session = self._new_session(req)
            sid = sid or uuid.uuid4().hex
            self.sessions[sid] = session
        elif req.env is not None and req.env != session.env_name:
            raise _BadRequest(f"session {sid} plays {session.env_name!r}, not {req.env!r}; start a new session", "env")
        session.last_used = time.monotonic()
        self.sessions.move_to_end(sid)
        session.steps += 1
        if session.task is not None:
            return await self._act_server_side(sid, session, req)
        return await self._act_client_side(sid, session, req)

    @fastapi_app.delete("/v1/act/{session_id}", responses=_errors(401, 404))
    async def end_session(self, session_id: str) -> dict[str, Any]:
        if self._drop(session_id) is None:
            raise _BadRequest(f"no session {session_id!r} (it may have expired)", "session_id", 404)
        return {"session_id": session_id, "deleted": True}


def build_agent_app(args: dict[str, Any]) -> serve.Application:
    """`serve run serve_configs/agent.yaml` entry. A bad config fails here, before any replica starts. A model
    whose agent card names a retrieval deployment (a search agent) gets one beside the policy. `model=DIR` is
    short for `policy: {model: DIR}`: `serve run app.agent:build_agent_app model=runs/<run>/checkpoints/<it>/model`."""
    args = dict(args or {})
    if "model" in args:
        args["policy"] = {**(args.get("policy") or {}), "model": args.pop("model")}
    try:
        config = AgentConfig.model_validate(args)
    except ValidationError as e:  # one line per field, without the values (a storage URI may carry credentials)
        raise ValueError(format_config_error(e, what="agent config")) from None
    policy = Policy.bind(config.policy.model_dump())
    path = resolve_model(config.policy.model)
    card = read_agent_card(path) if os.path.isdir(path) else None
    retriever_cfg = config.retriever or (card.retriever if card else None)
    retriever = Retriever.bind(retriever_cfg.model_dump()) if retriever_cfg else None
    return AgentAPI.bind(policy, config.model_dump(), retriever)

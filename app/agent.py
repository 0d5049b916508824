"""The trained agent over HTTP (`serve run serve_configs/agent.yaml`).

- OpenAI-compatible: `GET /v1/models`, `POST /v1/chat/completions` (log-probs, streaming), `POST /v1/completions`.
- `POST /v1/act`: one step of an agent session; the prompt is built exactly as in training and the session's memory
  lives on the server (sessions expire).
- `POST /v1/episodes`: plays a whole episode of a built-in env and returns the trajectory.

Every bad request gets a 4xx whose message says what to fix; the policy's own refusals (prompt too long) are 400s.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

import envs
import memory
from actors.config import PolicyConfig
from actors.prompting import agent_messages
from app.default_model import resolve_model
from app.policy import Policy

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
    default_max_tokens: int = Field(64, ge=1)
    memory: str = "simple"
    memory_kwargs: dict[str, Any] = Field(default_factory=dict)
    session_ttl_s: float = Field(1800.0, gt=0)
    max_sessions: int = Field(10_000, ge=1)
    max_episode_steps: int = Field(200, ge=1)


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class _SamplingRequest(_Strict):
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
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


class ActRequest(_Strict):
    env: str = Field(description="built-in env name or package.module:Class; fixes the prompt template")
    observation: str = Field(min_length=1)
    session_id: str | None = Field(None, max_length=128, description="omit to start a new session")
    reward: float = Field(0.0, description="reward the previous action of this session received")
    info: dict[str, Any] = Field(default_factory=dict, description="the env's info for the previous step")
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None


class EpisodeRequest(_Strict):
    env: str
    seed: int = 0
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    max_tokens: int | None = Field(None, ge=1)
    max_steps: int | None = Field(None, ge=1)


@dataclass
class _Session:
    env_name: str
    env: Any
    memory: Any
    last_used: float
    pending: tuple[str, str | None] | None = None  # (observation, action) awaiting its reward
    steps: int = 0
    history: list[str] = field(default_factory=list)


fastapi_app = FastAPI(title="raygent agent", version="0.1")


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
    return _error(exc.status_code, str(exc.detail))


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


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=256)
@serve.ingress(fastapi_app)
class AgentAPI:
    def __init__(self, policy: DeploymentHandle, config: dict[str, Any]):
        self.config = AgentConfig.model_validate(config)
        self.policy = policy
        self.model_path = resolve_model(self.config.policy.model)
        # A folder is named by its last part; "default" or a hub id by itself.
        given = self.config.policy.model
        self.model_name = self.config.served_model_name or (
            os.path.basename(os.path.normpath(given)) if os.path.isdir(given) else given)
        self.token = self.config.auth_token or os.environ.get(API_KEY_ENV) or None
        self.sessions: OrderedDict[str, _Session] = OrderedDict()
        self.created = int(time.time())
        self._tokenizer = None
        memory.make(self.config.memory, **self.config.memory_kwargs)  # a bad memory name fails at start-up

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

    async def _generate(self, prompts: list[Any], sampling: dict[str, Any]) -> list[dict[str, Any]]:
        try:
            return await self.policy.generate.remote(prompts, sampling)
        except ValueError as e:  # the policy refused the input (too long, empty)
            raise _BadRequest(str(e).strip().splitlines()[-1].removeprefix("ValueError: ")) from e

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise _BadRequest(f"unknown model {name!r}; this server serves {self.model_name!r}", "model", 404)

    def _token_strings(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in ids]

    # ---- OpenAI-compatible -----------------------------------------------------------------------------------
    @fastapi_app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "raygent"}]}

    @fastapi_app.post("/v1/chat/completions")
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

    @fastapi_app.post("/v1/completions")
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

    # ---- agent sessions --------------------------------------------------------------------------------------
    def _make_env(self, name: str, kwargs: dict[str, Any]) -> Any:
        try:
            return envs.make(name, **kwargs)
        except (ValueError, TypeError) as e:
            raise _BadRequest(f"env: {e}", "env") from e

    def _session(self, req: ActRequest) -> tuple[str, _Session]:
        now = time.monotonic()
        for sid in [s for s, v in self.sessions.items() if now - v.last_used > self.config.session_ttl_s]:
            del self.sessions[sid]
        if req.session_id is None:
            sid = uuid.uuid4().hex
        else:
            sid = req.session_id
        session = self.sessions.get(sid)
        if session is None:
            if req.session_id is not None and len(req.session_id) < 8:
                raise _BadRequest("session_id must be at least 8 characters (or omit it to start a session)",
                                  "session_id")
            session = _Session(req.env, self._make_env(req.env, req.env_kwargs),
                               memory.make(self.config.memory, **self.config.memory_kwargs), now)
            self.sessions[sid] = session
            while len(self.sessions) > self.config.max_sessions:
                self.sessions.popitem(last=False)
        elif session.env_name != req.env:
            raise _BadRequest(f"session {sid} plays {session.env_name!r}, not {req.env!r}; start a new session", "env")
        session.last_used = now
        self.sessions.move_to_end(sid)
        return sid, session

    @fastapi_app.post("/v1/act")
    async def act(self, req: ActRequest) -> dict[str, Any]:
        sid, s = self._session(req)
        if s.pending is not None:  # the previous step's reward is known now: store it as training did
            s.memory.store(s.pending[0], s.pending[1], req.reward, req.info)
        messages = agent_messages(s.env, req.observation, s.memory.render())
        reply = (await self._generate([messages], self._sampling(req, req.max_tokens)))[0]
        action = envs.parse_action(reply["text"])
        s.pending = (req.observation, action)
        s.steps += 1
        return {"session_id": sid, "step": s.steps, "action": action, "valid_format": action is not None,
                "reply": reply["text"], "prompt": messages[0]["content"], "weight_version": reply["weight_version"]}

    @fastapi_app.delete("/v1/act/{session_id}")
    async def end_session(self, session_id: str) -> dict[str, Any]:
        if self.sessions.pop(session_id, None) is None:
            raise _BadRequest(f"no session {session_id!r} (it may have expired)", "session_id", 404)
        return {"session_id": session_id, "deleted": True}

    @fastapi_app.post("/v1/episodes")
    async def episodes(self, req: EpisodeRequest) -> dict[str, Any]:
        env = self._make_env(req.env, req.env_kwargs)
        mem = memory.make(self.config.memory, **self.config.memory_kwargs)
        sampling = self._sampling(req, req.max_tokens)
        limit = min(req.max_steps or env.max_steps, self.config.max_episode_steps)
        observation, info = env.reset(seed=req.seed)
        trajectory, total, won = [], 0.0, False
        for step in range(limit):
            messages = agent_messages(env, observation, mem.render())
            reply = (await self._generate([messages], {**sampling, "seed": None if req.temperature == 0
                                                       else req.seed * 100_003 + step}))[0]
            next_observation, reward, terminated, truncated, info = env.step(reply["text"])
            mem.store(observation, info.get("action"), reward, info)
            trajectory.append({"step": step, "observation": observation, "reply": reply["text"],
                               "action": info.get("action"), "valid": bool(info["is_action_valid"]),
                               "reward": float(reward)})
            total += float(reward)
            won = bool(info.get("won", False))
            observation = next_observation
            if terminated or truncated:
                break
        return {"env": req.env, "seed": req.seed, "return": total, "won": won, "steps": len(trajectory),
                "final_observation": observation, "trajectory": trajectory}


def build_agent_app(args: dict[str, Any]) -> serve.Application:
    """`serve run serve_configs/agent.yaml` entry. A bad config fails here, before any replica starts."""
    config = AgentConfig.model_validate(args or {})
    policy = Policy.bind(config.policy.model_dump())
    return AgentAPI.bind(policy, config.model_dump())

"""The agent endpoint's OpenAI-compatible routes: `GET /v1/models`, `POST /v1/chat/completions` (log-probs,
streaming) and `POST /v1/completions`, as a part of the AgentAPI ingress (app/agent.py): the policy replicas behind
the one name the server serves."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi.responses import StreamingResponse

from app.agent_http import (
    GET_ERRORS,
    STREAMABLE,
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    fastapi_app,
)


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


class OpenAIRoutes:
    """The routes and what they need of the ingress: `policy` (the Policy deployment), `config` (AgentConfig),
    `model_name` and `model_path`."""

    _tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    def _sampling(self, req: Any, max_tokens: int | None) -> dict[str, Any]:
        wanted = max_tokens or self.config.default_max_tokens
        if wanted > self.config.max_tokens_limit:
            raise BadRequest(f"max_tokens {wanted} is above this server's limit {self.config.max_tokens_limit}",
                              "max_tokens")
        stop = getattr(req, "stop", None)
        return {"temperature": req.temperature, "top_p": getattr(req, "top_p", 1.0), "max_tokens": wanted,
                "stop": [stop] if isinstance(stop, str) else list(stop or []), "seed": req.seed}

    async def _generate(self, prompts: list[Any], sampling: dict[str, Any],
                        affinity: int | None = None) -> list[dict[str, Any]]:
        try:
            return await self.policy.generate.remote(prompts, sampling, affinity=affinity)
        except ValueError as e:  # the policy refused the input (too long, empty)
            raise BadRequest(str(e).strip().splitlines()[-1].removeprefix("ValueError: ")) from e

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise BadRequest(f"unknown model {name!r}; this server serves {self.model_name!r}", "model", 404)

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

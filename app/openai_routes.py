"""The agent endpoint's OpenAI-compatible routes: `GET /v1/models`, `POST /v1/chat/completions` (log-probs,
streaming, tools and tool calls: `actors.tool_chat`), `POST /v1/responses` (the Responses API read as the chat call
it means; this server keeps no responses, so `previous_response_id` is refused) and `POST /v1/completions`, as a part
of the AgentAPI ingress (app/agent.py): the policy replicas behind the one name the server serves."""

from __future__ import annotations

import json
import time
import uuid
import zlib
from typing import Any

from fastapi.responses import StreamingResponse

from actors.openai_api import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
    chat_choice,
    chat_stream,
    completion_stream,
    response_body,
    responses_chat,
    responses_stream,
    token_usage,
)
from actors.tool_chat import encode_tool_chat
from app.agent_http import GET_ERRORS, STREAMABLE, fastapi_app


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

    def _chat_prompt(self, req: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | list[int], set[str]]:
        """The prompt the Policy gets (the messages, which it renders, or token ids where tools are involved) and
        the names of the tools a reply may call."""
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        uses_tools = req.tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
        if not uses_tools:
            return [{"role": m["role"], "content": m.get("content", "")} for m in messages], set()
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
        try:
            ids, _ = encode_tool_chat(self.tokenizer, messages, tools, choice or "auto")
        except ValueError as e:
            raise BadRequest(str(e), "messages") from e
        return ids, set() if choice == "none" else {t["function"]["name"] for t in tools}

    @staticmethod
    def _conversation_key(req: ChatCompletionRequest) -> int:
        """The router key of a conversation: its first two messages, which every later request of it repeats, so
        all its turns reach the replica whose prefix cache holds it (`app.routing`)."""
        head = json.dumps([m.model_dump(exclude_none=True) for m in req.messages[:2]], sort_keys=True)
        return zlib.crc32(head.encode()) & 0x7FFFFFFF

    async def _chat(self, req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], dict[str, int], int]:
        """The choices of a chat request, its token usage and the weight version that answered."""
        self._check_model(req.model)
        sampling = self._sampling(req, req.max_completion_tokens or req.max_tokens)
        prompt, tool_names = self._chat_prompt(req)
        replies = await self._generate([prompt] * req.n, sampling, affinity=self._conversation_key(req))
        choices = [chat_choice(i, r, tool_names, self._token_strings(r["token_ids"]) if req.logprobs else None)
                   for i, r in enumerate(replies)]
        return choices, token_usage(replies), int(replies[0].get("weight_version", 0))

    @fastapi_app.post("/v1/chat/completions", responses=STREAMABLE)
    async def chat_completions(self, req: ChatCompletionRequest):
        choices, usage, version = await self._chat(req)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return StreamingResponse(chat_stream(rid, created, self.model_name, choices, usage),
                                     media_type="text/event-stream")
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": usage, "system_fingerprint": f"v{version}"}

    @fastapi_app.post("/v1/responses", responses=STREAMABLE)
    async def responses(self, req: ResponsesRequest):
        if req.previous_response_id is not None:
            raise BadRequest("previous_response_id: this server keeps no responses; send the whole input",
                             "previous_response_id")
        self._check_model(req.model)
        choices, usage, version = await self._chat(responses_chat(req))
        body = response_body(f"resp_{uuid.uuid4().hex}", int(time.time()), self.model_name, choices[0], usage, req,
                              version)
        if req.stream:
            return StreamingResponse(responses_stream(body), media_type="text/event-stream")
        return body

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
        usage = token_usage(replies)
        if req.stream:
            return StreamingResponse(completion_stream(rid, created, self.model_name, choices),
                                     media_type="text/event-stream")
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": usage}

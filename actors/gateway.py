"""The gateway: train the agent a user already has. The user's own agent (a loop over the `openai` client, a
LangGraph graph, an OpenAI Agents SDK agent) runs unchanged except for its base URL, which points at an
OpenAI-compatible server that each env-group actor runs on its own node's loopback; the URL carries the trajectory.
For each call the gateway records the prompt's token ids as the chat template renders them, the reply's engine token
ids and log-probs, the weight version and the replica, and answers in the OpenAI format (tool calls included).

How calls become training rows (`AgentTrajectory`):
- a call whose messages are the previous call's messages, then the reply the gateway gave it (its text or tool calls,
  however the agent stored them), then only new `user` / `tool` messages, *extends* the previous call: its prompt is
  the previous prompt + the previous reply's engine tokens + the chat template's delta for the new messages
  (`actors.conversation.ChatDeltas`, the same as conversation mode), so the agent's history stays token-exact and
  the calls merge into one conversation row (mask 1 on the model's tokens only);
- any other call (the agent rewrote or summarised its history, changed its tools, or the merged row would pass
  `rollout.conversation_tokens`) starts a new row, its prompt rendered from the messages;
- a Responses API call (`/v1/responses`, what the OpenAI Agents SDK speaks by default) is read as the chat call it
  means (`actors.openai_api.responses_chat`: instructions, input items, function calls and their outputs;
  `previous_response_id` names an earlier call of the trajectory), so it merges as a chat call does;
- a completion call (`/v1/completions`, a text prompt) extends the previous one where its prompt is the previous
  prompt and reply followed by more text: the new text's tokens follow the engine's. Every row of a trajectory
  gets the trajectory's reward; `train/gateway_merged_share` counts the trajectories that stayed one row.
A call's anchor (GiGPO's step groups) is the last message before the reply that is not the model's: the task's
prompt for the first call, then the tool result or user message it answers, as in conversation mode.

The run's sampling wins over the client's: temperature, top-p and the seed are the run's; max_tokens is the smaller of
the client's and the run's (`rollout.max_tokens`); `n` > 1 is a 400. `stop` is the client's. Streaming works (the
reply is generated whole, then sent as chunks). A trajectory's calls keep to one replica (its group's lane).

The user's function, `agent.entrypoint` ("package.module:function"), is called once per trajectory as
`function(task, llm)`: `task` is the env's task row (verl's layout: `prompt` messages, `reward_model`, `extra_info`),
`llm` an `AgentLLM` (its `base_url`, `model`, and `client()` / `sync_client()` for the `openai` package). It returns
the reward (a number, or a dict with `reward` and optionally `won`), or `agent.reward` ("package.module:function",
called with the task and the last call's messages and reply) scores it. A function that raises, outlives
`agent.timeout_s` (synchronous code runs in a thread, so it never blocks the actor) or never calls the model ends its
trajectory with the reason counted (`faults/agent_errors`, `faults/agent_timeouts`, `faults/agent_no_calls`); its
calls are kept with reward 0 and the last one marked invalid (the invalid-action penalty applies). It never stalls
the rollout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import importlib
import inspect
import json
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from actors.conversation import ChatDeltas, Conversation, chat_deltas
from actors.episodes import Episode, StepRecord, step_sampling_seed
from actors.openai_api import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
    add_error_handlers,
    chat_choice,
    chat_stream,
    completion_stream,
    response_body,
    responses_chat,
    responses_stream,
    token_usage,
)
from actors.tool_chat import call_arguments, encode_tool_chat

logger = logging.getLogger("raygent")

Generate = Callable[[list[int], dict[str, Any]], Awaitable[dict[str, Any]]]
MODEL_NAME = "policy"  # the name the gateway serves (`/v1/models`); any name a client sends is accepted


def load_function(path: str, what: str) -> Callable[..., Any]:
    """A callable by import path ("package.module:function"); ValueError saying what is wrong."""
    module_name, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr) if module_name and attr else None
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {what} {path!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"{what} {path!r} must name a function (\"package.module:function\")")
    return fn


# ---- one trajectory's calls ------------------------------------------------------------------------------------
def _same(m: dict[str, Any]) -> tuple:
    """What identifies a message for the prefix check: its role, text and tool calls (names and parsed arguments;
    call ids and whitespace-free JSON spelling do not matter)."""
    def arguments(call: dict[str, Any]) -> str:
        try:
            return json.dumps(call_arguments(call), sort_keys=True)
        except ValueError:  # not a JSON object: compared as sent
            return str(call["function"].get("arguments"))

    calls = tuple((c["function"]["name"], arguments(c)) for c in m.get("tool_calls") or [])
    return m["role"], m.get("content") or "", calls


def _anchor(text: str) -> str:
    """GiGPO's anchor of a call: a digest of what it answered."""
    return "gw:" + hashlib.sha1(text.encode()).hexdigest()[:16]


def _chat_anchor(messages: list[dict[str, Any]]) -> str:
    last = next((m for m in reversed(messages) if m["role"] != "assistant"), messages[-1])
    return _anchor(json.dumps(_same(last)))


@dataclass
class _Call:
    messages: list[tuple]  # the request's messages as `_same` reads them
    reply: tuple  # the assistant message the gateway answered with, as `_same` reads it
    reply_ids: list[int]
    tools: str  # the request's tools and tool choice, as JSON
    segment: int
    text: str | None = None  # a completion call's prompt and reply (None for a chat call)


@dataclass
class AgentTrajectory:
    """One trajectory's calls through the gateway and the rows they make (`segments`: conversations, one per run of
    extending calls). `generate(prompt_ids, sampling)` is the Policy (its lane); `sampling` the run's."""

    tokenizer: Any
    generate: Generate
    sampling: dict[str, Any]
    budget: int  # rollout.conversation_tokens: the response tokens of one merged row
    max_model_len: int
    sampling_seed: int | None = None
    segments: list[Conversation] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    splits: dict[str, int] = field(default_factory=dict)  # why a call started a new row, counted
    ended: str | None = None  # set when the trajectory is over: later calls are refused
    last_messages: list[dict[str, Any]] = field(default_factory=list)  # the last call's messages and reply
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # a Responses call's id: its messages
    _calls: list[_Call] = field(default_factory=list)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def chat(self) -> ChatDeltas:
        return chat_deltas(self.tokenizer)

    def _extension(self, messages: list[dict[str, Any]], tools: str) -> tuple[Conversation, list[int]] | None:
        """The conversation this call extends and the delta its new messages add, or None (counted in `splits`)."""
        if not self._calls:
            return None
        last = self._calls[-1]
        seen = [_same(m) for m in messages]
        n = len(last.messages)
        reason = None
        if tools != last.tools:
            reason = "tools_changed"
        elif seen[:n] != last.messages or len(seen) <= n + 1 or seen[n] != last.reply:
            reason = "history_rewritten"
        elif any(m["role"] not in ("user", "tool") for m in messages[n + 1:]):
            reason = "history_rewritten"
        if reason is None:
            conversation = self.segments[last.segment]
            delta = self.chat.after_reply(last.reply_ids, messages[n + 1:])
            if len(conversation.response_ids) + len(delta) < self.budget:
                return conversation, delta
            reason = "token_budget"
        self._split(reason)
        return None

    def _split(self, reason: str) -> None:
        self.splits[reason] = self.splits.get(reason, 0) + 1

    def _open(self, n: int) -> None:
        if n != 1:
            raise BadRequest("n must be 1: the gateway records one reply per call", "n")
        if self.ended is not None:
            raise BadRequest(f"this trajectory has ended ({self.ended}); its calls are no longer taken", status=409)

    async def _reply(self, conversation: Conversation, delta: list[int] | None, req: Any, anchor: str,
                     observation: str) -> tuple[dict[str, Any], list[int]]:
        """The Policy's reply to `conversation` (a new row's prompt; with `delta`, the row it extends and the tokens
        that extend it), within the client's max_tokens, the run's and the room left; the call recorded."""
        prompt = conversation.prompt_ids if delta is None else conversation.ids + delta
        wanted = min(getattr(req, "max_completion_tokens", None) or req.max_tokens or 10**9,
                     int(self.sampling["max_tokens"]))
        room = min(wanted, self.max_model_len - len(prompt))
        if delta is not None:
            room = min(room, self.budget - len(conversation.response_ids) - len(delta))
        if room <= 0:
            raise BadRequest(f"the prompt ({len(prompt)} tokens) leaves no room to reply within the model's "
                             f"{self.max_model_len} tokens", "messages")
        k = len(self.steps)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        seed = None if self.sampling_seed is None else step_sampling_seed(self.sampling_seed, k)
        reply = await self.generate(prompt, {**self.sampling, "max_tokens": room, "stop": stop, "seed": seed})
        ids, version = list(reply["token_ids"]), int(reply.get("weight_version", 0))
        if delta is None:
            self.segments.append(conversation)
        else:
            conversation.add_env(delta)
        conversation.add_reply(ids, list(reply["logprobs"]), version, step=k)
        self.steps.append(StepRecord(
            step=k, observation=observation, reply=reply["text"], action=None, valid=True, reward=0.0, anchor=anchor,
            prompt_ids=list(prompt), response_ids=ids, logprobs=list(reply["logprobs"]), weight_version=version,
            replica=reply.get("replica_id")))
        return reply, prompt

    async def chat_completion(self, req: ChatCompletionRequest) -> dict[str, Any]:
        """One chat call: its prompt (extending the last call's tokens where it can), the Policy's reply, the record;
        the OpenAI choice (`actors.openai_api.chat_choice`) with the reply, usage and weight version."""
        async with self._lock:  # one call at a time per trajectory: the rows follow the calls' order
            self._open(req.n)
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
            tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
            choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
            tools_key = json.dumps([tools, choice], sort_keys=True)
            extension = self._extension(messages, tools_key)
            if extension is not None:
                conversation, delta = extension
            else:
                try:
                    prompt, _ = encode_tool_chat(self.tokenizer, messages, tools or None, choice or "auto")
                except ValueError as e:
                    raise BadRequest(str(e), "messages") from None
                conversation, delta = Conversation(list(prompt)), None
            reply, prompt = await self._reply(conversation, delta, req, _chat_anchor(messages),
                                              str(messages[-1].get("content") or ""))
            ids = list(reply["token_ids"])
            names = set() if choice == "none" else {t["function"]["name"] for t in tools}
            answer = chat_choice(0, reply, names, [self.tokenizer.decode([t]) for t in ids] if req.logprobs else None)
            self._calls.append(_Call([_same(m) for m in messages], _same(answer["message"]), ids, tools_key,
                                     len(self.segments) - 1))
            self.last_messages = [*messages, answer["message"]]
            return {"choice": answer, "usage": token_usage([{"prompt_token_ids": prompt, "token_ids": ids}]),
                    "weight_version": reply.get("weight_version", 0)}

    async def completion(self, req: CompletionRequest) -> dict[str, Any]:
        """One completion call (a text prompt): it extends the last call where its prompt is the last prompt and
        reply, then more text (the engine's tokens of both, the new text's tokens after them); else a new row."""
        if not isinstance(req.prompt, str):
            raise BadRequest("one prompt per call: the gateway records one reply per call", "prompt")
        async with self._lock:
            self._open(req.n)
            last = self._calls[-1] if self._calls else None
            conversation, delta = None, None
            if last is not None and last.text is not None and req.prompt.startswith(last.text):
                delta = list(self.tokenizer.encode(req.prompt[len(last.text):], add_special_tokens=False))
                conversation = self.segments[last.segment]
                if len(conversation.response_ids) + len(delta) >= self.budget:
                    self._split("token_budget")
                    conversation, delta = None, None
            elif last is not None:
                self._split("history_rewritten")
            if conversation is None:
                conversation = Conversation(list(self.tokenizer.encode(req.prompt)))
            reply, prompt = await self._reply(conversation, delta, req, _anchor(req.prompt[-200:]), req.prompt[-200:])
            ids = list(reply["token_ids"])
            self._calls.append(_Call([], (), ids, "", len(self.segments) - 1, text=req.prompt + reply["text"]))
            self.last_messages = [{"role": "user", "content": req.prompt},
                                  {"role": "assistant", "content": reply["text"]}]
            text = req.prompt + reply["text"] if req.echo else reply["text"]
            choice = {"index": 0, "text": text, "finish_reason": reply["finish_reason"], "logprobs": None}
            return {"choice": choice, "usage": token_usage([{"prompt_token_ids": prompt, "token_ids": ids}]),
                    "weight_version": reply.get("weight_version", 0)}

    def episode(self, seed: int, reward: float, won: bool, ended: str, info: dict[str, Any]) -> Episode:
        """The trajectory as an Episode (one step per call, the reward on the last; `segments` its rows)."""
        steps = self.steps
        if steps:
            steps[-1].reward = float(reward)
            steps[-1].valid = ended == "terminated"
        info = {**info, "gateway_calls": len(steps), "gateway_rows": len(self.segments), "gateway_splits": self.splits}
        return Episode(seed=seed, steps=steps, won=won, return_=float(reward) if steps else 0.0, ended=ended,
                       final_observation="", final_info=info, sampling_seed=self.sampling_seed,
                       segments=list(self.segments))


# ---- the server ------------------------------------------------------------------------------------------------
class AgentLLM:
    """What the user's function gets to reach the policy: `base_url` (this trajectory's OpenAI-compatible URL),
    `model`, and clients of the `openai` package bound to them."""

    def __init__(self, base_url: str, timeout_s: float):
        self.base_url, self.model, self.api_key, self.timeout_s = base_url, MODEL_NAME, "raygent", timeout_s

    def client(self) -> Any:
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=self.timeout_s)

    def sync_client(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=self.timeout_s)


class Gateway:
    """The OpenAI-compatible server of one env-group actor, on 127.0.0.1 and a free port, run in the actor's own event
    loop (uvicorn; started by `start`). `/t/{trajectory}/v1/chat/completions`, `.../v1/responses`,
    `.../v1/completions` and `.../v1/models`: each open trajectory (`open`) has its own base URL."""

    def __init__(self) -> None:
        self.trajectories: dict[str, AgentTrajectory] = {}
        self.address: str | None = None
        self._server: Any = None
        self._starting = asyncio.Lock()  # two rollouts at once (async mode) start one server

    def _app(self) -> Any:
        from fastapi import FastAPI
        from fastapi.responses import StreamingResponse

        app = FastAPI(title="raygent gateway", docs_url=None, redoc_url=None)
        add_error_handlers(app)

        def trajectory(tid: str) -> AgentTrajectory:
            if tid not in self.trajectories:
                raise BadRequest(f"no open trajectory {tid!r} on this gateway", status=404)
            return self.trajectories[tid]

        @app.get("/t/{tid}/v1/models")
        async def models(tid: str) -> dict[str, Any]:
            trajectory(tid)
            return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "raygent"}]}

        @app.post("/t/{tid}/v1/chat/completions")
        async def chat_completions(tid: str, req: ChatCompletionRequest) -> Any:
            out = await trajectory(tid).chat_completion(req)
            rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
            if req.stream:
                return StreamingResponse(chat_stream(rid, created, MODEL_NAME, [out["choice"]], out["usage"]),
                                         media_type="text/event-stream")
            return {"id": rid, "object": "chat.completion", "created": created, "model": MODEL_NAME,
                    "choices": [out["choice"]], "usage": out["usage"],
                    "system_fingerprint": f"v{out['weight_version']}"}

        @app.post("/t/{tid}/v1/responses")
        async def responses(tid: str, req: ResponsesRequest) -> Any:
            t = trajectory(tid)
            previous = None
            if req.previous_response_id is not None:
                if req.previous_response_id not in t.responses:
                    raise BadRequest(f"no response {req.previous_response_id!r} in this trajectory",
                                     "previous_response_id", 404)
                previous = t.responses[req.previous_response_id]
            out = await t.chat_completion(responses_chat(req, previous))
            rid = f"resp_{uuid.uuid4().hex}"
            t.responses[rid] = t.last_messages
            body = response_body(rid, int(time.time()), MODEL_NAME, out["choice"], out["usage"], req,
                                 out["weight_version"])
            if req.stream:
                return StreamingResponse(responses_stream(body), media_type="text/event-stream")
            return body

        @app.post("/t/{tid}/v1/completions")
        async def completions(tid: str, req: CompletionRequest) -> Any:
            out = await trajectory(tid).completion(req)
            rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
            if req.stream:
                return StreamingResponse(completion_stream(rid, created, MODEL_NAME, [out["choice"]]),
                                         media_type="text/event-stream")
            return {"id": rid, "object": "text_completion", "created": created, "model": MODEL_NAME,
                    "choices": [out["choice"]], "usage": out["usage"]}

        return app

    async def start(self) -> str:
        """Serve on 127.0.0.1 (a free port) from this event loop; the server's address. Once per actor."""
        async with self._starting:
            if self.address is None:
                self.address = await self._serve()
        return self.address

    async def _serve(self) -> str:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        serving = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if serving.done():
                serving.result()  # the error that stopped it
            await asyncio.sleep(0.02)
        self._serving = serving
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def open(self, trajectory: AgentTrajectory) -> str:
        """Register a trajectory; its base URL."""
        tid = uuid.uuid4().hex
        self.trajectories[tid] = trajectory
        return f"{self.address}/t/{tid}/v1"

    def close(self, base_url: str) -> None:
        self.trajectories.pop(base_url.rstrip("/").split("/")[-2], None)


# ---- running the user's function -------------------------------------------------------------------------------
_THREADS = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="raygent-agent")


async def _call_user(fn: Callable[..., Any], deadline_s: float, *args: Any) -> Any:
    """The user's function (async, or sync in a thread of its own pool: it never blocks the actor's loop) within
    `deadline_s`, else asyncio.TimeoutError. Past the deadline it is cancelled but not waited for: code that ignores
    the cancellation (or a thread, which cannot be stopped) must not hold the rollout."""
    if inspect.iscoroutinefunction(fn):
        running = asyncio.ensure_future(fn(*args))
    else:
        running = asyncio.get_running_loop().run_in_executor(_THREADS, lambda: fn(*args))
    done, _ = await asyncio.wait({running}, timeout=deadline_s)
    if not done:
        running.cancel()
        raise asyncio.TimeoutError
    return running.result()


def _reward(value: Any) -> tuple[float, bool | None]:
    if isinstance(value, dict):
        if "reward" not in value:
            raise TypeError(f"the agent returned a dict without 'reward': {sorted(value)}")
        return float(value["reward"]), (bool(value["won"]) if "won" in value else None)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"the agent returned {type(value).__name__}, not a reward (a number or a dict with "
                        "'reward'); set agent.reward to score its calls instead")
    return float(value), None


async def play_agent(gateway: Gateway, entrypoint: Callable[..., Any], reward_fn: Callable[..., Any] | None,
                     trajectory: AgentTrajectory, task: dict[str, Any], *, seed: int, timeout_s: float) -> Episode:
    """One trajectory of the user's agent on `task`: its calls recorded by `trajectory`, its reward, how it ended."""
    base_url = gateway.open(trajectory)
    llm = AgentLLM(base_url, timeout_s)
    info: dict[str, Any] = {}
    reward, won, ended = 0.0, None, "terminated"
    try:
        result = await _call_user(entrypoint, timeout_s, task, llm)
        if reward_fn is not None:
            result = await _call_user(reward_fn, timeout_s, task, trajectory.last_messages)
        reward, won = _reward(result)
    except asyncio.TimeoutError:
        ended, info["agent_error"] = "agent_timeout", f"the agent ran past agent.timeout_s ({timeout_s:.0f}s)"
    except Exception as e:  # noqa: BLE001  the user's code: whatever it raises ends this trajectory only
        ended, info["agent_error"] = "agent_error", f"{type(e).__name__}: {e}"[:500]
    finally:
        trajectory.ended = ended
        gateway.close(base_url)
    if not trajectory.steps and ended == "terminated":
        ended = "no_calls"
    if ended != "terminated":
        reward, won = 0.0, False
    return trajectory.episode(seed, reward, bool(reward >= 1.0) if won is None else won, ended, info)

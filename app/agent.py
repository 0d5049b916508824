"""The trained agent over HTTP (`serve run serve_configs/agent.yaml`).

The model folder says what agent it is (`raygent_agent.json`, written by every checkpoint and by `raygent sft`: the
env and its kwargs, the memory, the exact prompt strings, the sampling its validation used), so `policy.model:
<checkpoint>/model` alone serves the agent as trained. Requests may override only what the config allows.

- OpenAI-compatible: `GET /v1/models`, `POST /v1/chat/completions` (log-probs, streaming), `POST /v1/completions`
  (app/openai_routes.py).
- `GET /v1/agent`: the agent card being served.
- `POST /v1/episodes`: plays a whole episode of the env with the episode runner training uses and returns the
  trajectory; the same env seed and `sampling_seed` replay a training or validation episode.
- `POST /v1/act`: one step of an agent session. With a `seed` the server keeps the session's env (reset with that
  seed), so the prompt shows the state's real admissible actions and the env's own parser reads the reply; with an
  `observation` the client runs the env and the server builds the prompt around it. The session's memory lives on
  the server (sessions expire). `reply` plays a given reply instead of the policy's (a person, a script).

Every bad request gets a 4xx whose message says what to fix; the policy's own refusals (prompt too long) are 400s
(the config, the request bodies and the FastAPI app: app/agent_http.py).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

import envs
import memory
from actors.checkpoint import read_agent_card
from actors.config import AgentCard, format_config_error
from actors.conversation import STEP, chat_deltas
from actors.episodes import Decision, PromptTooLong, StepRecord, Turn, play, policy_decider
from actors.openai_api import BadRequest
from actors.prompting import encode_prompt
from actors.retrieval import attach_retriever
from actors.storage import is_uri
from app.agent_http import (  # noqa: F401  (AgentConfig: the app's config, imported from here by users)
    API_KEY_ENV,
    BODY_ERRORS,
    GET_ERRORS,
    ActRequest,
    AgentConfig,
    AgentRequest,
    EpisodeRequest,
    error_responses,
    fastapi_app,
)
from app.default_model import resolve_model
from app.openai_routes import OpenAIRoutes
from app.policy import Policy
from app.retriever import Retriever


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
    decider: Any = None  # a conversation-mode agent's policy for the whole episode (it holds the conversation)
    # the router's key (`app.routing`): every step of the session reaches one replica, whose prefix cache holds it
    affinity: int = field(default_factory=lambda: secrets.randbits(31))


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=256,
                  graceful_shutdown_wait_loop_s=0.5)
@serve.ingress(fastapi_app)
class AgentAPI(OpenAIRoutes):
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

    # ---- the agent: its env, memory and sampling ---------------------------------------------------------------
    @fastapi_app.get("/v1/agent", responses=GET_ERRORS)
    async def agent(self) -> dict[str, Any]:
        """The agent card of the served model folder (null for a model without one), what requests may set, and how
        tools reach the model's chat template ("native" `tools=`, or "hermes" written out: actors/tool_chat.py)."""
        return {"model": self.model_name, "card": self.card.model_dump() if self.card else None,
                "allowed_envs": self.allowed_envs, "allowed_env_kwargs": self.config.allowed_env_kwargs,
                "tool_format": chat_deltas(self.tokenizer).tool_messages}

    def _env_name(self, requested: str | None) -> str:
        name = requested or (self.card.env.name if self.card else None)
        if name is None:
            raise BadRequest("env is required: this model folder has no agent card (raygent_agent.json) naming its "
                              f"env; allowed: {self.allowed_envs}", "env")
        if name not in self.allowed_envs:
            raise BadRequest(f"env {name!r} is not served here; allowed: {self.allowed_envs}", "env")
        return name

    def _make_env(self, name: str, env_kwargs: dict[str, Any], split: str | None = None) -> Any:
        refused = sorted(set(env_kwargs) - set(self.config.allowed_env_kwargs))
        if refused:
            raise BadRequest(f"env_kwargs {refused} may not be set by a request; allowed: "
                              f"{self.config.allowed_env_kwargs}", "env_kwargs")
        try:
            trained = self.card is not None and name == self.card.env.name
            base = self.card.env.kwargs if trained else {}
            splits = envs.make(name, **base).heldout_splits
            if split is not None and split not in splits:
                raise BadRequest(f"split {split!r} is not a held-out split of {name!r}; allowed: {sorted(splits)}",
                                  "split")
            overrides = {**env_kwargs, **(splits[split] if split else {})}
            env = self.card.make_env(**overrides) if trained else envs.make(name, **overrides)
            return attach_retriever(env, {**base, **overrides}, self.retriever)
        except (ValueError, TypeError) as e:
            raise BadRequest(f"env: {e}", "env") from e

    def _make_memory(self) -> Any:
        if self.card is not None:
            return self.card.make_memory()
        return memory.make(self.config.memory or "simple", **self.config.memory_kwargs)

    def _agent_sampling(self, req: AgentRequest) -> dict[str, Any]:
        """The card's validation sampling (what the agent was measured with) unless the request says otherwise."""
        card = self.card.sampling if self.card else None
        temperature = req.temperature if req.temperature is not None else (card.temperature if card else 1.0)
        max_tokens = req.max_tokens or (card.max_tokens if card else self.config.default_max_tokens)
        if max_tokens > self.config.max_tokens_limit:
            raise BadRequest(f"max_tokens {max_tokens} is above this server's limit "
                              f"{self.config.max_tokens_limit}", "max_tokens")
        return {"temperature": temperature, "top_p": card.top_p if card else 1.0, "max_tokens": max_tokens}

    @property
    def _conversation(self) -> bool:
        return self.card is not None and self.card.loop.kind == "conversation"

    def _decider(self, sampling: dict[str, Any], sampling_seed: int | None, affinity: int):
        """The policy for one episode or session: all its steps carry one router key (`affinity`), so they reach
        the replica that has their earlier prompts cached."""

        async def generate_one(prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
            return (await self._generate([prompt], params, affinity))[0]

        return policy_decider(self.tokenizer, generate_one, sampling, max_model_len=self.config.policy.max_model_len,
                              sampling_seed=sampling_seed, loop=self.card.loop if self.card else STEP)

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
            raise BadRequest("start a session with a seed (the server runs the env) or an observation (the client "
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
            if self._conversation:
                if req.reply is not None:
                    raise BadRequest("this agent was trained in conversation mode: it writes every reply of the "
                                     "conversation itself (leave out `reply`)", "reply")
                if session.decider is None:  # one conversation per episode, sampled as its first request asks
                    session.decider = self._decider(self._agent_sampling(req), req.sampling_seed, session.affinity)
                return await session.decider(turn)
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
            raise BadRequest(f"session {sid}'s episode is over; start a new session", "session_id", 409)
        s.requests.put_nowait(req)
        kind, *rest = await s.results.get()
        if kind == "end":  # the episode ended without a step: an error inside the decision, or a prompt too long
            s.over = True
            (task,) = rest
            error = None if task.cancelled() else task.exception()
            if isinstance(error, BadRequest | ValueError):
                raise error if isinstance(error, BadRequest) else BadRequest(str(error)) from error
            if error is not None:
                raise error
            episode = task.result()
            raise BadRequest(f"the episode ended ({episode.ended}): the prompt does not fit max_model_len "
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
            raise BadRequest(f"session {sid} acts on the client's env: send its observation", "observation")
        if self._conversation:
            raise BadRequest("this agent was trained in conversation mode: start its session with a seed (the server "
                             "runs the env and keeps the conversation)", "observation")
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
                raise BadRequest(f"prompt too long: {e}", "observation") from e
        action = s.env.match_action(decision.reply)  # the env's own parser
        s.pending = (req.observation, action)
        return {"session_id": sid, "step": s.steps, "prompt": turn.prompt_text,
                "admissible_actions": info["admissible_actions"], "reply": decision.reply, "action": action,
                "valid": action is not None, "valid_format": action is not None,
                "weight_version": decision.weight_version}

    @fastapi_app.post("/v1/act", responses={**BODY_ERRORS, **error_responses(409)})
    async def act(self, req: ActRequest) -> dict[str, Any]:
        self._expire_sessions()
        sid = req.session_id
        session = self.sessions.get(sid) if sid else None
        if session is None:
            session = self._new_session(req)
            sid = sid or uuid.uuid4().hex
            self.sessions[sid] = session
        elif req.env is not None and req.env != session.env_name:
            raise BadRequest(f"session {sid} plays {session.env_name!r}, not {req.env!r}; start a new session", "env")
        session.last_used = time.monotonic()
        self.sessions.move_to_end(sid)
        session.steps += 1
        if session.task is not None:
            return await self._act_server_side(sid, session, req)
        return await self._act_client_side(sid, session, req)

    @fastapi_app.delete("/v1/act/{session_id}", responses=error_responses(401, 404))
    async def end_session(self, session_id: str) -> dict[str, Any]:
        if self._drop(session_id) is None:
            raise BadRequest(f"no session {session_id!r} (it may have expired)", "session_id", 404)
        return {"session_id": session_id, "deleted": True}


def build_agent_app(args: dict[str, Any]) -> serve.Application:
    """`serve run serve_configs/agent.yaml` entry. A bad config fails here, before any replica starts. A model
    whose agent card names a retrieval deployment (a search agent) gets one beside the policy; its policy gets the
    card's max_model_len unless the config sets one. `model=DIR` is
    short for `policy: {model: DIR}`: `serve run app.agent:build_agent_app model=runs/<run>/checkpoints/<it>/model`."""
    args = dict(args or {})
    if "model" in args:
        args["policy"] = {**(args.get("policy") or {}), "model": args.pop("model")}
    try:
        config = AgentConfig.model_validate(args)
    except ValidationError as e:  # one line per field, without the values (a storage URI may carry credentials)
        raise ValueError(format_config_error(e, what="agent config")) from None
    path = resolve_model(config.policy.model)
    card = read_agent_card(path) if os.path.isdir(path) else None
    if card is not None and "max_model_len" not in (args.get("policy") or {}):
        # the context the agent was trained with (a conversation-mode agent's prompts grow to it), unless set here
        config.policy = config.policy.model_copy(update={"max_model_len": card.max_model_len})
    policy = Policy.bind(config.policy.model_dump())
    retriever_cfg = config.retriever or (card.retriever if card else None)
    retriever = Retriever.bind(retriever_cfg.model_dump()) if retriever_cfg else None
    return AgentAPI.bind(policy, config.model_dump(), retriever)

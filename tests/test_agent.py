"""The agent endpoint over real HTTP: the official openai client, /v1/act sessions, /v1/episodes, and 4xx for
every kind of bad request (never a 500)."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
import yaml

from tests.conftest import REPO

pytestmark = pytest.mark.slow

TOKEN = "test-secret-token"


@pytest.fixture(scope="module")
def agent(serve_url):
    """The agent app exactly as serve_configs/agent.yaml describes it, plus auth and a second policy replica."""
    from ray import serve

    from app.agent import AgentAPI, AgentConfig
    from app.policy import Policy

    spec = yaml.safe_load((REPO / "serve_configs" / "agent.yaml").read_text())["applications"][0]
    config = AgentConfig.model_validate({**spec["args"], "auth_token": TOKEN, "max_request_bytes": 64 * 1024})
    app = AgentAPI.bind(Policy.options(num_replicas=2).bind(config.policy.model_dump()), config.model_dump())
    serve.run(app, name="agent", route_prefix="/")
    yield serve_url
    serve.delete("agent")


@pytest.fixture()
def client(agent):
    with httpx.Client(base_url=agent, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
        yield c


@pytest.fixture()
def openai_client(agent):
    from openai import OpenAI

    return OpenAI(base_url=f"{agent}/v1", api_key=TOKEN, max_retries=0, timeout=120)


def test_openai_client_models_chat_and_completions(openai_client):
    models = openai_client.models.list().data
    assert len(models) == 1
    name = models[0].id
    chat = openai_client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Sokoban: move the box."}], max_tokens=8,
        temperature=1.0, seed=3, logprobs=True)
    choice = chat.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens == len(choice.logprobs.content) > 0
    assert all(t.logprob <= 0 for t in choice.logprobs.content)
    assert "".join(t.token for t in choice.logprobs.content).strip() == choice.message.content.strip()

    stream = openai_client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Sokoban: move the box."}], max_tokens=8,
        temperature=1.0, seed=3, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == choice.message.content  # same seed, same reply

    completion = openai_client.completions.create(model=name, prompt="#_P_X#", max_tokens=6, logprobs=0,
                                                  temperature=0.0)
    assert len(completion.choices[0].logprobs.token_logprobs) == completion.usage.completion_tokens


def test_openai_client_sends_tools_tool_calls_and_tool_results(openai_client, client):
    """A chat that offers a tool and carries an assistant tool call (content null) and the tool's result: the
    route renders it (hermes, the tiny model's template reads no tools) and answers in OpenAI's format, whole and
    streamed; whatever the untrained model writes, a reply is either content or calls of the offered tool."""
    name = openai_client.models.list().data[0].id
    assert client.get("/v1/agent").json()["tool_format"] == "hermes"  # the tiny model's template reads no tools
    tools = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                               "parameters": {"type": "object", "properties": {
                                                   "expression": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "What is 12 * 7?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "calculator", "arguments": json.dumps({"expression": "12 * 7"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "84"}]
    for choice in ("auto", {"type": "function", "function": {"name": "calculator"}}):
        chat = openai_client.chat.completions.create(model=name, messages=messages, tools=tools, tool_choice=choice,
                                                     max_tokens=8, temperature=0.0)
        c = chat.choices[0]
        assert c.finish_reason in ("stop", "length", "tool_calls")
        assert (c.finish_reason == "tool_calls") == bool(c.message.tool_calls)
        assert all(t.function.name == "calculator" for t in c.message.tool_calls or [])
    stream = openai_client.chat.completions.create(model=name, messages=messages, tools=tools, max_tokens=8,
                                                   temperature=0.0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == (c.message.content or "") or c.message.tool_calls


def test_the_responses_api_answers_as_the_chat_route_does(openai_client):
    """`/v1/responses` (the Agents SDK's default API) is the chat call it means: greedy, the same input as a chat
    request gets the same text, whole and streamed, and a function tool is offered the same way."""
    name = openai_client.models.list().data[0].id
    question = "Sokoban: move the box."
    chat = openai_client.chat.completions.create(model=name, max_tokens=8, temperature=0.0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": question}])
    response = openai_client.responses.create(model=name, instructions="Be brief.", input=question,
                                              max_output_tokens=8, temperature=0.0)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events = list(openai_client.responses.create(model=name, instructions="Be brief.", input=question,
                                                 max_output_tokens=8, temperature=0.0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    tool = {"type": "function", "name": "calculator", "description": "Evaluate arithmetic.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}
    offered = openai_client.responses.create(model=name, input="What is 12 * 7?", tools=[tool], max_output_tokens=8,
                                             temperature=0.0)
    assert all(item.type in ("message", "function_call") for item in offered.output) and offered.output


def test_concurrent_http_requests(openai_client):
    def ask(i: int) -> str:
        r = openai_client.chat.completions.create(model=openai_client.models.list().data[0].id,
                                                  messages=[{"role": "user", "content": f"step {i}"}], max_tokens=4)
        return r.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(f in ("stop", "length") for f in pool.map(ask, range(16)))


def test_act_keeps_memory_per_session(client):
    first = client.post("/v1/act", json={"env": "sokoban", "observation": "######\n#P_X_#\n######"})
    assert first.status_code == 200, first.text
    body = first.json()
    sid = body["session_id"]
    assert body["step"] == 1 and "#P_X_#" in body["prompt"]
    assert body["valid_format"] == (body["action"] is not None)

    second = client.post("/v1/act", json={"env": "sokoban", "session_id": sid, "reward": -0.1,
                                          "observation": "######\n#_PX_#\n######"}).json()
    assert second["step"] == 2
    assert "#P_X_#" in second["prompt"], "the session's memory did not carry the first observation"

    other = client.post("/v1/act", json={"env": "sokoban", "observation": "######\n#_PX_#\n######"}).json()
    assert other["session_id"] != sid and "#P_X_#" not in other["prompt"]
    assert client.delete(f"/v1/act/{sid}").json()["deleted"]
    assert client.delete(f"/v1/act/{sid}").status_code == 404


def test_episode_plays_a_whole_episode(client):
    r = client.post("/v1/episodes", json={"env": "sokoban", "seed": 5, "temperature": 1.0, "sampling_seed": 7,
                                          "return_tokens": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert 1 <= body["steps"] == len(body["trajectory"]) <= 15
    assert body["return"] == pytest.approx(sum(s["reward"] for s in body["trajectory"]))
    assert isinstance(body["won"], bool)
    assert all(s["prompt_token_ids"] and s["response_token_ids"] for s in body["trajectory"])
    again = client.post("/v1/episodes", json={"env": "sokoban", "seed": 5, "temperature": 1.0, "sampling_seed": 7,
                                              "return_tokens": True}).json()
    # The same env seed and sampling seed replay the episode: the same tokens, actions and rewards. Log-probs agree
    # to float rounding (the two calls may reach different replicas, one with the prompt's prefix cached).
    assert len(again["trajectory"]) == len(body["trajectory"])
    for first, second in zip(body["trajectory"], again["trajectory"], strict=True):
        exact = {k: v for k, v in first.items() if k != "logprobs"}
        assert {k: second[k] for k in exact} == exact, f"step {first['step']} did not replay"
        assert second["logprobs"] == pytest.approx(first["logprobs"], abs=1e-3), f"step {first['step']}"


def _expert_reply(env) -> str:
    action = env.expert_action()
    return action if action.startswith("<") else f"<action>{action}</action>"


@pytest.mark.parametrize("env_name", ["webshop", "alfworld", "search", "math_tool"])
def test_act_server_side_session_shows_the_states_actions_and_parses_with_the_env(client, env_name):
    """A session started with a seed keeps its env on the server: each prompt lists the admissible actions of the
    state the env is really in (webshop's clickables after a search, alfworld's commands), and a correct reply in
    the env's own syntax (a search, a tool call, an answer, a click) is a valid action."""
    import envs

    local = envs.make(env_name)  # the same env, played alongside with the same seed and replies
    local.reset(seed=3)
    sid = None
    for step in range(1, 4):
        reply = _expert_reply(local)
        body = {"env": env_name, "seed": 3, "reply": reply} if sid is None else {"session_id": sid, "reply": reply}
        r = client.post("/v1/act", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        sid = out["session_id"]
        assert out["step"] == step and out["valid"], out
        assert out["admissible_actions"] == local.admissible_actions()
        assert ", ".join(local.admissible_actions()) in out["prompt"]
        _, reward, terminated, truncated, _ = local.step(reply)
        assert out["reward"] == pytest.approx(reward) and out["done"] == (terminated or truncated)
        if out["done"]:
            break
    # the policy can also decide (the untrained model's reply is whatever it is, parsed by the env); a page longer
    # than the served model's context ends the episode with a 400 that says so, never a 500
    if not out["done"]:
        r = client.post("/v1/act", json={"session_id": sid, "max_tokens": 8})
        if r.status_code == 200:
            assert r.json()["step"] == step + 1 and isinstance(r.json()["valid"], bool)
        else:
            assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"], r.text
    assert client.delete(f"/v1/act/{sid}").json()["deleted"]


BAD_REQUESTS = [
    # (method, path, headers, body, expected status, words the message must contain)
    ("POST", "/v1/chat/completions", {}, b"{not json", 400, "invalid request"),
    ("POST", "/v1/chat/completions", {}, json.dumps({"messages": []}).encode(), 400, "messages"),
    ("POST", "/v1/chat/completions", {}, json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(),
     400, "role"),
    ("POST", "/v1/chat/completions", {}, json.dumps(
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}).encode(), 400, "max_tokens"),
    ("POST", "/v1/chat/completions", {}, json.dumps(
        {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(), 400, "temperature"),
    ("POST", "/v1/chat/completions", {}, json.dumps(
        {"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]}).encode(), 404, "unknown model"),
    ("POST", "/v1/chat/completions", {}, json.dumps(
        {"messages": [{"role": "user", "content": "word " * 3000}]}).encode(), 400, "max_model_len"),
    ("POST", "/v1/chat/completions", {}, json.dumps({"messages": [{"role": "user", "content": None}]}).encode(),
     400, "needs content"),
    ("POST", "/v1/chat/completions", {}, json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "calculator"}}], "tool_choice": {
            "type": "function", "function": {"name": "search"}}}).encode(), 400, "not among the request's tools"),
    ("POST", "/v1/chat/completions", {}, json.dumps({"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
            "name": "calculator", "arguments": "{not json"}}]}, {"role": "tool", "content": "1"}],
        "tools": [{"type": "function", "function": {"name": "calculator"}}]}).encode(), 400, "not valid JSON"),
    ("POST", "/v1/responses", {}, json.dumps({"input": "x", "previous_response_id": "resp_1"}).encode(), 400,
     "keeps no responses"),
    ("POST", "/v1/responses", {}, json.dumps({"input": [{"type": "file_search_call"}]}).encode(), 400,
     "input[0].type: 'file_search_call' is not supported"),
    ("POST", "/v1/completions", {}, json.dumps({"prompt": ""}).encode(), 400, "prompt"),
    # found by schemathesis: an empty stop string reached vLLM's SamplingParams and came back a 500
    ("POST", "/v1/completions", {}, json.dumps({"prompt": "x", "stop": ["a", ""]}).encode(), 400, "stop"),
    ("POST", "/v1/chat/completions", {}, json.dumps(
        {"messages": [{"role": "user", "content": "x"}], "stop": ""}).encode(), 400, "stop"),
    ("POST", "/v1/act", {}, json.dumps({"env": "no-such-env", "observation": "x"}).encode(), 400, "not served here"),
    ("POST", "/v1/act", {}, json.dumps({"env": "sokoban"}).encode(), 400, "seed"),
    ("POST", "/v1/act", {}, json.dumps({"env": "", "observation": "x"}).encode(), 400, "env"),
    ("POST", "/v1/act", {}, json.dumps({"session_id": "short", "observation": "x"}).encode(), 400, "session_id"),
    ("POST", "/v1/act", {}, json.dumps({"env": "sokoban", "observation": "x", "env_kwargs": {"dim_room": [9, 9]}}
                                       ).encode(), 400, "may not be set"),
    ("POST", "/v1/episodes", {}, json.dumps({"env": "envs.sokoban:Sokoban"}).encode(), 400, "not served here"),
    ("POST", "/v1/episodes", {}, json.dumps({"env": "sokoban", "split": "nope"}).encode(), 400, "held-out split"),
    ("POST", "/v1/episodes", {}, json.dumps({"env": "sokoban", "seed": "x"}).encode(), 400, "seed"),
    ("POST", "/v1/chat/completions", {}, b"x" * (70 * 1024), 413, "larger than"),
    ("POST", "/v1/chat/completions", {"Authorization": "Bearer wrong"}, b"{}", 401, "bearer token"),
    ("GET", "/v1/models", {"Authorization": ""}, None, 401, "bearer token"),
    ("GET", "/v1/nothing-here", {}, None, 404, "not found"),
]


@pytest.mark.parametrize(("method", "path", "headers", "body", "status", "words"), BAD_REQUESTS)
def test_bad_requests_get_a_clear_4xx(client, method, path, headers, body, status, words):
    r = client.request(method, path, content=body, headers={"Content-Type": "application/json", **headers})
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert words.lower() in message.lower(), message


def test_openapi_declares_what_the_routes_return(agent):
    """Every route declares the 4xx it can answer, with the error body; none declares FastAPI's 422, which the
    endpoint never sends (a request that fails validation is a 400 with a message)."""
    doc = httpx.get(f"{agent}/openapi.json", timeout=30).json()
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            codes = set(op["responses"])
            assert "422" not in codes and "401" in codes, (path, method, codes)
            if method == "post":
                assert {"400", "411", "413"} <= codes, (path, codes)
    assert "409" in doc["paths"]["/v1/act"]["post"]["responses"]
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/completions"):  # `stream: true`: SSE
        assert {"application/json", "text/event-stream"} <= set(doc["paths"][path]["post"]["responses"]["200"][
            "content"]), path
    # what a real stream sends, parsed into events the way schemathesis does, meets the declared per-event schema
    import jsonschema

    event_schema = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"][
        "text/event-stream"]["schema"]
    r = httpx.post(f"{agent}/v1/chat/completions", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True, "n": 2})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = [{"event": "message", "data": "\n".join(line[len("data: "):] for line in block.splitlines())}
              for block in r.text.strip().split("\n\n")]
    assert len(events) > 2 and events[-1]["data"] == "[DONE]"
    for event in events:
        jsonschema.validate(event, event_schema)
    assert all(json.loads(e["data"])["object"] == "chat.completion.chunk" for e in events[:-1])
    assert doc["components"]["schemas"]["ActRequest"]["properties"]["session_id"]["anyOf"][0]["minLength"] == 8


def test_schemathesis_finds_no_server_error_and_no_undeclared_response(agent, tmp_path):
    """Property-based fuzzing of the endpoint from its own OpenAPI document (schemathesis, every check but the
    ones whose premise the API cannot meet): no 5xx, every response declared, every 4xx with its body, auth on
    every /v1 route. Left out: positive_data_acceptance (valid-by-schema data that a configured bound refuses:
    an env the server does not serve, max_tokens above the server's limit)."""
    import subprocess
    import sys
    from pathlib import Path

    st = str(Path(sys.executable).with_name("schemathesis"))
    out = subprocess.run(
        [st, "--no-color", "run", f"{agent}/openapi.json", "--checks", "all",
         "--exclude-checks", "positive_data_acceptance", "--max-examples", "8",
         "--workers", "2", "-H", f"Authorization: Bearer {TOKEN}", "--phases", "examples,coverage,fuzzing"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]

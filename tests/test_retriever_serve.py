"""The Ray Serve retrieval server: HTTP route, handle client, batching, and the search env on top of it."""

from __future__ import annotations

import uuid

import httpx
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def retriever_app(serve_url: str):
    from ray import serve

    from app.retriever import build_retriever_app

    name = f"retriever-{uuid.uuid4().hex[:8]}"
    handle = serve.run(build_retriever_app({"backend": "bm25", "corpus": "builtin", "top_k": 3, "max_k": 10}),
                       name=name, route_prefix="/retriever")
    yield name, handle
    serve.delete(name)


def test_http_route(serve_url: str, retriever_app) -> None:
    from envs.data.encyclopedia import build_encyclopedia

    question = next(q for q in build_encyclopedia(0).questions if len(q.hops) == 1)
    url = f"{serve_url}/retriever/retrieve"
    reply = httpx.post(url, json={"queries": [question.hops[0], "zzz qqq", "born in city"], "k": 2}, timeout=30)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["k"] == 2 and len(body["results"]) == 3 and [len(r) for r in body["results"][1:]] == [0, 2]
    assert any(question.answers[0] in p for p in body["results"][0])  # no shared word, no result: "zzz qqq" gets []
    assert len(httpx.post(url, json={"queries": ["x"]}, timeout=30).json()["results"][0]) <= 3  # default top_k
    for bad in [{"queries": []}, {"queries": "x"}, {"queries": ["x"], "k": 0}, {"queries": ["x"], "k": 11},
                {"k": 2}, {"queries": ["x"], "extra": 1}]:
        assert 400 <= httpx.post(url, json=bad, timeout=30).status_code < 500, bad
    assert httpx.get(f"{serve_url}/retriever/health", timeout=30).json()["backend"] == "bm25"


def test_handle_client_drives_the_search_env(retriever_app) -> None:
    import envs
    from app.retriever import RetrieverClient

    name, handle = retriever_app
    client = RetrieverClient(name)
    many = [f"q{i} founded" for i in range(40)]  # concurrent queries go through the batcher
    assert len(client.search(many, 3)) == 40
    env = envs.make("search", retriever=RetrieverClient(handle))
    for seed in range(5):
        env.reset(seed=seed)
        while True:
            _, _, terminated, truncated, info = env.step(env.expert_action())
            if info.get("results"):
                assert len(info["results"]) == 3
            if terminated or truncated:
                break
        assert info["won"]


def test_async_handle_in_the_episode_runner_and_failures_are_counted(retriever_app) -> None:
    """The way env-group actors search (`retriever: serve`): the deployment's handle awaited inside the episode
    runner's event loop (no blocking `.result()`); a search the server refuses is an observation and a counted
    env error, never a crash."""
    import asyncio

    import envs
    import memory
    from actors.episodes import episode_metrics, play, scripted_decider
    from actors.retrieval import attach_retriever

    _, handle = retriever_app

    def expert(turn):
        action = turn.env.expert_action()
        return action if action.startswith("<") else f"<action>{action}</action>"

    async def episodes(top_k: int):
        kwargs = {"retriever": "serve", "top_k": top_k}
        games = [attach_retriever(envs.make("search", **kwargs), kwargs, handle) for _ in range(4)]
        return await asyncio.gather(*(play(g, memory.make("none"), scripted_decider(expert), seed=s)
                                      for s, g in enumerate(games)))

    good = asyncio.run(episodes(top_k=3))
    assert all(e.won for e in good) and episode_metrics(good)["env_errors"] == 0
    refused = asyncio.run(episodes(top_k=50))  # above the server's max_k: every search is refused
    counts = episode_metrics(refused)
    assert counts["env_errors"] >= 4 and counts["episodes"] == 4
    assert all("search failed" in s.observation or s.step == 0 for e in refused for s in e.steps)
    with pytest.raises(RuntimeError, match="retriever deployment"):
        envs.make("search", retriever="serve").retriever  # noqa: B018 - without a deployment: a clear error

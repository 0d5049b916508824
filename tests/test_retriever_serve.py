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

"""The retrieval server: BM25 or dense search over a corpus as a Ray Serve application.

`serve run serve_configs/retriever.yaml` serves ``POST /retriever/retrieve`` with ``{"queries": [...], "k": 3}`` and
returns ``{"results": [[passage, ...], ...]}``. Queries from concurrent requests are grouped with `@serve.batch`,
so many env actors searching at once share one batched index lookup. Inside Ray, `RetrieverClient` wraps a handle
to the deployment and is a drop-in `retriever` for the search env:
``envs.make("search", retriever=RetrieverClient("retriever"))``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from actors.config import RetrieverConfig
from envs import retrieval


class RetrieveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    queries: list[str] = Field(..., min_length=1)
    k: int | None = Field(None, ge=1)


api = FastAPI(title="raygent retriever")


def _passages(config: RetrieverConfig) -> list[str]:
    if config.corpus == "builtin":
        from envs.data.encyclopedia import build_encyclopedia

        return build_encyclopedia(config.corpus_seed).passages
    return retrieval.load_corpus(config.corpus)


class _Index:
    """One index per replica; `search` (handle) and, on the HTTP server, ``POST /retrieve`` both go through the
    batcher."""

    def __init__(self, config: dict[str, Any] | RetrieverConfig):
        self.config = config if isinstance(config, RetrieverConfig) else RetrieverConfig(**config)
        kwargs = {"model_path": self.config.model_path} if self.config.backend == "dense" else {}
        self.index = retrieval.build_retriever(self.config.backend, _passages(self.config), **kwargs)
        self._batched.set_max_batch_size(self.config.max_batch_size)
        self._batched.set_batch_wait_timeout_s(self.config.batch_wait_timeout_s)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def _batched(self, items: list[tuple[str, int]]) -> list[list[str]]:
        # One lookup at the largest k of the batch, each answer cut to its own k.
        k = max(k for _, k in items)
        hits = await asyncio.to_thread(self.index.search, [q for q, _ in items], k)
        return [row[:k_i] for row, (_, k_i) in zip(hits, items, strict=True)]

    def _check(self, queries: list[str], k: int | None) -> int:
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            raise ValueError("queries must be a list of strings")
        if len(queries) > self.config.max_queries:
            raise ValueError(f"at most {self.config.max_queries} queries per request, got {len(queries)}")
        if any(len(q) > self.config.max_query_chars for q in queries):
            raise ValueError(f"a query is longer than {self.config.max_query_chars} characters")
        k = self.config.top_k if k is None else int(k)
        if not 1 <= k <= self.config.max_k:
            raise ValueError(f"k must be between 1 and {self.config.max_k}, got {k}")
        return k

    async def search(self, queries: list[str], k: int | None = None) -> list[list[str]]:
        """Top-k passages per query (the `envs.retrieval.Retriever` protocol, over a handle)."""
        k = self._check(queries, k)
        return list(await asyncio.gather(*(self._batched((q, k)) for q in queries)))


# Inside another application (the training app, the agent endpoint) the retriever is reached by handle only: an
# application has one HTTP ingress. On its own (`serve_configs/retriever.yaml`) it is that ingress.
Retriever = serve.deployment(name="Retriever", ray_actor_options={"num_cpus": 0.25})(_Index)


@serve.deployment(name="Retriever", ray_actor_options={"num_cpus": 0.25}, graceful_shutdown_wait_loop_s=0.5)
@serve.ingress(api)
class RetrieverServer(_Index):
    @api.post("/retrieve")
    async def retrieve(self, request: RetrieveRequest) -> dict[str, Any]:
        from fastapi import HTTPException

        try:
            k = self._check(request.queries, request.k)
        except ValueError as err:
            raise HTTPException(status_code=400, detail=str(err)) from None
        return {"results": await self.search(request.queries, k), "k": k}

    @api.get("/health")
    async def health(self) -> dict[str, Any]:
        return {"backend": self.config.backend, "passages": len(self.index.passages)}  # type: ignore[attr-defined]


def build_retriever_app(args: dict[str, Any]) -> Application:
    """The Serve application for `serve_configs/retriever.yaml`; a bad config fails here, naming the field."""
    config = RetrieverConfig(**args)
    return RetrieverServer.bind(config.model_dump())


class RetrieverClient:
    """A `Retriever` (``search(queries, k)``) that asks the deployment through a handle; blocking, so it suits the
    search env inside env-group actors or a driver. Give a handle, or the Serve application's name."""

    def __init__(self, handle: DeploymentHandle | str, timeout_s: float = 60.0):
        self.handle = serve.get_app_handle(handle) if isinstance(handle, str) else handle
        self.timeout_s = timeout_s

    def search(self, queries: list[str], k: int) -> list[list[str]]:
        return self.handle.search.remote(list(queries), k).result(timeout_s=self.timeout_s)
